"""`Posterior`: the contract of a Gaussian posterior over the ``K`` coordinates of a subspace.

A Laplace guide (`AutoSubspaceLaplace`) finds ``t*`` and holds one `Posterior` for
``q(t) = N(t*, Σ)`` with

    Σ⁻¹ = C̃ / T + Λ₀                       (Subnetwork Inference eq. 15)

where ``C̃`` is the implementation's representation of the subspace GGN ``C = PᵀGP`` (all of it,
its diagonal, its top-``k`` eigenpairs, Kronecker factors), ``T`` the likelihood's temperature
and ``Λ₀`` the prior precision (`PriorPrecision`). In the spirit of Pyro's ``AutoContinuous``
hooks and laplace-torch's ``ParametricLaplace``, an implementation owns its buffers (a
``state_dict`` round trip restores it) and answers every question the guide, the predictives,
the evidence, the tuner and the samplers ask, so none of them knows which one it holds:

- building: `fit_curvature` (from an `Evaluator` at ``t``), `scale_curvature_` (a new noise
  scale: ``G ∝ 1/σ²``), `set_prior` (forms ``Σ`` for ``Λ₀``);
- the evidence: `effective_prior` (the ``Λ₀`` it represents: a diagonal for the diagonal,
  low-rank and Kronecker structures), `log_det` (``log|s·C̃/T + Λ₀|``, differentiable in ``λ``
  and ``s``);
- draws: `draw` (``F ε`` with ``F Fᵀ = Σ``), `sample`, `distribution`;
- moments: `covariance`, `precision`, `curvature`, `cholesky` (dense ``(K, K)``, where that is
  affordable), `marginal_variance` ``(K,)``, `functional_covariance` ``J Σ Jᵀ``,
  `functional_variance`, `feature_covariance` (a last layer from its features);
- the tuner's sweep over ``λ``: `functional_covariance_on_grid`;
- the MAP search's last step: `newton_step`.

`tests/contracts/posterior.py` checks every implementation against dense linear algebra.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from ....flat import FlatNet, writable_buffers_
from ....linalg import cholesky, logdet
from ....subspaces.last_layer import uses_features


class PriorPrecision(NamedTuple):
    """``Λ₀`` ``(K, K)`` of the coordinates: ``diag(λ)`` for ``λ`` ``(K,)``; ``λ B`` for a
    0-d ``λ``, with ``B = PᵀP`` ``(K, K)`` (``prior_mean="zero"`` on a dense basis) or ``I``
    (``gram=None``, never formed). ``λ`` may require grad (the evidence is maximised in it)."""

    lam: torch.Tensor  #: 0-d or ``(K,)`` float64
    gram: torch.Tensor | None  #: ``PᵀP`` ``(K, K)`` or ``None`` for ``I``
    dim: int  #: ``K``

    @property
    def is_diagonal(self) -> bool:
        return self.lam.dim() == 1 or self.gram is None

    def diagonal(self) -> torch.Tensor:
        """``diag(Λ₀)`` ``(K,)``."""
        if self.lam.dim() == 1:
            return self.lam
        if self.gram is None:
            return self.lam.expand(self.dim)
        return self.lam * self.gram.diagonal()

    def matrix(self) -> torch.Tensor:
        """``Λ₀`` ``(K, K)``."""
        if self.is_diagonal:
            return torch.diag(self.diagonal())
        return self.lam * self.gram

    def diagonalised(self) -> PriorPrecision:
        """``diag(Λ₀)`` as a diagonal prior (exact when ``PᵀP`` is diagonal)."""
        return self if self.is_diagonal else PriorPrecision(self.diagonal(), None, self.dim)

    def apply(self, d: torch.Tensor) -> torch.Tensor:
        """``Λ₀ d`` for ``d`` ``(..., K)``."""
        return d * self.diagonal() if self.is_diagonal else d @ self.matrix()

    def quad(self, d: torch.Tensor) -> torch.Tensor:
        """``dᵀ Λ₀ d`` (0-d)."""
        return (d * self.apply(d)).sum()

    def log_det(self) -> torch.Tensor:
        """``log|Λ₀|`` (0-d, differentiable in ``λ``)."""
        if self.is_diagonal:
            diag = self.diagonal()
            if not bool((diag > 0).all()):
                raise torch.linalg.LinAlgError("prior precision: not positive definite")
            return diag.log().sum()
        return logdet(self.matrix(), "prior precision")

    def with_lam(self, lam: torch.Tensor) -> PriorPrecision:
        """The same ``B`` with another ``λ``."""
        return PriorPrecision(lam, self.gram if lam.dim() == 0 else None, self.dim)


class Posterior(nn.Module, ABC):
    """A Gaussian ``N(·, Σ)`` over ``K`` coordinates with ``Σ⁻¹ = C̃/T + Λ₀`` (module docstring).

    Args:
        dim: ``K``.
        dtype: of the buffers that hold ``C̃`` and ``Σ`` (float64 unless the implementation
            says otherwise).
        device: of the buffers.

    Subclasses set `name` (laplace-torch's ``hessian_structure`` string) and implement the
    abstract methods; everything else has a default built on them. Before `fit_curvature`
    the buffers hold zeros (possibly without memory); ``temperature`` is 0.
    """

    #: laplace-torch's ``hessian_structure`` name of this structure
    name: ClassVar[str]

    def __init__(self, dim: int, dtype: torch.dtype = torch.float64, device=None) -> None:
        super().__init__()
        self.dim = int(dim)
        self.register_buffer("temperature", torch.zeros((), dtype=torch.float64, device=device))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # the buffers this state writes (e.g. a scalar λ's `per_coordinate`); a buffer it does
        # not write keeps its memory, or its lack of memory
        writable_buffers_(self, [name for name in self._buffers if prefix + name in state_dict])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def buffer_dtype(self) -> torch.dtype:
        """The dtype of ``Σ`` (draws and functional covariances are computed in it)."""
        return torch.float64

    # ------------------------------------------------------------------ building

    @abstractmethod
    def fit_curvature(self, evaluator, t: torch.Tensor, **kwargs: object):
        """Compute and keep ``C̃`` at ``w = ŵ + P t`` from ``evaluator`` (its data, model and
        temperature); ``Σ`` is formed by a following `set_prior`. Returns ``None``, or the
        evidence's statistics at ``t`` (`Evaluator.map_statistics`' ``(log p(D | t), sse,
        count)``) where its pass over the data computed them: the fit then skips its own."""

    @abstractmethod
    def scale_curvature_(self, c: float) -> None:
        """``C̃ ← c C̃`` (a re-tuned noise scale of a Gaussian likelihood: ``G ∝ 1/σ²``)."""

    @abstractmethod
    def set_prior(self, prior: PriorPrecision) -> None:
        """Form ``Σ`` for ``Σ⁻¹ = C̃/T + Λ₀`` (in the buffers)."""

    def clear_pending(self) -> None:
        """Forget work left to first use (an unfitted guide keeps none); nothing by default."""

    def effective_prior(self, prior: PriorPrecision) -> PriorPrecision:
        """The ``Λ₀`` this structure represents: its diagonal by default (exact for index
        subspaces and orthonormal bases); the full structure keeps ``λ PᵀP``."""
        return prior.diagonalised()

    def at_prior(self, prior: PriorPrecision) -> Posterior:
        """A posterior with this curvature and ``Σ`` formed for ``prior``; ``self`` unchanged."""
        other = copy.deepcopy(self)
        other.set_prior(prior)
        return other

    # ------------------------------------------------------------------ the evidence

    @abstractmethod
    def log_det(self, prior: PriorPrecision, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """``log|s·C̃/T + Λ₀|`` (0-d float64) with ``Λ₀`` = `effective_prior`, differentiable
        in ``prior.lam`` and ``scale``; it must not refactorise ``C̃`` per call where the
        structure allows (the evidence is evaluated once per optimiser step)."""

    def log_evidence(
        self,
        loglik: torch.Tensor | float,
        prior: PriorPrecision,
        offset: torch.Tensor,
        scale: float | torch.Tensor = 1.0,
        sigma: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        """The Laplace evidence (MacKay 1992; Immer et al. 2021 eq. 5)
        ``ℓ/T − ½ dᵀΛ₀d + ½ log|Λ₀| − ½ log|s·C̃/T + Λ₀|`` (0-d float64), with ``loglik = ℓ/T``
        the tempered log-likelihood at ``t*``, ``offset = d = t* − m₀`` ``(K,)``, ``Λ₀`` =
        `effective_prior` of the model's ``prior`` and ``s`` the curvature's scale at the noise
        ``sigma`` (a Gaussian likelihood's ``σ``, 0-d, or ``None``); differentiable in
        ``prior.lam``, ``scale`` and ``sigma``. A function-space posterior
        (`FunctionalPosterior`) computes its own."""
        eff = self.effective_prior(prior)
        return loglik - eff.quad(offset) / 2 + (eff.log_det() - self.log_det(eff, scale)) / 2

    # ------------------------------------------------------------------ draws

    @abstractmethod
    def draw(self, eps: torch.Tensor) -> torch.Tensor:
        """``F ε`` ``(..., K)`` with ``F Fᵀ = Σ``, for standard normal ``ε`` ``(..., K)``."""

    def sample(
        self, num_samples: int, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Zero-mean draws ``(S, K)`` float64 from ``N(0, Σ)``; ``generator`` ``None``: torch's
        global generator."""
        eps = torch.randn(
            num_samples, self.dim, generator=generator, dtype=torch.float64,
            device=self.temperature.device,
        )  # fmt: skip
        return self.draw(eps).double()

    def distribution(self, loc: torch.Tensor):
        """``N(loc, Σ)`` as a Pyro distribution, event shape ``(K,)``."""
        from pyro.distributions import MultivariateNormal

        return MultivariateNormal(loc, scale_tril=self.cholesky().to(loc))

    # ------------------------------------------------------------------ moments

    @abstractmethod
    def covariance(self) -> torch.Tensor:
        """``Σ`` ``(K, K)`` (dense)."""

    @abstractmethod
    def precision(self) -> torch.Tensor:
        """``Σ⁻¹`` ``(K, K)`` (dense)."""

    @abstractmethod
    def curvature(self) -> torch.Tensor:
        """``C̃`` ``(K, K)`` (dense, untempered)."""

    def cholesky(self) -> torch.Tensor:
        """The lower-triangular ``L`` ``(K, K)`` with ``L Lᵀ = Σ``."""
        return cholesky(self.covariance().double(), "posterior covariance")

    def posterior_precision(self):
        """``Σ⁻¹`` in this structure's own form, as laplace-torch's ``posterior_precision`` of
        the same structure returns it (dense by default)."""
        return self.precision()

    def apply_covariance(self, v: torch.Tensor) -> torch.Tensor:
        """``Σ v`` for ``v`` ``(..., K)`` (by default with the dense `covariance`)."""
        return v.double() @ self.covariance().double()

    def apply_precision(self, v: torch.Tensor) -> torch.Tensor:
        """``Σ⁻¹ v`` for ``v`` ``(..., K)`` (by default with the dense `precision`)."""
        return v.double() @ self.precision().double()

    @abstractmethod
    def marginal_variance(self) -> torch.Tensor:
        """``diag(Σ)`` ``(K,)``."""

    def functional_covariance(self, jp: torch.Tensor) -> torch.Tensor:
        """``J Σ Jᵀ`` ``(n, O, O)`` for ``J`` ``(n, O, K)``, in ``J``'s dtype; by default through
        the dense `covariance`."""
        n, o, k = jp.shape
        cov = self.covariance().to(jp.dtype)
        return torch.bmm((jp.reshape(n * o, k) @ cov).view(n, o, k), jp.mT)

    def functional_variance(self, jp: torch.Tensor) -> torch.Tensor:
        """``diag(J Σ Jᵀ)`` ``(n, O)``."""
        return self.functional_covariance(jp).diagonal(dim1=-2, dim2=-1)

    def feature_covariance(
        self, phi: torch.Tensor, rows: torch.Tensor, diagonal: bool = False
    ) -> torch.Tensor:
        """A last layer: ``J[n, c, rows[c, p]] = φ̃[n, p]`` for features ``φ̃`` ``(n, P̃)`` and
        ``rows`` ``(C, P̃)``; returns ``J Σ Jᵀ`` ``(n, C, C)`` (MoLA A.2), or with ``diagonal``
        only its variances ``(n, C)``."""
        n, c = phi.shape[0], rows.shape[0]
        jp = phi.new_zeros(n, c, self.dim)
        for i in range(c):
            jp[:, i, rows[i]] = phi
        return self.functional_variance(jp) if diagonal else self.functional_covariance(jp)

    def linearized_outputs(
        self, model, x: torch.Tensor, w: torch.Tensor, chunk_size: int, diagonal: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The linearised outputs at the weights ``w`` ``(D,)``: ``f(x, w)`` ``(N, O)`` and
        ``J Σ Jᵀ`` ``(N, O, O)`` (with ``diagonal`` only its variances ``(N, O)``), float64
        (Subnetwork Inference eqs. 11–12). By default over the subspace's blocks: a last
        layer's features (`feature_covariance`), else its Jacobian blocks
        (`functional_covariance`, `functional_variance`), in the posterior's dtype."""
        sub, dtype = model.subspace, self.buffer_dtype
        flat = FlatNet(model.flat.net, batch_strategy="loop")
        means, covs = [], []
        if uses_features(sub, flat, x, w):  # a last layer: J from the penultimate features
            for out, phi in sub.feature_blocks(flat, x, w, chunk_size):
                means.append(out.double())
                covs.append(self.feature_covariance(phi.to(dtype), sub.rows, diagonal).double())
        else:
            moments = self.functional_variance if diagonal else self.functional_covariance
            for out, jp in sub.jacobian_blocks(flat, x, w, chunk_size):
                means.append(out.double())
                covs.append(moments(jp.to(dtype)).double())
        return torch.cat(means), torch.cat(covs)

    # ------------------------------------------------------------------ the tuner's sweep

    def functional_covariance_on_grid(
        self,
        blocks: Iterable[torch.Tensor],
        prior_at: Callable[[torch.Tensor], PriorPrecision],
        rows: torch.Tensor | None = None,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``λ ↦ J Σ(λ) Jᵀ`` ``(N, O, O)`` float64 over Jacobian blocks ``(n, O, K)`` (or
        features ``(n, P̃)`` of a last layer with ``rows``), for a sweep over ``λ``
        (`tuning.grid_covariances`): by default `at_prior` per ``λ``."""
        blocks = [b.double() for b in blocks]

        def f_cov(lam: torch.Tensor) -> torch.Tensor:
            post = self.at_prior(prior_at(torch.as_tensor(lam, dtype=torch.float64)))
            if rows is not None:
                return torch.cat([post.feature_covariance(b, rows, True).double() for b in blocks])
            return torch.cat([post.functional_covariance(b).double() for b in blocks])

        return f_cov

    # ------------------------------------------------------------------ the MAP search

    def newton_step(self, evaluator, t: torch.Tensor, grad: torch.Tensor, prior: PriorPrecision):
        """``(PᵀGP/T + Λ₀)⁻¹ ∇`` ``(K,)`` for the MAP search's last Gauss–Newton step, with
        the dense ``PᵀGP`` at ``t`` and the exact prior (the MAP does not depend on the
        posterior's structure)."""
        hessian = evaluator.ggn(t) / evaluator.temperature + prior.matrix()
        return torch.cholesky_solve(grad[:, None], cholesky(hessian, "precision"))[:, 0]

    def newton_decrement(self, grad: torch.Tensor) -> float:
        """``√(∇ᵀ Σ ∇)``: how many posterior standard deviations a Gauss–Newton step would
        still move the mean."""
        g = grad.double()
        value = self.functional_covariance(g[None, None].to(self.buffer_dtype))[0, 0, 0]
        return float(value.double().clamp_min(0).sqrt())

    # ------------------------------------------------------------------ persistence

    def legacy_state(self, old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This posterior's buffers from a guide state saved before guides held a posterior
        (buffers ``ggn``, ``precision``, ``covariance``, ``scale_tril`` on the guide)."""
        raise NotImplementedError(
            f"{type(self).__name__}: no state from before posteriors to convert"
        )


def stacked_jacobians(
    blocks: Iterable[torch.Tensor], dim: int, rows=None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The grid sweeps' Jacobians ``(N, O, K)`` in ``dtype`` from `functional_covariance_on_grid`'s
    ``blocks``: Jacobian blocks ``(n, O, K)``, or with ``rows`` ``(O, P̃)`` a last layer's
    features ``(n, P̃)``, scattered as ``J[n, c, rows[c, p]] = φ̃[n, p]``. Each block is
    converted as it is taken: no copy of them all in another dtype beside the result."""
    out = []
    for b in blocks:
        b = b.to(dtype)
        if rows is not None:
            j = b.new_zeros(b.shape[0], rows.shape[0], dim)
            for i in range(rows.shape[0]):
                j[:, i, rows[i]] = b
            b = j
        out.append(b)
    return torch.cat(out)


def check_positive(values: torch.Tensor, what: str) -> None:
    """``LinAlgError`` naming ``what`` unless every entry is positive."""
    if not bool((values > 0).all()):
        raise torch.linalg.LinAlgError(f"{what}: not positive, smallest {float(values.min()):g}")

