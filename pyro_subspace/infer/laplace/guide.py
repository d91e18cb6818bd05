"""`AutoSubspaceLaplace`: the linearised Laplace guide of a `SubspaceNet`, a Pyro autoguide.

Subnetwork Inference (Daxberger et al., 2021), eqs. (9)–(15): around the MAP, the posterior over
the subspace coordinates ``t`` of ``w = ŵ + P t`` is approximated by

    q(t) = N(t*, Σ),   Σ⁻¹ = Pᵀ G P / T + Λ₀                                    (eq. 15)

with the generalised Gauss–Newton ``G = Σ_n J_nᵀ H_n J_n`` (eq. 9), the likelihood temperature
``T`` of the model and its prior precision ``Λ₀`` (the model's prior: model and guide share it).
With an index basis this is the paper's full-covariance subnetwork Laplace; with
`subspaces.ggn_eigen` a low-rank Laplace; ``hessian_structure="diag"`` keeps the diagonal only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import pyro
import torch
from pyro.infer.autoguide import AutoContinuous, AutoGuide

from ... import validation as ck
from ...linalg import row_gram, symmetrize_
from ...data import DataSource
from ...curvature.gram import RootRows
from ...nn import SubspaceNet
from ...nn.evaluator import Evaluator
from ...transaction import transactional
from .deferred import DeferredPosterior
from .map_search import _find_map, _newton, _warn_unconverged, has_kinks, posterior_offset
from .predictive import linearized_predictive
from .structures import make_structure
from .tuning import optimize_prior_precision

PRIOR_MEANS = ("shift", "zero")
#: The buffers of the curvature and the posterior, in the guide's ``dtype``.
POSTERIOR_BUFFERS = ("ggn", "precision", "covariance", "scale_tril")
#: a fit, refit or tuning either completes or leaves the guide and its model as they were
_all_or_nothing = transactional(lambda g: (g, g.model), lambda g: g._mark_unfitted())


class FitStatistics(NamedTuple):
    """What a fit records besides the posterior (the ``fit_statistics`` buffer, in order)."""

    temperature: float  #: ``T`` of the likelihood (0: not fitted)
    num_data: float  #: ``N``, the data points fitted
    residual_sum_of_squares: float  #: ``Σ (y − f(x, ŵ))²`` (Gaussian likelihoods; else 0)
    num_observations: float  #: the observations it sums (``N·O``)


class AutoSubspaceLaplace(DeferredPosterior, AutoContinuous):
    """A Laplace guide ``q(t) = N(t*, Σ)`` for the latent sites of a `SubspaceNet` (eq. 15).

    Follows Pyro's ``AutoLaplaceApproximation``: find the MAP, take the curvature there, give a
    Gaussian guide. Sites come from the model's prototype trace (`SubspaceNet.latent_model`), so
    it works unchanged in ``SVI``, ``Predictive`` and ``AutoGuideList``; `median`, `quantiles`,
    `get_posterior` as for Pyro's autoguides. All fitted state lives in buffers: a
    ``state_dict`` loaded into a guide built the same way gives the same predictions.

    The prior is the model's (`SubspaceNet.prior`): ``prior_mean="shift"``: ``N(0, λ⁻¹)``;
    ``"zero"``: the weight prior ``N(0, λ⁻¹ I_D)`` restricted to the subspace,
    ``Λ₀ = λ PᵀP``, ``m₀ = −(PᵀP)⁻¹ Pᵀ ŵ`` (when ``ŵ`` is the MAP of a network trained with that
    prior, ``t* = 0``). Giving ``prior_precision``/``prior_mean`` here sets the model's prior.

    Args:
        model: the `SubspaceNet`.
        prior_precision: ``λ > 0`` (float or ``(K,)``); ``None`` keeps the model's.
        prior_mean: ``"shift"`` or ``"zero"``; ``None`` keeps the model's.
        rescale_prior: use ``λ_S = λ·K/D`` (Subnetwork Inference, section 4 after eq. 15
            and appendix C).
        hessian_structure: ``"full"``, ``"diag"`` or ``"lowrank"`` (`structures`).
        chunk_size: rows of data per Jacobian block.
        rank: ``k`` of ``"lowrank"`` (top-``k`` GGN eigenpairs plus the prior as an isotropic
            remainder, `lowrank.LowRankStructure`), ``1 <= k <= K``; default ``min(K, 10)``.
        dtype: of the ``(K, K)`` buffers of the full structure (``ggn``, ``precision``,
            ``covariance``, ``scale_tril``): ``None`` the network's, so a float32 network gets
            float32 Jacobian products summed in float64 and a float32 factorisation (as fast and
            half as large as float64; relative rounding about ``1e-7`` times the precision's
            condition number), a float64 network float64 throughout; ``torch.float64`` forces
            float64. A precision that is not positive definite in float32 is factorised in
            float64. The other structures are float64.

    After `fit`: ``loc`` ``(K,) = t*`` (float64), ``precision``, ``covariance``, ``scale_tril``
    (its factor) and ``ggn``, each ``(K, K)``, ``(K,)`` for diag, packed ``(K+1, k+1)`` for
    lowrank (`lowrank.unpack`; ``get_posterior().covariance_matrix`` is the dense ``Σ``), in
    ``dtype`` (above). Every draw (`forward`, `sample_weights`,
    ``Predictive``) and the linearised predictive use this one ``Σ``. Before `fit` these four
    buffers are zeros that take no memory (materialised by `fit` or ``load_state_dict``). With
    at most ``2K/3`` GGN rows (``N·O``; ``N·(C−1)`` for ``C`` classes) the full structure takes
    ``Σ`` from the rows by Woodbury's identity (``K²·rows`` instead of ``K³``) and forms
    ``ggn``, ``precision`` and ``scale_tril`` when first read (`deferred`): the linearised
    predictive needs none of them; a draw, the evidence or a ``state_dict`` forms them.

    Example:
        >>> x, y = torch.randn(30, 2), torch.randn(30)
        >>> net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> model = SubspaceNet(net, subspaces.LastLayerSubspace(net), likelihoods.Gaussian(0.5))
        >>> guide = AutoSubspaceLaplace(model, prior_precision=1.0, prior_mean="zero")
        >>> guide = guide.fit(x, y)
        >>> guide.covariance.shape                                     # K = 8 + 1 weights
        torch.Size([9, 9])
        >>> f = Predictive(model, guide=guide, num_samples=10)(x[:4])["f"]  # (10, 4, 1)
    """

    def __init__(
        self,
        model: SubspaceNet,
        prior_precision: float | torch.Tensor | None = None,
        prior_mean: str | None = None,
        rescale_prior: bool = False,
        hessian_structure: str = "full",
        chunk_size: int = 1024,
        rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not isinstance(model, SubspaceNet):
            raise TypeError(f"model: expected a SubspaceNet, got {type(model).__name__}")
        if dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"dtype: expected None, torch.float32 or torch.float64, got {dtype!r}")
        if prior_mean is not None and prior_mean not in PRIOR_MEANS:
            raise ValueError(f"prior_mean: expected one of {PRIOR_MEANS}, got {prior_mean!r}")
        structure = make_structure(hessian_structure, rank, model.rank)
        ck.positive_int(chunk_size, "chunk_size")
        sub, k = model.subspace, model.rank
        lam = None
        if prior_precision is not None:
            lam = ck.prior_precision(prior_precision, k)
            if rescale_prior:
                lam = lam * k / sub.dim
        elif rescale_prior:
            lam = model.prior_precision * k / sub.dim
        if (prior_mean is not None and prior_mean != model.prior_mean) or lam is not None:
            model.set_prior(prior_mean or model.prior_mean, lam)
        AutoGuide.__init__(self, model)  # the model itself: no init messenger, no params
        self.structure = structure
        self.hessian_structure = hessian_structure
        self.chunk_size = chunk_size
        self.rescale_prior = bool(rescale_prior)
        f64 = {"dtype": torch.float64, "device": sub.shift.device}
        shape = structure.shape(k)
        if hessian_structure != "full":
            dtype = torch.float64
        elif dtype is None:
            net_dtype = sub.shift.dtype
            dtype = net_dtype if net_dtype in (torch.float32, torch.float64) else torch.float32
        for name in POSTERIOR_BUFFERS:  # zeros without memory until fit (`_materialized`)
            zero = torch.zeros((), dtype=dtype, device=sub.shift.device)
            self.register_buffer(name, zero.expand(shape))
        self.register_buffer("loc", torch.zeros(k, **f64))
        self.register_buffer("map_log_likelihood", torch.zeros((), **f64))
        # `FitStatistics` in order (temperature 0 = unfitted); read it through `statistics`
        self.register_buffer("fit_statistics", torch.zeros(len(FitStatistics._fields), **f64))
        #: the model's ``λ`` ``(K,)`` and noise ``σ`` (NaN: none) that ``Σ`` was formed with: a
        #: guide whose model has another prior or noise (a guide's state loaded without its
        #: model's) is refused at use instead of predicting with a Σ its evidence does not match
        self.register_buffer("posterior_prior_precision", torch.zeros(k, **f64))
        self.register_buffer("posterior_sigma", torch.full((), math.nan, **f64))
        self._reset_deferred()
        self._setup_prototype()

    # ------------------------------------------------------------------ Pyro's autoguide API

    def _setup_prototype(self, *args: object, **kwargs: object) -> None:
        """The prototype trace is the model's latent sites (no data needed)."""
        model = self.model
        saved, self._model = self._model, (model.latent_model,)
        try:
            super()._setup_prototype()
        finally:
            self._model = saved

    def get_posterior(self, *args: object, **kwargs: object):
        """``N(t*, Σ)`` over the packed latent ``t``, event shape ``(K,)``, float64."""
        self._check_fitted()
        return self.structure.distribution(self.loc, self.scale_tril.to(self.loc.dtype))

    def sample_latent(self, *args: object, **kwargs: object) -> torch.Tensor:
        self._check_fitted()
        dtype = self.model.subspace.shift.dtype
        dist = self.structure.distribution(self.loc.to(dtype), self.scale_tril.to(dtype))
        return pyro.sample(f"_{self._pyro_name}_latent", dist, infer={"is_auxiliary": True})

    def _loc_scale(self, *args: object, **kwargs: object):
        self._check_fitted()
        dtype = self.model.subspace.shift.dtype
        return self.loc.to(dtype), self.structure.marginal_std(self.scale_tril).to(dtype)

    # ------------------------------------------------------------------ state

    @property
    def laplace_guide(self) -> AutoSubspaceLaplace:
        """Itself (`infer.Laplace`'s object answers with its guide): what the functions that
        take a Laplace guide read."""
        return self

    @property
    def statistics(self) -> FitStatistics:
        """The fit's statistics by name (the ``fit_statistics`` buffer, kept for persistence)."""
        return FitStatistics(*(float(v) for v in self.fit_statistics))

    @property
    def fitted(self) -> bool:
        return self.statistics.temperature > 0

    @property
    def temperature(self) -> float:
        return self.statistics.temperature

    @property
    def num_data(self) -> int:
        return int(self.statistics.num_data)

    @property
    def likelihood(self):
        return self.model.likelihood

    @property
    def prior_precision(self) -> torch.Tensor:
        """The model's ``λ``: a 0-d tensor when shared by all coordinates, else ``(K,)``."""
        lam = self.model.prior_precision
        return lam[0].clone() if bool((lam == lam[0]).all()) else lam

    @property
    def prior_loc(self) -> torch.Tensor:
        return self.model.prior_loc

    def prior_precision_matrix(self, prior_precision: torch.Tensor | None = None) -> torch.Tensor:
        """``Λ₀``: ``λ·PᵀP`` / ``diag(λ)`` (``(K,)`` diagonal for the diag structure)."""
        lam = self.prior_precision if prior_precision is None else prior_precision
        lam = torch.as_tensor(lam, dtype=torch.float64, device=self.loc.device)
        return self.structure.prior_matrix(lam, self.model)

    def _materialized(self, name: str) -> torch.Tensor:
        """The buffer ``name`` as a contiguous tensor to write into: itself once it is one (a
        refit overwrites it in place, as ``copy_`` would), else new memory."""
        buf = self._buffers[name]
        if not buf.is_contiguous():  # the zero-stride zeros of an unfitted guide
            buf = torch.empty(buf.shape, dtype=buf.dtype, device=buf.device)
            self._buffers[name] = buf
        return buf

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        self._reset_deferred()
        if prefix + "loc" in state_dict and prefix + "posterior_prior_precision" not in state_dict:
            # a state saved before the guide recorded the λ and σ its Σ was formed with: NaN
            # marks them unknown, and the guide refuses to predict until set_prior_precision
            # forms Σ for its model's prior (never silently with a mismatched prior)
            k = self._buffers["loc"].shape[0]
            state_dict[prefix + "posterior_prior_precision"] = torch.full((k,), math.nan).double()
            state_dict[prefix + "posterior_sigma"] = torch.tensor(math.nan).double()
        for name in POSTERIOR_BUFFERS:  # copy_ needs memory to write into
            if not self._buffers[name].is_contiguous():
                self._materialized(name).zero_()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _check_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError(f"{type(self).__name__}: call fit(x, y) first")
        lam, sigma = self.model.prior_precision, self._model_sigma()
        formed, formed_sigma = self.posterior_prior_precision, float(self.posterior_sigma)
        same_sigma = math.isnan(sigma) and math.isnan(formed_sigma) or sigma == formed_sigma
        if bool(formed.isnan().any()):
            raise RuntimeError(
                f"{type(self).__name__}: its state was saved before guides recorded the prior "
                "their posterior was formed with: load the model's state_dict, then call "
                "guide.set_prior_precision(guide.model.prior_precision) to form Σ for it"
            )
        if not torch.equal(lam, formed.to(lam)) or not same_sigma:
            raise RuntimeError(
                f"{type(self).__name__}: its posterior was formed with the prior precision "
                f"{_short(formed)} and noise sigma {formed_sigma:.6g}, but its model now has "
                f"{_short(lam)} and {sigma:.6g} (a guide's state loaded without its model's?): "
                "load the model's state_dict too, or call guide.set_prior_precision(...) to "
                "form the posterior for the model's prior"
            )

    def _model_sigma(self) -> float:
        """The likelihood's one noise scale ``σ`` (NaN for a likelihood without one)."""
        if not self.likelihood.noise_scale_tunable:
            return math.nan
        return float(self.likelihood.sigma.detach())

    def _record_posterior_hyperparameters(self) -> None:
        self.posterior_prior_precision.copy_(self.model.prior_precision)
        self.posterior_sigma.fill_(self._model_sigma())

    def _mark_unfitted(self) -> None:
        """What an interrupted fit leaves when its state was too large to copy aside
        (`transaction.BUDGET_BYTES`): an unfitted guide, never a half-fitted one."""
        self.fit_statistics.zero_()
        self._reset_deferred()

    # ------------------------------------------------------------------ fitting

    @_all_or_nothing
    def fit(
        self,
        x: object,
        y: torch.Tensor | None = None,
        find_map: bool = True,
        max_iter: int = 500,
        tol: float = 1e-9,
        newton_steps: int | None = None,
    ):
        """Find ``t*`` and set ``Σ⁻¹ = Pᵀ G(t*) P / T + Λ₀``; returns ``self``.

        The MAP of ``−log p(y | t)/T − log p(t)`` is found by full-batch L-BFGS with a
        strong-Wolfe line search over the model's `Evaluator` (data in chunks), finished by one
        Gauss–Newton step kept if it lowers the loss (exact for a linear-Gaussian model) and,
        while a gradient entry is still above ``tol``, by Newton steps with the exact Hessian
        (`Evaluator.hessian`), each kept only if the loss does not rise beyond rounding and the
        largest gradient entry falls (quadratic convergence on a smooth network, where L-BFGS
        and Gauss–Newton crawl; on a ReLU kink the first step is refused and the search stops).
        ``find_map=False`` keeps ``t* = 0`` (the shift).

        Args:
            x: training inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)``.
            y: targets ``(N,)`` (or ``(N, O)``); ``None`` with a Dataset/DataLoader. With
                ``find_map=False`` they may be omitted: the curvature needs inputs only (the
                evidence then is unavailable).
            find_map: run the MAP search.
            max_iter: at most this many L-BFGS iterations.
            tol: stop when every entry of the gradient is below ``tol`` in absolute value.
            newton_steps: at most this many exact-Newton steps after L-BFGS (each costs about
                ``K`` backward passes over the data); ``None``: 5 for ``K ≤ 512``, else 0.

        Warns:
            ConvergenceWarning: the MAP search ended with a gradient entry above ``tol`` and
                a Newton decrement ``√(∇ᵀΣ∇)`` above ``1e-3`` (`map_search.NEGLIGIBLE_OFFSET`:
                below it ``t*`` is within a thousandth of a posterior standard deviation of the
                MAP, as a float32 search stopped by rounding often is; the message gives both).
                ``t*`` is then not the MAP and the
                posterior is centred and curved at the wrong point. To converge: raise
                ``max_iter`` or ``newton_steps``, and fit in float64 (``net.double()`` with float64 data): float32
                gradients have a rounding floor far above the default ``tol=1e-9``. Even in
                float64 the search can stall where the loss no longer resolves a decrease, or
                at a minimum on a ReLU kink whose gradient does not vanish; a last-layer
                subspace (linear in ``t``: the Gauss–Newton step is exact for a Gaussian
                likelihood) converges, in float32 up to rounding. Filter the warning by its class.
        """
        ck.positive_int(max_iter, "max_iter"), ck.positive_float(tol, "tol")
        ck.nonneg_int(newton_steps, "newton_steps", allow_none=True)
        self.model.check_data(x, y)  # width, dtype, device, NaN, targets: before any work
        data = DataSource(x, y, self.chunk_size)
        has_targets = data.loader is not None or data.y is not None
        if find_map and not has_targets:
            raise ValueError("y: the MAP search needs targets (or find_map=False)")
        ev = Evaluator(self.model, data)
        t = torch.zeros(self.model.rank, dtype=torch.float64, device=self.loc.device)
        if has_targets:
            next(ev.chunks())  # validates the targets before any work
        if find_map:
            prior = FullPrior(self)
            objective = lambda tt: prior.add(*ev.nll_and_grad(tt), tt)
            t, iterations, used_up = _find_map(objective, t, max_iter, tol)
            t, grad = self._polish(objective, t, ev, prior)
            steps = (5 if self.model.rank <= 512 else 0) if newton_steps is None else newton_steps
            t, grad = _newton(objective, t, grad, ev, prior, steps, tol)
            dtype, kinked = self.model.subspace.shift.dtype, has_kinks(self.model.flat.net)
            unconverged = (grad, tol, iterations, max_iter if used_up else None, dtype, kinked)
        self.loc.copy_(t.detach())
        full = self.structure.name == "full"
        rows = RootRows(2 * self.model.rank // 3) if full else None  # Woodbury pays below that
        kw = {"rows": rows} if full else {}
        ggn = self.structure.curvature(ev, t, dtype=self._buffers_dtype, **kw)
        self._reset_deferred(rows if ggn is None else None)  # None: the GGN is left pending
        if ggn is not None:
            self.ggn = ggn.detach()
        loglik, sse, count = ev.map_statistics(t) if has_targets else (math.nan, 0.0, 0)
        self.map_log_likelihood.fill_(loglik)
        stats = FitStatistics(ev.temperature, ev.num_data, sse, count)
        self.fit_statistics.copy_(torch.tensor(stats, dtype=torch.float64))
        self._set_posterior()
        if find_map and float(unconverged[0].abs().max()) > tol:  # Σ∇ only when it can matter
            _warn_unconverged(*unconverged, offset=posterior_offset(self, unconverged[0]))
        return self

    def _polish(self, objective: Callable, t: torch.Tensor, ev, prior):
        """One Gauss–Newton step ``t − (PᵀGP/T + Λ₀)⁻¹ ∇``, kept unless it raises the loss
        (the structure's `newton_step`: the dense ``PᵀGP`` except for the low-rank one);
        returns the point kept and the gradient there."""
        loss, grad = objective(t)
        t_new = t - self.structure.newton_step(ev, t, grad, prior)
        loss_new, grad_new = objective(t_new)
        if loss_new <= loss + 1e-12 * (1 + abs(loss)):  # up to rounding
            return t_new, grad_new
        return t, grad

    @property
    def _buffers_dtype(self) -> torch.dtype:
        return self._buffers["precision"].dtype

    def _set_posterior(self, prior_precision: torch.Tensor | None = None) -> None:
        self._record_posterior_hyperparameters()
        s = self.structure
        out = [self._materialized(name) for name in ("precision", "scale_tril", "covariance")]
        self.__dict__["_pending"] -= {"precision", "scale_tril"}
        if s.name == "full":  # in place, in the buffers' dtype, no (K, K) temporaries
            lam = self.prior_precision if prior_precision is None else prior_precision
            lam = torch.as_tensor(lam, dtype=torch.float64, device=self.loc.device)
            root = self._root()  # fewer GGN rows than K: Woodbury; Σ⁻¹ and L on first use
            if root is not None and s.posterior_from_root_(
                root, self.temperature, lam, self.model, out[2]
            ):
                self._defer("precision", "scale_tril", lam=lam)
                return
            s.posterior_(self.ggn, self.temperature, lam, self.model, *out)
            return
        precision = s.precision(
            self.ggn, self.temperature, self.prior_precision_matrix(prior_precision)
        )
        factor = s.factor(precision)
        out[0].copy_(precision)
        out[1].copy_(factor)
        out[2].copy_(s.covariance(factor))

    # ------------------------------------------------------------------ draws and predictives

    def sample_weights(self, num_samples: int, seed: int | None = None) -> torch.Tensor:
        """Draws of all ``D`` weights, ``(S, D)``: ``ŵ + P t`` with ``t ~ N(t*, Σ)``. Without a
        ``seed`` the draws come from torch's global generator (never re-seeded)."""
        self._check_fitted()
        ck.positive_int(num_samples, "num_samples"), ck.check_int(seed, "seed", 0, allow_none=True)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.loc.device).manual_seed(seed)
        return self.model.subspace.weights(self.draw_latent(num_samples, gen))

    def draw_latent(self, num_samples: int, generator: torch.Generator | None = None):
        """Draws ``t ~ N(t*, Σ)`` ``(S, K)``, float64, from ``generator`` (``None``: torch's
        global generator, never re-seeded)."""
        self._check_fitted()
        ck.positive_int(num_samples, "num_samples")
        eps = torch.randn(
            num_samples, self.model.rank, generator=generator, dtype=torch.float64,
            device=self.loc.device,
        )  # fmt: skip
        return self.loc + self.structure.draw(self.scale_tril, eps)

    def predict(self, x: torch.Tensor, link_approx: str = "auto", **kwargs: object):
        """The linearised predictive as a ``torch.distributions`` object (`linearized_predictive`)."""
        return linearized_predictive(self, x, link_approx, **kwargs)

    # ------------------------------------------------------------------ hyperparameters

    def log_marginal_likelihood(
        self,
        prior_precision: float | torch.Tensor | None = None,
        sigma: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The Laplace evidence ``ℓ/T − ½ (t*−m₀)ᵀ Λ₀ (t*−m₀) + ½ log|Λ₀| − ½ log|PᵀGP/T + Λ₀|``
        with ``t*`` and the curvature held at the fitted values. Differentiable in
        ``prior_precision`` and, for a likelihood with one tunable noise scale, in ``sigma``
        (``G ∝ 1/σ²``, ``ℓ = −(N·O/2) log 2πσ² − RSS/2σ²``). Returns a 0-d float64 tensor."""
        self._check_fitted()
        if math.isnan(float(self.map_log_likelihood)):
            raise RuntimeError("log_marginal_likelihood: fit(x, y) with targets first")
        lam = self.prior_precision if prior_precision is None else prior_precision
        lam = torch.as_tensor(lam, dtype=torch.float64, device=self.loc.device)
        loglik, c = self.map_log_likelihood, 1.0
        if sigma is not None:
            sigma0 = self._scalar_sigma()
            sigma = torch.as_tensor(sigma, dtype=torch.float64, device=self.loc.device)
            c, loglik = (sigma0 / sigma) ** 2, self._gaussian_loglik(sigma)
        s = self.structure
        d = self.loc - self.prior_loc
        if s.name == "full" and lam.dim() == 0 and self.model.prior_gram.numel() == 0:
            # Λ₀ = λI: log|cG/T + λI| = Σ_i log(c g_i/T + λ) from one eigendecomposition of the
            # fitted G, so each evidence evaluation (and its gradient) costs O(K), not O(K³)
            g = self._ggn_eigenvalues()
            k = g.numel()
            return (
                loglik / self.temperature
                - lam * d.square().sum() / 2
                + (k * lam.log() - torch.log(c * g / self.temperature + lam).sum()) / 2
            )
        ggn = self.ggn.double() if sigma is None else s.scale_curvature(self.ggn.double(), c)
        prior = s.prior_matrix(lam, self.model)
        post = s.precision(ggn, self.temperature, prior)
        return (
            loglik / self.temperature
            - s.quad(prior, d) / 2
            + (s.logdet(prior, "prior precision") - s.logdet(post, "posterior precision")) / 2
        )

    def _ggn_eigenvalues(self) -> torch.Tensor:
        """Eigenvalues ``(K,)`` of the fitted ``PᵀGP`` (clamped at 0: it is PSD up to rounding),
        cached until the curvature buffer changes; from the ``(r, r)`` ``A Aᵀ`` of the kept GGN
        rows when there are any (`deferred`: ``r³`` instead of ``K³``, no ``(K, K)`` GGN)."""
        root = self._root()
        if root is not None:  # AᵀA and the (r, r) A Aᵀ share their non-zero eigenvalues
            key = ("rows", id(self.__dict__["_rows"]))
        else:
            key = (self.ggn.data_ptr(), self.ggn._version)
        cached = self.__dict__.get("_eig_cache")
        if cached is None or cached[0] != key:
            if root is not None:
                g = torch.linalg.eigvalsh(row_gram(root.double()))
                g = torch.cat([g, g.new_zeros(root.shape[1] - root.shape[0])])
            else:
                g = torch.linalg.eigvalsh(symmetrize_(self.ggn.to(torch.float64, copy=True)))
            self.__dict__["_eig_cache"] = cached = (key, g.clamp_min(0))
        return cached[1]

    def _scalar_sigma(self) -> float:
        if not self.likelihood.noise_scale_tunable:
            raise ValueError("sigma: only a homoscedastic Gaussian with one noise scale has one")
        return float(self.likelihood.sigma.detach())

    def _gaussian_loglik(self, sigma: torch.Tensor) -> torch.Tensor:
        """``log p(D | t*)`` at the noise ``σ`` (`Likelihood.log_likelihood_at_noise`)."""
        stats = self.statistics
        return self.likelihood.log_likelihood_at_noise(
            sigma, stats.residual_sum_of_squares, stats.num_observations
        )

    @_all_or_nothing
    def set_sigma(self, sigma: float | torch.Tensor) -> None:
        """Set the likelihood's noise ``σ`` and update the curvature (``G ∝ 1/σ²``), the MAP
        log-likelihood (from the fit's residual sum of squares) and ``Σ``; a homoscedastic
        Gaussian only."""
        self._check_fitted()
        old = self._scalar_sigma()
        sigma = ck.positive_float(sigma, "sigma")
        with torch.no_grad():
            scale = (old / sigma) ** 2
            self.ggn.copy_(self.structure.scale_curvature(self.ggn, scale))
            self.map_log_likelihood.copy_(self._gaussian_loglik(torch.tensor(sigma).double()))
        lik = self.likelihood  # a learned PyroParam or a buffer: set in place
        lik.sigma = torch.full_like(lik.sigma.detach(), sigma)
        self._set_posterior()

    @_all_or_nothing
    def set_prior_precision(self, prior_precision: float | torch.Tensor) -> None:
        """Set ``λ`` in the model's prior (shared with MCMC/SVI on it) and update ``Σ``."""
        self.model.set_prior_precision(prior_precision)
        if self.fitted:
            self._set_posterior()

    @_all_or_nothing
    def optimize_prior_precision(self, method: str = "marglik", **kwargs: object):
        """Choose ``λ`` (and optionally ``σ``) by ``"marglik"`` (type-II maximum likelihood) or
        ``"grid"`` (validation log-likelihood); see `tuning.optimize_prior_precision`."""
        optimize_prior_precision(self, method, **kwargs)
        return self


def _short(t: torch.Tensor) -> str:
    """``λ`` for a message: one number when every coordinate has it."""
    t = t.detach().double().reshape(-1)
    if t.numel() and bool((t == t[0]).all()):
        return f"{float(t[0]):.6g}"
    return f"{t[:3].tolist()}..." if t.numel() > 3 else str(t.tolist())


class FullPrior:
    """``½ (t − m₀)ᵀ Λ₀ (t − m₀)`` added to a loss and gradient (the exact prior whatever the
    posterior structure; a diagonal ``Λ₀`` is kept as its diagonal ``(K,)``)."""

    def __init__(self, guide: AutoSubspaceLaplace) -> None:
        lam = guide.prior_precision.to(guide.loc)
        model, k = guide.model, guide.model.rank
        self.diagonal = None
        if lam.dim() == 1:
            self.diagonal = lam
        elif model.prior_gram.numel() == 0:  # PᵀP = I, never formed
            self.diagonal = lam.expand(k)
        else:
            self._matrix = lam * model.prior_gram_matrix()
        self.loc = guide.prior_loc

    @property
    def matrix(self) -> torch.Tensor:
        """``Λ₀`` ``(K, K)``."""
        return torch.diag(self.diagonal) if self.diagonal is not None else self._matrix

    def apply(self, d: torch.Tensor) -> torch.Tensor:
        """``Λ₀ d``."""
        return self.diagonal * d if self.diagonal is not None else self._matrix @ d

    def add(self, loss: float, grad: torch.Tensor, t: torch.Tensor) -> tuple[float, torch.Tensor]:
        d = t.detach() - self.loc
        lam_d = self.apply(d)
        total = loss + float(d @ lam_d) / 2
        if not math.isfinite(total):
            raise FloatingPointError("fit: the negative log joint is not finite at the MAP search")
        return total, grad + lam_d
