"""Multi-class classification with a softmax link."""

from __future__ import annotations

import math

import torch
from pyro.distributions import Categorical as _Categorical
from pyro.distributions import Distribution

from ..validation import check_labels
from ..linalg import gaussian_draws
from .base import Likelihood, output_variances


class Categorical(Likelihood):
    """Classification: ``y_n ~ Categorical(softmax(f_n))``; outputs are ``C >= 2`` logits."""

    def check_outputs(self, outputs: torch.Tensor) -> None:
        super().check_outputs(outputs)
        if outputs.shape[-1] < 2:
            raise ValueError(
                f"outputs: Categorical needs >= 2 logits per point, got {outputs.shape[-1]}"
            )

    def prepare_target(self, y: torch.Tensor, n: int) -> torch.Tensor:
        """Labels as int64 ``(n,)``: integers ``>= 0`` (whole-number floats pass), checked by
        `validation.check_labels`, the one check of class labels."""
        return check_labels(super().prepare_target(y, n), "y")

    def distribution(self, outputs: torch.Tensor) -> Distribution:
        return _Categorical(logits=outputs)

    def log_prob_prepared(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``log softmax(f)_y`` as ``Categorical(logits=f).log_prob(y)`` computes it (the
        same numbers), without building and checking a distribution at every step."""
        logp = outputs - outputs.logsumexp(dim=-1, keepdim=True)
        index = y.long().expand(logp.shape[:-1]).unsqueeze(-1)
        return logp.gather(-1, index).squeeze(-1)

    def training_loss(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``cross_entropy``: the fused log-softmax and gather of a plain PyTorch loop (equal
        to ``−mean log_prob`` up to rounding)."""
        if outputs.dim() == 2:
            return torch.nn.functional.cross_entropy(outputs, y.long())
        return super().training_loss(outputs, y)

    def validate(self, outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.check_outputs(outputs)
        y = Likelihood.prepare_target(self, y, outputs.shape[-2])  # shape, NaN
        return check_labels(y, "y", outputs.shape[-1], why=" for this network")

    def mean(self, outputs: torch.Tensor) -> torch.Tensor:
        """Class probabilities, shape ``(..., N, C)``."""
        return outputs.softmax(-1)

    # ------------------------------------------------------------------ the contract

    def _hessian(self, out: torch.Tensor) -> torch.Tensor:
        """``diag(p) − p pᵀ`` with ``p = softmax(f)``."""
        p = out.softmax(-1)
        return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]

    def output_hessian_sum(self, outputs: torch.Tensor) -> torch.Tensor:
        """``Σ_n (diag(p_n) − p_n p_nᵀ) = diag(Σ_n p_n) − PᵀP`` ``(C, C)``, ``P`` ``(N, C)``."""
        p = self.check_curvature_outputs(outputs).double().softmax(-1)
        return torch.diag(p.sum(0)) - p.T @ p

    def _hessian_factor(self, out: torch.Tensor) -> torch.Tensor:
        """``L`` ``(n, C, C−1)`` with ``L Lᵀ = diag(p) − p pᵀ``: the Hessian has rank ``C − 1``
        (``H 1 = 0``), so ``C − 1`` Jacobian rows per point carry the whole GGN (a tenth fewer
        multiplications for 10 classes than a square factor). With ``r`` the most probable
        class (``p_r ≥ 1/C``: well conditioned) and ``S`` the others,
        ``H = E H_S Eᵀ`` (``E`` stacks ``I`` over the row ``−1ᵀ`` at ``r``, since rows of ``H``
        sum to zero) and ``H_S = diag(p_S) − p_S p_Sᵀ = R Rᵀ`` with the symmetric root
        ``R = diag(√p_S)(I − β √p_S √p_Sᵀ)``, ``β = 1/(1 + √p_r)``; so ``L = E R``: rows
        ``L_ij = √p_i δ_ij − β p_i √p_j`` (``i ≠ r``) and ``L_rj = −√p_r √p_j``, ``j ∈ S``."""
        p = out.softmax(-1)
        n, c = p.shape
        sqrt_p = p.sqrt()
        r = p.argmax(-1)  # shape: (n,)
        sqrt_pr = sqrt_p.gather(1, r[:, None])  # shape: (n, 1)
        beta = (1 + sqrt_pr).reciprocal()
        m = torch.diag_embed(sqrt_p) - (beta * p)[:, :, None] * sqrt_p[:, None, :]
        rows = torch.arange(n, device=p.device)
        m[rows, r] = -sqrt_pr * sqrt_p
        cols = torch.arange(c - 1, device=p.device)
        keep = cols + (cols[None, :] >= r[:, None])  # shape: (n, C−1): every class but r
        return m.gather(2, keep[:, None, :].expand(n, c, c - 1))

    link_approxes = ("probit", "mc", "bridge", "bridge_norm")

    def _predictive(self, f_mean, f_cov, link_approx, num_samples, generator, include_noise):
        """``"probit"``: ``softmax(m_c / √(1 + π/8 · C_cc))`` (MoLA eq. 6); ``"mc"``: the mean of
        ``softmax(f)`` over ``num_samples`` draws ``f ~ N(m, C)``; ``"bridge"`` and
        ``"bridge_norm"``: the mean of the Laplace bridge's Dirichlet (`laplace_bridge`)."""
        if link_approx == "mc":
            probs = gaussian_draws(f_mean, f_cov, num_samples, generator).softmax(-1).mean(0)
        elif link_approx in ("bridge", "bridge_norm"):
            probs = laplace_bridge(f_mean, f_cov, normalize=link_approx == "bridge_norm")
        else:
            kappa = (1 + math.pi / 8 * output_variances(f_cov)).rsqrt()
            probs = (f_mean * kappa).softmax(-1)
        return _Categorical(probs=probs)

    def _predictive_from_samples(self, out: torch.Tensor) -> Distribution:
        return _Categorical(logits=out.double())

    def _probs_distribution(self, probs: torch.Tensor) -> Distribution:
        return _Categorical(probs=probs)

    def mixture_log_prob(self, weights, comp, y, y_name="y"):
        probs = torch.einsum("m,m...->...", weights.to(comp), comp)
        # the range again, for members whose width their structure did not tell
        y = check_labels(y, y_name, probs.shape[-1], probs.shape[0])
        return probs.gather(1, y.to(probs.device)[:, None]).squeeze(1).clamp_min(1e-12).log()

    def predictive_log_prob(self, predictive: Distribution, y: torch.Tensor) -> torch.Tensor:
        probs = predictive.probs.clamp_min(1e-12)
        y = Likelihood.prepare_target(self, y, probs.shape[-2])
        y = check_labels(y, "y", probs.shape[-1]).to(probs.device)
        return probs.gather(-1, y[:, None]).squeeze(-1).log()


def laplace_bridge(f_mean: torch.Tensor, f_cov: torch.Tensor, normalize: bool = False):
    """The mean ``α / Σ_k α_k`` ``(N, C)`` of the Laplace bridge's Dirichlet for logits
    ``f ~ N(m, C)`` (Hobbhahn, Kristiadi & Hennig 2022, eq. 9):

        α_k = (1 − 2/C + e^{m_k} Σ_l e^{−m_l} / C²) / C_kk,

    after conditioning the Gaussian on ``Σ_k f_k = 0`` (softmax is invariant to a shift of the
    logits; the bridge assumes zero-sum logits): ``m ← m − C1 (1ᵀm)/(1ᵀC1)``,
    ``C ← C − C11ᵀC/(1ᵀC1)``. ``normalize`` (laplace-torch's ``"bridge_norm"``) then rescales
    the logits, ``m ← m/√s`` and ``C_kk ← C_kk/s`` with ``s = mean_k C_kk / √(C/2)``, so that
    their mean variance is ``√(C/2)``. A probability that is not a number (zero variances)
    is reported as 1, as laplace-torch does.

    Args:
        f_mean: ``(N, C)`` logit means.
        f_cov: ``(N, C, C)`` logit covariances.
        normalize: the variance normalisation of ``"bridge_norm"``.
    """
    m, cov = f_mean.double(), f_cov.double()
    c = m.shape[-1]
    row = cov.sum(-1)  # C1, shape: (N, C)
    total = row.sum(-1, keepdim=True)  # 1ᵀC1, shape: (N, 1)
    m = m - row * m.sum(-1, keepdim=True) / total
    var = cov.diagonal(dim1=-2, dim2=-1) - row.square() / total  # diag of the conditioned C
    if normalize:
        s = var.mean(-1, keepdim=True) / math.sqrt(c / 2)
        m, var = m / s.sqrt(), var / s
    alpha = (1 - 2 / c + m.exp() / c**2 * (-m).exp().sum(-1, keepdim=True)) / var
    probs = alpha / alpha.sum(-1, keepdim=True)
    return torch.nan_to_num(probs, nan=1.0)
