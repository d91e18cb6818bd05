"""`FunctionalPosterior` (``"gp"``): the linearised Laplace approximation in function space, a
Gaussian process over a subset of the data (laplace-torch 0.3's ``FunctionalLaplace`` and, on a
last layer, ``FunctionalLLLaplace``).

Linearised at ``t*``, the network is a GLM in the coordinates ``t``; with the prior
``t ~ N(m₀, Λ₀⁻¹)`` its outputs are a GP with the neural tangent kernel
``k(x, x') = J(x) Λ₀⁻¹ J(x')ᵀ`` (Khan et al. 2019, "Approximate inference turns deep networks
into Gaussian processes"; Immer et al. 2021, "Improving predictions of Bayesian neural nets via
local linearization", section 3 and appendix A). laplace-torch's subset-of-data form, which this
module reproduces:

- the ``M`` points ``numpy.random.default_rng(seed).choice(N, M, replace=False)`` of the ``N``
  (laplace-torch's ``SoDSampler``: the same ``seed`` gives the same subset, `sod_indices`);
- the prior variance scaled by ``M/N``: ``S = Λ₀⁻¹ M/N``, i.e. the effective prior
  ``Λ₀' = Λ₀ N/M`` (`effective_prior`);
- each output Hessian ``Λ_m`` replaced by its diagonal ``h_m`` (Immer et al. A.2.1: exact for a
  Gaussian likelihood, the diagonal of ``diag(p) − ppᵀ`` for a softmax);
- ``independent_outputs``: the kernel's cross-output entries dropped (one GP per output).

With ``J_M`` ``(R, K)`` the Jacobian rows of the subset (``R = M·O``, row ``m·O + c``),
``K_MM = J_M S J_Mᵀ`` and ``W = diag(√h)``, the predictive of ``f* = f(x*)`` is (Immer et al.
eq. 15, Rasmussen & Williams eq. 3.24)

    f* ~ N(f(x*, ŵ), K** − K*M W (W K_MM W + T I)⁻¹ W K_M*),     K*M = J* S J_Mᵀ,

computed from the ``(R, R)`` Cholesky factor of ``W K_MM W + T I`` (`factor`), never a
``(K, K)`` matrix. By the push-through identity ``(S⁻¹ + AᵀA/T)⁻¹ = S − S Aᵀ(A S Aᵀ + T I)⁻¹A S``
(``A = W J_M``) this is the weight-space Laplace posterior of the subset,

    Σ⁻¹ = J_Mᵀ diag(h) J_M / T + Λ₀'  =  C̃/T + Λ₀',

so the `Posterior` contract holds: `covariance`, `precision`, `curvature`, `draw`, `log_det` are
formed from ``J_M`` on request (``(K, K)``: for the sizes where that is affordable). With
``independent_outputs`` no Gaussian over the weights has this predictive (each output has its
own ``Σ_c``): the weight-space methods then raise, saying so.

The evidence (`log_evidence`) is laplace-torch 0.3's ``FunctionalLaplace.log_marginal_likelihood``
(Rasmussen & Williams eqs. 2.30 and 3.32 on the subset):

- regression (a Gaussian likelihood with one noise scale ``σ``): ``−SSE_M/(2σ²T) −
  N·O·log(σ√2π) − ½ log|K_MM + σ²I| − ½ μᵀ(K_MM + σ²I)⁻¹μ``, ``μ = y − f + J_M(t* − m₀)``;
- otherwise: ``log p(y_M | f)/T − ½ log|I + W K_MM W/T| − ½ μᵀ(K_MM + 10⁻⁵ I)⁻¹μ``,
  ``μ = J_M(t* − m₀)``;

(``SSE_M`` and ``log p(y_M | f)`` over the subset, the normaliser over all ``N`` points, as
laplace-torch writes it), differentiable in ``λ`` and ``σ``.

Memory: ``J_M`` ``(M·O, K)`` float64 and two ``(M·O, M·O)`` matrices (with
``independent_outputs`` one ``(M, M)`` block per output: ``O`` times less, and ``O²`` times
fewer multiplications for the factor). Where ``J_M`` would
take more than `MAX_JACOBIAN_BYTES` (a large network: laplace-torch's calibration example has
about 900k weights), it is not kept: the subset's inputs are (``subset_inputs``, a tensor), and
``J_M`` is recomputed block by block (`STREAM_BLOCK_BYTES` each) where it is needed, as
laplace-torch does: ``K_MM`` at the fit (one block against every later block), ``K*M`` at each
prediction. That *streamed* form needs the model (the guide's, attached at the fit and at each
`linearized_outputs`), a shared ``λ`` and no weight-space ``(K, K)`` answer. A kernel
``(M·O, M·O)`` beyond `MAX_KERNEL_BYTES` is refused before any work, naming ``n_subset``.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from .... import batch as batching
from .... import validation as ck
from ....data import KeyedBatches, split_batch
from ....flat import FlatNet
from ....linalg import cholesky, logdet
from .base import Posterior, PriorPrecision, stacked_jacobians

#: the most bytes ``J_M`` ``(M·O, K)`` float64 may take (4 GiB): a larger subset is refused
#: before any work, naming ``n_subset`` (laplace-torch recomputes ``J_M`` at every prediction
#: instead; here it is kept, so predictions cost no pass over the subset)
MAX_JACOBIAN_BYTES = 4 * 2**30
#: the most bytes one recomputed block of ``J_M`` takes in the streamed form (1 GiB: 15 points
#: of laplace-torch's calibration CNN, ~900k weights and 10 classes; two blocks are alive at
#: once at the fit; the fit recomputes ``(M/b)²/2`` blocks of ``b`` points, as laplace-torch
#: does with its loader's batches)
STREAM_BLOCK_BYTES = 2**30
#: the most bytes the ``(M·O, M·O)`` kernel may take (2 GiB: ``M·O ≤ 16384``); the fit keeps it
#: and its Cholesky factor, so a larger subset is refused before any work, naming ``n_subset``
MAX_KERNEL_BYTES = 2 * 2**30
#: laplace-torch's regulariser of the classification evidence's scatter term
#: ``μᵀ(K_MM + εI)⁻¹μ`` (``FunctionalLaplace.scatter``'s ``eps``)
SCATTER_EPS = 1e-5
#: the buffers a fit or `set_prior` replaces (never written in place)
BUFFERS = (
    "jac", "hess", "mean_offset", "subset", "stats", "prior_variance", "factor",
    "subset_inputs", "raw_gram", "fit_point",
)  # fmt: skip
#: the fit's scalars in the ``stats`` buffer, in order
STATS = ("num_data", "num_outputs", "subset_loglik", "subset_sse", "regression")


def sod_indices(num_data: int, n_subset: int, seed: int) -> torch.Tensor:
    """laplace-torch's subset of data (``laplace.utils.SoDSampler``): the ``(M,)`` indices
    ``numpy.random.default_rng(seed).choice(N, M, replace=False)``, in that order (numpy's
    ``choice`` of ``range(N)`` and of ``N`` draw the same indices). Uses no global generator."""
    rng = np.random.default_rng(seed)
    return torch.as_tensor(rng.choice(num_data, n_subset, replace=False), dtype=torch.long)


def subset_rows(data, index: torch.Tensor) -> tuple[object, torch.Tensor]:
    """The rows ``index`` ``(M,)`` of a `DataSource`, in that order, as ``(x, y)``: taken from
    tensors, or from a ``DataLoader``'s map-style ``dataset`` by index and joined by its
    ``collate_fn`` (laplace-torch draws them from ``train_loader.dataset`` the same way; the
    loader's own order and shuffling play no part)."""
    if data.loader is None:
        return batching.take(data.x, index), data.y[index]
    loader = data.loader
    dataset = loader.dataset
    split = data.split_batch
    if isinstance(dataset, KeyedBatches):  # dict batches with the targets under another key
        key, loader = dataset.dict_key_y, dataset.loader
        dataset = loader.dataset
        split = lambda batch: split_batch(batch, key)  # noqa: E731
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            "n_subset: the subset of data is drawn by index from the DataLoader's dataset (as "
            "laplace-torch draws it), which an IterableDataset does not allow; pass the data as "
            "tensors or a map-style Dataset"
        )
    collate = loader.collate_fn if isinstance(loader, DataLoader) else None
    items = [dataset[int(i)] for i in index]
    batch = collate(items) if collate is not None else torch.utils.data.default_collate(items)
    return split(batch)


