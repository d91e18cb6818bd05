"""`DiagonalPosterior`: ``Σ = diag(1/(c/T + λ))`` with ``c = diag(PᵀGP)``, the mean-field
baseline of Subnetwork Inference sections 6.1–6.2 when the subspace is all weights
(laplace-torch's ``DiagLaplace``). The prior enters through its diagonal (exact for subnetworks
and orthonormal bases)."""

from __future__ import annotations

import torch

from .base import Posterior, PriorPrecision, check_positive


class DiagonalPosterior(Posterior):
    """Diagonal ``Σ⁻¹ = diag(c)/T + diag(Λ₀)``; buffers ``ggn_diagonal`` ``c``,
    ``precision_diagonal`` and ``variance`` ``(K,)`` float64.

    Args:
        dim: ``K``.
        device: of the buffers.
    """

    name = "diag"

    def __init__(self, dim: int, dtype: torch.dtype = torch.float64, device=None) -> None:
        super().__init__(dim, torch.float64, device)
        for name in ("ggn_diagonal", "precision_diagonal", "variance"):
            self.register_buffer(name, torch.zeros(dim, dtype=torch.float64, device=device))

    def legacy_state(self, old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = {"ggn": "ggn_diagonal", "precision": "precision_diagonal", "covariance": "variance"}
        return {new: old[key] for key, new in names.items() if key in old}

    # ------------------------------------------------------------------ building

    def fit_curvature(self, evaluator, t: torch.Tensor, **kwargs: object) -> None:
        """``diag(PᵀGP)`` at ``t`` (`Evaluator.ggn` with ``diagonal=True``)."""
        self.temperature.fill_(evaluator.temperature)
        self.ggn_diagonal.copy_(evaluator.ggn(t, diagonal=True, dtype=torch.float64).detach())

    def scale_curvature_(self, c: float) -> None:
        self.ggn_diagonal.mul_(c)

    def set_prior(self, prior: PriorPrecision) -> None:
        precision = self.ggn_diagonal / float(self.temperature) + prior.diagonal().detach()
        check_positive(precision, "posterior precision")
        self.precision_diagonal.copy_(precision)
        self.variance.copy_(precision.reciprocal())

    def log_det(self, prior: PriorPrecision, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        post = scale * self.ggn_diagonal / float(self.temperature) + prior.diagonal()
        check_positive(post.detach(), "posterior precision")
        return post.log().sum()

    # ------------------------------------------------------------------ draws and moments

    def draw(self, eps: torch.Tensor) -> torch.Tensor:
        return eps * self.variance.sqrt()

    def distribution(self, loc: torch.Tensor):
        from pyro.distributions import Normal

        return Normal(loc, self.variance.sqrt().to(loc)).to_event(1)

    def covariance(self) -> torch.Tensor:
        return torch.diag(self.variance)

    def precision(self) -> torch.Tensor:
        return torch.diag(self.precision_diagonal)

    def curvature(self) -> torch.Tensor:
        return torch.diag(self.ggn_diagonal)

    def cholesky(self) -> torch.Tensor:
        return torch.diag(self.variance.sqrt())

    def posterior_precision(self) -> torch.Tensor:
        """``(K,)``, as laplace-torch's ``DiagLaplace.posterior_precision``."""
        return self.precision_diagonal

    def marginal_variance(self) -> torch.Tensor:
        return self.variance

    def functional_covariance(self, jp: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nok,k,npk->nop", jp, self.variance.to(jp.dtype), jp)

    def functional_variance(self, jp: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nok,k->no", jp.square(), self.variance.to(jp.dtype))

    def feature_covariance(
        self, phi: torch.Tensor, rows: torch.Tensor, diagonal: bool = False
    ) -> torch.Tensor:
        var = self.variance.to(phi.dtype)[rows]  # (C, P̃)
        out = torch.einsum("np,cp->nc", phi.square(), var)
        return out if diagonal else torch.diag_embed(out)

    def newton_decrement(self, grad: torch.Tensor) -> float:
        return float((self.variance * grad.double().square()).sum().clamp_min(0).sqrt())