def dataset_size(data) -> int:
    """``N`` as laplace-torch counts it: ``len(train_loader.dataset)`` for a loader, else the
    rows."""
    if data.loader is None:
        return data.num_data
    dataset = data.loader.dataset
    if isinstance(dataset, KeyedBatches):
        dataset = dataset.loader.dataset
    try:
        return len(dataset)
    except TypeError:
        return data.num_data


class FunctionalPosterior(Posterior):
    """The GP (function-space) view of the linearised Laplace posterior on a subset of ``M``
    data points (module docstring): laplace-torch's ``hessian_structure="gp"``.

    Args:
        dim: ``K``.
        dtype: accepted for the common constructor; the buffers are float64.
        device: of the buffers.
        n_subset: ``M``, the data points the GP is conditioned on (``None``: all ``N``, the exact
            GP view of the weight-space Laplace with diagonal output Hessians); at most ``N``
            (checked at the fit, before any work).
        independent_outputs: one GP per output (the kernel's cross-output entries dropped),
            laplace-torch's ``independent_outputs``; the predictive's output covariances are
            then 0 and there is no weight-space posterior.
        seed: of the subset's draw (``numpy.random.default_rng(seed)``, `sod_indices`), as
            laplace-torch's ``seed`` (default 0).
    """

    name = "gp"

    def __init__(
        self,
        dim: int,
        dtype: torch.dtype = torch.float64,
        device=None,
        n_subset: int | None = None,
        independent_outputs: bool = False,
        seed: int = 0,
    ) -> None:
        ck.positive_int(n_subset, "n_subset", allow_none=True)
        ck.choice(independent_outputs, "independent_outputs", (True, False))
        ck.check_int(seed, "seed", 0)
        super().__init__(dim, dtype, device)
        self.n_subset = n_subset
        self.independent_outputs = bool(independent_outputs)
        self.seed = int(seed)
        f64 = {"dtype": torch.float64, "device": device}
        self.register_buffer("jac", torch.zeros(0, dim, **f64))  # J_M (R, K), row m·O + c
        self.register_buffer("hess", torch.zeros(0, **f64))  # h (R,): diagonal output Hessians
        self.register_buffer("mean_offset", torch.zeros(0, **f64))  # μ (R,) of the evidence
        self.register_buffer("subset", torch.zeros(0, dtype=torch.long, device=device))
        self.register_buffer("stats", torch.zeros(len(STATS), **f64))  # `STATS`
        self.register_buffer("prior_variance", torch.zeros(0, **f64))  # S (K,): 1/λ_eff
        self.register_buffer("factor", torch.zeros(0, 0, **f64))  # chol(W K_MM W + T I)
        # the streamed form (J_M not kept): the subset's inputs, J_M J_Mᵀ and t at the fit
        self.register_buffer("subset_inputs", torch.zeros(0, **f64))
        self.register_buffer("raw_gram", torch.zeros(0, 0, **f64))
        self.register_buffer("fit_point", torch.zeros(dim, **f64))
        self.__dict__["_gram_cache"] = None
        self.__dict__["_model"] = None  # a weakref to the guide's SubspaceNet (streamed J_M)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, n_subset={self.n_subset}, "
            f"independent_outputs={self.independent_outputs}, seed={self.seed}"
        )

    def buffers_replaced_only(self) -> tuple[str, ...]:
        """Every buffer of the fit and the prior is replaced, never written in place
        (`transaction.REPLACED_ONLY`: an all-or-nothing fit keeps ``J_M`` by reference)."""
        return BUFFERS

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        for name in BUFFERS:  # the fitted shapes (R depends on the data)
            if prefix + name in state_dict:
                self._buffers[name] = torch.empty_like(state_dict[prefix + name])
        self.__dict__["_gram_cache"] = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ the fit's scalars

    def _stat(self, name: str) -> float:
        return float(self.stats[STATS.index(name)])

    @property
    def fitted_rows(self) -> int:
        """``R = M·O``, the kernel's rows (0 before a fit)."""
        return self.hess.shape[0]

    @property
    def streamed(self) -> bool:
        """Whether ``J_M`` is recomputed where needed instead of kept (module docstring)."""
        return self.fitted_rows > 0 and self.jac.shape[0] == 0

    def _refuse_streamed(self, what: str) -> None:
        if self.streamed:
            raise ValueError(
                f"n_subset: the subset's Jacobians were too large to keep (more than "
                f"{MAX_JACOBIAN_BYTES / 2**30:.0f} GiB), so {what} is not available; the "
                "function-space predictive and the evidence with one prior precision are, or "
                "pass a smaller n_subset"
            )

    def _subset_blocks(self, first_point: int = 0):
        """``(start, J_block (b·O, K))`` float64 over ``J_M``'s rows from the point
        ``first_point`` on: the kept ``J_M``, or in the streamed form blocks of ``b`` points
        (`STREAM_BLOCK_BYTES`) recomputed from ``subset_inputs`` at ``t`` of the fit, each by
        one complete call of the subspace's Jacobians (so two of these generators may run
        interleaved)."""
        o = self.num_outputs
        if not self.streamed:
            yield first_point * o, self.jac[first_point * o :]
            return
        ref = self.__dict__.get("_model")
        model = None if ref is None else ref()
        if model is None:
            raise RuntimeError(
                "FunctionalPosterior: its subset's Jacobians are recomputed with the model, "
                "which a loaded state does not carry: predict once with la(x) (or "
                "linearized_moments), which attaches it"
            )
        sub = model.subspace
        w = sub.weights(self.fit_point.to(sub.shift)).detach()
        flat = FlatNet(model.flat.net, batch_strategy="loop")
        points = max(1, STREAM_BLOCK_BYTES // (8 * o * self.dim))
        m = self.subset_inputs.shape[0]
        for i0 in range(first_point, m, points):
            inputs = self.subset_inputs[i0 : min(i0 + points, m)]
            if inputs.is_floating_point():
                inputs = inputs.to(sub.shift.dtype)
            parts = [jp for _, jp in sub.jacobian_blocks(flat, inputs, w, points)]
            yield i0 * o, torch.cat(parts).detach().double().reshape(-1, self.dim)

    def linearized_outputs(self, model, x, w, chunk_size, diagonal=False):
        """`Posterior.linearized_outputs`, with ``model`` attached first (the streamed form
        recomputes ``J_M`` with it)."""
        self.__dict__["_model"] = weakref.ref(model)
        return super().linearized_outputs(model, x, w, chunk_size, diagonal)

    @property
    def num_outputs(self) -> int:
        return int(self._stat("num_outputs"))

    @property
    def subset_factor(self) -> float:
        """``N/M``: the effective prior is ``Λ₀ N/M`` (1 before a fit)."""
        m = self.subset.numel()
        return self._stat("num_data") / m if m else 1.0

    def _check_fitted(self) -> None:
        if self.fitted_rows == 0:
            raise RuntimeError("FunctionalPosterior: call fit_curvature first")

    def _weight_space(self, what: str) -> None:
        """The weight-space methods exist only without ``independent_outputs``."""
        if self.independent_outputs:
            raise ValueError(
                f"independent_outputs: one GP per output has no single Gaussian over the weights, "
                f"so {what} is not defined; use the function-space predictive (la(x), "
                "functional_samples, predictive_samples) or independent_outputs=False"
            )

    # ------------------------------------------------------------------ building

    def fit_curvature(self, evaluator, t: torch.Tensor, **kwargs: object) -> None:
        """Draw the subset (`sod_indices` with ``seed``), then keep at ``t`` its Jacobian rows
        ``J_M``, the diagonal output Hessians ``h`` and what the evidence needs (``μ``, the
        subset's log-likelihood and residual sum of squares). ``n_subset > N``, a sharded data
        source or an ``IterableDataset`` are refused before any Jacobian is computed."""
        model, data = evaluator.model, evaluator.data
        if getattr(data, "sharded", False):
            raise ValueError(
                "n_subset: hessian_structure='gp' draws its subset by index from all the data, "
                "which one rank's shard does not hold; fit it on one process"
            )
        num_data = dataset_size(data)
        m = num_data if self.n_subset is None else self.n_subset
        if m > num_data:
            raise ValueError(
                f"n_subset: {m} is more than the {num_data} data points; pass n_subset <= "
                f"{num_data}"
            )
        index = sod_indices(num_data, m, self.seed)
        x, y = subset_rows(data, index.to("cpu"))
        if y is None:
            raise ValueError("y: hessian_structure='gp' needs targets (its evidence reads them)")
        sub, lik = model.subspace, model.likelihood
        w = sub.weights(t.to(sub.shift)).detach()
        probe = model.outputs(t.to(sub.shift), batching.take(x, slice(0, 1)))
        o = probe.shape[-1]
        kernel_bytes = 8 * m * m * (o if self.independent_outputs else o * o)
        if kernel_bytes > MAX_KERNEL_BYTES:
            raise ValueError(
                f"n_subset: the GP kernel over {m} points x {o} outputs "
                f"({'one per output' if self.independent_outputs else 'joint'}) takes "
                f"{kernel_bytes / 2**30:.1f} GiB, more than {MAX_KERNEL_BYTES / 2**30:.0f} GiB; "
                "pass a smaller n_subset"
            )
        streamed = 8 * m * o * self.dim > MAX_JACOBIAN_BYTES
        if streamed and not isinstance(x, torch.Tensor):
            raise ValueError(
                f"n_subset: the subset's Jacobian ({m} points x {o} outputs x {self.dim:,} "
                f"weights) takes {8 * m * o * self.dim / 2**30:.1f} GiB, more than "
                f"{MAX_JACOBIAN_BYTES / 2**30:.0f} GiB, and inputs that are a mapping cannot "
                "be kept to recompute it; pass a smaller n_subset"
            )
        flat = FlatNet(model.flat.net, batch_strategy="loop")
        chunk = getattr(data, "chunk_size", 1024)
        d = (t.double() - model.prior_loc.double().to(t.device))  # t* − m₀
        if streamed:  # J_M in blocks: K_MM one block against every later one, μ per block
            with torch.no_grad():
                f = model.outputs(t.to(sub.shift), x)
            self.fit_point = t.detach().double().clone()
            self.subset_inputs = x.detach().clone()
            self.jac = torch.zeros(0, self.dim, dtype=torch.float64, device=self.stats.device)
            self.hess = torch.zeros(m * o, dtype=torch.float64, device=self.stats.device)
            self.stats = self.stats.clone()
            self.stats[STATS.index("num_outputs")] = o
            self.__dict__["_model"] = weakref.ref(model)
            shape = (o, m, m) if self.independent_outputs else (m * o, m * o)
            gram = torch.zeros(shape, dtype=torch.float64, device=self.stats.device)
            offsets = []
            for i, a in self._subset_blocks():
                offsets.append(a @ d)
                for j, b in self._subset_blocks(first_point=i // o):  # this block and later
                    if self.independent_outputs:  # rows m·O + c: per output (O, b_a, b_b)
                        pa, pb = i // o, j // o
                        g = torch.einsum("pok,qok->opq", a.view(-1, o, self.dim), b.view(-1, o, self.dim))
                        gram[:, pa : pa + g.shape[1], pb : pb + g.shape[2]] = g
                        gram[:, pb : pb + g.shape[2], pa : pa + g.shape[1]] = g.mT
                    else:
                        gram[i : i + a.shape[0], j : j + b.shape[0]] = a @ b.T
                        gram[j : j + b.shape[0], i : i + a.shape[0]] = b @ a.T
            jac, offset = None, torch.cat(offsets)
        else:
            outs, jacs = [], []
            for out, jp in sub.jacobian_blocks(flat, x, w, chunk):
                outs.append(out), jacs.append(jp)
            f, jac = torch.cat(outs), torch.cat(jacs)  # shape: (M, O), (M, O, K)
            jac = jac.double().reshape(-1, self.dim)  # (R, K)
            offset = jac @ d  # J_M (t* − m₀)
        y = lik.validate(f, y.to(f.device))
        with torch.no_grad():
            loglik = float(lik.log_prob_prepared(f, y).double().sum())
            sse, _ = lik.residual_statistics(f, y)
            hess = lik.output_hessian(f).diagonal(dim1=-2, dim2=-1).double()  # (M, O)
        regression = bool(lik.noise_scale_tunable)
        if regression:  # μ = y − (f + J_M(m₀ − t*))
            offset = offset + (y.reshape(f.shape) - f).double().reshape(-1)
        self.temperature.fill_(evaluator.temperature)
        if streamed:
            self.raw_gram = (gram + gram.mT) / 2
        else:
            self.jac = jac.detach()
            self.subset_inputs = torch.zeros(0, dtype=torch.float64, device=self.stats.device)
            self.raw_gram = torch.zeros(0, 0, dtype=torch.float64, device=self.stats.device)
            self.fit_point = t.detach().double().clone()
        self.hess, self.mean_offset = hess.reshape(-1), offset.detach()
        self.subset = index.to(self.stats.device)
        self.stats = torch.tensor(
            [num_data, o, loglik, sse, float(regression)], dtype=torch.float64,
            device=self.stats.device,
        )  # fmt: skip
        self.prior_variance = torch.zeros(0, dtype=torch.float64, device=self.stats.device)
        self.factor = torch.zeros(0, 0, dtype=torch.float64, device=self.stats.device)
        self.__dict__["_gram_cache"] = None
        return None

    def scale_curvature_(self, c: float) -> None:
        """``h ← c h`` (a new noise scale: ``h = 1/σ²``)."""
        self.hess = self.hess * c

    def effective_prior(self, prior: PriorPrecision) -> PriorPrecision:
        """``Λ₀ N/M``: laplace-torch's subset-of-data prior (the kernel's variance ``M/(N λ)``),
        diagonal (a dense ``λ PᵀP`` by its diagonal)."""
        factor = self.subset_factor
        if prior.lam.dim() == 0 and prior.gram is None:
            return PriorPrecision(prior.lam * factor, None, prior.dim)
        return PriorPrecision(prior.diagonal() * factor, None, prior.dim)

    def set_prior(self, prior: PriorPrecision) -> None:
        """Factorise ``W K_MM W + T I`` ``(R, R)`` for ``S = Λ₀'⁻¹`` (``Λ₀'`` the
        `effective_prior` of the model's ``prior``)."""
        self._check_fitted()
        eff = self.effective_prior(PriorPrecision(prior.lam.detach(), prior.gram, prior.dim))
        self.prior_variance, self.factor = self._kernel_factor(eff)

    def _kernel_factor(self, eff: PriorPrecision) -> tuple[torch.Tensor, torch.Tensor]:
        """``S`` ``(K,)`` and ``chol(W K_MM W + T I)`` ``(R, R)`` for the effective prior
        ``eff``."""
        eff = PriorPrecision(eff.lam.detach(), eff.gram, eff.dim)
        s = (1.0 / eff.diagonal()).to(self.hess)
        w = self._by_output(self.hess.sqrt())
        c = w[..., :, None] * self.kernel(eff) * w[..., None, :]  # W K_MM W
        c.diagonal(dim1=-2, dim2=-1).add_(float(self.temperature))
        return s, cholesky((c + c.mT) / 2, "GP kernel W K_MM W + T I")

    def functional_covariance_on_grid(self, blocks, prior_at, rows=None):
        """``λ ↦ K** − K*M (K_MM + T Λ⁻¹)⁻¹ K_M*`` ``(N, O, O)`` for the effective priors
        ``prior_at(λ)`` (`tuning.grid_covariances` passes `effective_prior`'s: not scaled by
        ``N/M`` twice): one ``(R, R)`` factorisation per ``λ``, ``J_M`` shared."""
        jp = stacked_jacobians(blocks, self.dim, rows)

        def f_cov(lam: torch.Tensor) -> torch.Tensor:
            s, factor = self._kernel_factor(prior_at(torch.as_tensor(lam, dtype=torch.float64)))
            kss, v = self._cross(jp, s, factor)
            return kss - torch.bmm(v, v.mT)

        return f_cov

    # ------------------------------------------------------------------ kernels

    def _output_of_rows(self, n: int) -> torch.Tensor:
        """The output index ``(n,)`` of ``n`` consecutive rows (row ``i`` is output ``i mod O``)."""
        return torch.arange(n, device=self.jac.device) % self.num_outputs

    def _by_output(self, v: torch.Tensor) -> torch.Tensor:
        """A row vector ``(R,)`` as the kernel holds it: itself, or with ``independent_outputs``
        one row per output ``(O, M)`` (row ``m·O + c`` is ``[c, m]``)."""
        if not self.independent_outputs:
            return v
        return v.view(-1, self.num_outputs).T

    def _raw_gram(self) -> torch.Tensor:
        """``J_M J_Mᵀ`` ``(R, R)``, or with ``independent_outputs`` one ``(M, M)`` block per
        output ``(O, M, M)`` (the cross-output entries are dropped: never formed); cached for a
        shared ``λ`` (the fit's in the streamed form)."""
        if self.streamed:
            return self.raw_gram
        key = (self.jac.data_ptr(), self.jac._version, self.jac.shape)
        cached = self.__dict__.get("_gram_cache")
        if cached is None or cached[0] != key:
            if self.independent_outputs:
                j3 = self.jac.view(-1, self.num_outputs, self.dim)
                g = torch.einsum("mok,nok->omn", j3, j3)
            else:
                g = self.jac @ self.jac.T
            self.__dict__["_gram_cache"] = cached = (key, (g + g.mT) / 2)
        return cached[1]

    def kernel(self, prior: PriorPrecision) -> torch.Tensor:
        """``K_MM = J_M S J_Mᵀ`` ``(R, R)`` (``(O, M, M)`` with ``independent_outputs``) for the
        effective prior ``prior`` (`effective_prior`), differentiable in its ``λ``."""
        if prior.lam.dim() == 0 and prior.gram is None:
            return self._raw_gram() / prior.lam
        self._refuse_streamed("a prior precision per weight (laplace-torch's is one number)")
        s = 1.0 / prior.diagonal()
        if self.independent_outputs:
            j3 = self.jac.view(-1, self.num_outputs, self.dim)
            k = torch.einsum("mok,k,nok->omn", j3, s, j3)
        else:
            k = (self.jac * s) @ self.jac.T
        return (k + k.mT) / 2

    def _cross(
        self, jp: torch.Tensor, s=None, factor=None, diagonal: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For ``J*`` ``(n, P, K)``: ``K**`` ``(n, P, P)`` (its diagonal ``(n, P)`` with
        ``diagonal``) and ``V = L⁻¹ W K_M*`` as ``(n, P, R)``, so that the predictive covariance
        is ``K** − V Vᵀ`` (at the prior of `set_prior`, or at ``S = s``, ``L = factor``). With
        ``independent_outputs`` only the same-output blocks of ``K*M`` are multiplied (``O``
        times fewer multiplications than the masked product)."""
        if s is None:
            if self.prior_variance.numel() == 0:
                raise RuntimeError("FunctionalPosterior: call set_prior first")
            s, factor = self.prior_variance, self.factor
        n, p, k = jp.shape
        jp = jp.to(self.hess)
        js = jp * s
        flat = js.reshape(n * p, k)
        if self.streamed:  # J_M block by block, recomputed (laplace-torch's cost per batch)
            ksm = flat.new_zeros(n * p, self.fitted_rows)
            for start, block in self._subset_blocks():
                ksm[:, start : start + block.shape[0]] = flat @ block.T
            if self.independent_outputs:
                c_test = self._output_of_rows(p).repeat(n)
                c_train = self._output_of_rows(self.fitted_rows)
                ksm = ksm * (c_test[:, None] == c_train[None, :])
        elif self.independent_outputs:
            o, r = self.num_outputs, self.fitted_rows
            train = self.jac.view(r // o, o, k)  # row m·O + c
            c_test = self._output_of_rows(p).repeat(n)
            ksm = flat.new_zeros(n * p, r // o, o)
            for c in range(o):
                rows = (c_test == c).nonzero()[:, 0]
                if rows.numel():
                    ksm[rows, :, c] = flat[rows] @ train[:, c, :].T
            ksm = ksm.reshape(n * p, r)
        else:
            ksm = flat @ self.jac.T  # shape: (n·P, R)
        if diagonal:
            kss = (js * jp).sum(-1)
        else:
            kss = torch.bmm(js, jp.mT)
            if self.independent_outputs:
                same = self._output_of_rows(p)
                kss = kss * (same[:, None] == same[None, :])
        wk = ksm * self.hess.sqrt()  # (K*M W)
        if self.independent_outputs:  # one (M, M) factor per output, V zero across outputs
            o = self.num_outputs
            c_test = self._output_of_rows(p).repeat(n)
            wk3, v = wk.view(n * p, -1, o), torch.zeros_like(wk).view(n * p, -1, o)
            for c in range(o):
                rows = (c_test == c).nonzero()[:, 0]
                if rows.numel():
                    sol = torch.linalg.solve_triangular(factor[c], wk3[rows, :, c].T, upper=False)
                    v[rows, :, c] = sol.T
            return kss, v.reshape(n, p, -1)
        v = torch.linalg.solve_triangular(factor, wk.T, upper=False)  # (R, n·P)
        return kss, v.T.reshape(n, p, -1)

    # ------------------------------------------------------------------ the evidence

    def log_det(self, prior: PriorPrecision, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """``log|s·C̃/T + Λ₀'| = log|Λ₀'| + log|I + s·W K_MM W/T|`` (the determinant lemma:
        ``(R, R)``, no ``(K, K)`` matrix), with ``prior`` the effective prior; differentiable in
        its ``λ`` and ``s``."""
        self._check_fitted()
        self._weight_space("the weight-space log-determinant")
        w = self.hess.sqrt()
        k = w[:, None] * self.kernel(prior) * w[None, :]
        inner = torch.eye(k.shape[0], dtype=k.dtype, device=k.device) + scale * k / float(
            self.temperature
        )
        return prior.log_det() + logdet((inner + inner.mT) / 2, "GP kernel I + W K W / T")

    def log_evidence(
        self,
        loglik: torch.Tensor | float,
        prior: PriorPrecision,
        offset: torch.Tensor,
        scale: float | torch.Tensor = 1.0,
        sigma: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        """laplace-torch 0.3's ``FunctionalLaplace.log_marginal_likelihood`` on the subset
        (module docstring), at the model's ``prior`` and the noise ``sigma`` (regression),
        differentiable in both; ``loglik``, ``offset`` and ``scale`` (the weight-space
        evidence's) are not used: the fit kept ``μ`` and the subset's likelihood terms."""
        self._check_fitted()
        eff = self.effective_prior(prior)
        kernel = self.kernel(eff)
        temperature = float(self.temperature)
        mu = self._by_output(self.mean_offset)  # (R,) or (O, M) as the kernel
        eye = torch.eye(kernel.shape[-1], dtype=kernel.dtype, device=kernel.device)
        if self._stat("regression"):
            if sigma is None:
                raise ValueError("sigma: the regression GP evidence needs the noise scale")
            sigma = torch.as_tensor(sigma, dtype=torch.float64, device=kernel.device)
            noise = sigma.square()
            num_data, outputs = self._stat("num_data"), self.num_outputs
            data = -self._stat("subset_sse") / (2 * noise * temperature) - num_data * outputs * (
                torch.log(sigma * math.sqrt(2 * math.pi))
            )
            gram = kernel + noise * eye
            log_det = logdet((gram + gram.mT) / 2, "GP kernel K_MM + σ² I").sum()
        else:
            data = torch.as_tensor(self._stat("subset_loglik") / temperature, dtype=torch.float64)
            w = self._by_output((self.hess / temperature).sqrt())
            inner = w[..., :, None] * kernel * w[..., None, :] + eye
            log_det = logdet((inner + inner.mT) / 2, "GP kernel I + W K_MM W / T").sum()
            gram = kernel + SCATTER_EPS * eye
        chol = cholesky((gram + gram.mT) / 2, "GP kernel of the scatter term")
        half = torch.linalg.solve_triangular(chol, mu[..., None], upper=False)
        return data - (log_det + half.square().sum()) / 2

    # ------------------------------------------------------------------ moments

    def functional_covariance(self, jp: torch.Tensor) -> torch.Tensor:
        """``K** − K*M W (W K_MM W + T I)⁻¹ W K_M*`` ``(n, P, P)`` float64 for ``J*``
        ``(n, P, K)`` (``P = O``, or all of a joint predictive's ``N·O`` rows with ``n = 1``:
        row ``i`` is output ``i mod O``); ``J* Σ J*ᵀ`` without ``independent_outputs``."""
        kss, v = self._cross(jp)
        cov = kss - torch.bmm(v, v.mT)
        return (cov + cov.mT) / 2

    def functional_variance(self, jp: torch.Tensor) -> torch.Tensor:
        """The diagonal ``(n, P)`` of `functional_covariance` (no ``(n, P, P)`` array)."""
        kss, v = self._cross(jp, diagonal=True)
        return kss - v.square().sum(-1)

    def _weight_factor(self) -> torch.Tensor:
        """``B = L⁻¹ W J_M S`` ``(R, K)``: ``Σ = S − BᵀB``."""
        self._check_fitted()
        self._weight_space("the weight-space posterior")
        self._refuse_streamed("the weight-space posterior (K, K)")
        if self.prior_variance.numel() == 0:
            raise RuntimeError("FunctionalPosterior: call set_prior first")
        a = self.jac * self.hess.sqrt()[:, None] * self.prior_variance
        return torch.linalg.solve_triangular(self.factor, a, upper=False)

    def covariance(self) -> torch.Tensor:
        """``Σ = S − S J_Mᵀ W (W K_MM W + T I)⁻¹ W J_M S`` ``(K, K)`` (push-through)."""
        b = self._weight_factor()
        cov = torch.diag(self.prior_variance) - b.T @ b
        return (cov + cov.T) / 2

    def precision(self) -> torch.Tensor:
        """``Σ⁻¹ = J_Mᵀ diag(h) J_M / T + Λ₀'`` ``(K, K)``."""
        self._check_fitted()
        self._weight_space("the weight-space precision")
        self._refuse_streamed("the weight-space precision (K, K)")
        p = self.curvature() / float(self.temperature)
        return p + torch.diag(1.0 / self.prior_variance)

    def curvature(self) -> torch.Tensor:
        """``C̃ = J_Mᵀ diag(h) J_M`` ``(K, K)``, untempered."""
        self._check_fitted()
        self._weight_space("the weight-space curvature")
        self._refuse_streamed("the weight-space curvature (K, K)")
        a = self.jac * self.hess.sqrt()[:, None]
        c = a.T @ a
        return (c + c.T) / 2

    def marginal_variance(self) -> torch.Tensor:
        """``diag Σ = S − Σ_r B²`` ``(K,)``."""
        return self.prior_variance - self._weight_factor().square().sum(0)

    def draw(self, eps: torch.Tensor) -> torch.Tensor:
        """``F ε`` with ``F = chol(Σ)`` (dense, `covariance`)."""
        return eps.double() @ self.cholesky().T


__all__ = ["MAX_JACOBIAN_BYTES", "FunctionalPosterior", "sod_indices"]
