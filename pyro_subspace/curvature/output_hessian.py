"""Output Hessians ``H_n = −∂² log p(y | f)/∂f²``: the inner matrix of the GGN.

Subnetwork Inference (Daxberger et al., 2021), eq. (9): ``G = Σ_n J_nᵀ H_n J_n``. `ggn` uses
`output_hessian` for ``G v`` and the factor ``L_n L_nᵀ = H_n`` for ``Pᵀ G P`` and ``diag(G)``.
"""

from __future__ import annotations

import torch

from ..likelihoods import Bernoulli, Categorical, Gaussian


def check_likelihood(likelihood: object) -> None:
    """Raise ``TypeError`` unless ``likelihood`` is one whose output Hessian is known here."""
    if not isinstance(likelihood, (Gaussian, Categorical, Bernoulli)):
        raise TypeError(
            "likelihood: expected a pyro_subspace Gaussian, Categorical or Bernoulli likelihood, "
            f"got {type(likelihood).__name__}"
        )


def _check_outputs(likelihood: object, outputs: object) -> None:
    check_likelihood(likelihood)
    if not isinstance(outputs, torch.Tensor) or not outputs.is_floating_point():
        raise TypeError(f"outputs: expected a floating-point tensor (N, O), got {outputs!r}")
    if outputs.dim() != 2:
        raise ValueError(f"outputs: expected shape (N, O), got {tuple(outputs.shape)}")
    if not torch.isfinite(outputs).all():
        raise ValueError("outputs: contains NaN or inf")
    likelihood.check_outputs(outputs)
    homoscedastic = isinstance(likelihood, Gaussian) and not likelihood.heteroscedastic
    if homoscedastic and likelihood.sigma.numel() not in (1, outputs.shape[1]):
        raise ValueError(
            f"outputs: {outputs.shape[1]} columns, but the likelihood's sigma has "
            f"{likelihood.sigma.numel()} entries"
        )


def _diagonal_hessian(likelihood: Gaussian | Bernoulli, out: torch.Tensor) -> torch.Tensor:
    """The diagonal of a diagonal ``H_n``, shape ``(N, O)``."""
    if isinstance(likelihood, Bernoulli):
        p = out.sigmoid()
        return p * (1 - p)
    scale = likelihood.loc_scale(out)[1].detach()
    if not likelihood.heteroscedastic:
        return scale.reshape(out.shape).square().reciprocal()
    ds = out[:, 1].sigmoid()  # d softplus(raw) / d raw
    return torch.stack([scale.square().reciprocal(), 2 * ds.square() / scale.square()], -1)


def output_hessian(
    likelihood: Gaussian | Categorical | Bernoulli, outputs: torch.Tensor
) -> torch.Tensor:
    """``H_n = −∂² log p(y | f) / ∂f²`` at the outputs ``f_n``: the GGN's inner matrix (eq. 9).

    None of these depend on ``y``:

    - Gaussian, homoscedastic: ``diag(1/σ²)`` (``σ`` fixed, per output, or a learned
      ``PyroParam`` at its current value).
    - Gaussian, heteroscedastic (columns mean ``μ`` and raw scale ``r``,
      ``s = softplus(r) + min_scale``): the true Hessian in ``r`` depends on ``y`` and can be
      negative, so we use the Fisher ``E_y[∇ log p ∇ log pᵀ]``, which is positive
      semi-definite. With ``z = (y − μ)/s ~ N(0, 1)`` the score is ``(z/s, (z² − 1) s'/s)`` with
      ``s' = ds/dr = sigmoid(r)``; ``E[z²] = 1``, ``E[z³] = 0``, ``E[(z² − 1)²] = 2`` give
      ``diag(1/s², 2 s'²/s²)`` with a zero cross term.
    - Categorical (logits): ``diag(p) − p pᵀ`` with ``p = softmax(f)``.
    - Bernoulli (one logit): ``p (1 − p)`` with ``p = sigmoid(f)``.

    Args:
        likelihood: a `Gaussian`, `Categorical` or `Bernoulli` likelihood.
        outputs: network outputs, shape ``(N, O)``.

    Returns:
        ``H``, shape ``(N, O, O)``, detached.
    """
    _check_outputs(likelihood, outputs)
    out = outputs.detach()
    if isinstance(likelihood, Categorical):
        p = out.softmax(-1)
        return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.diag_embed(_diagonal_hessian(likelihood, out))


def hessian_factor(likelihood: object, out: torch.Tensor) -> torch.Tensor:
    """``L_n`` with ``L_n L_nᵀ = H_n``, shape ``(N, O, O)``.

    Diagonal ``H``: ``diag(√h)``. Categorical: ``L = diag(√p) − p √pᵀ``, exact because
    ``Σ_c p_c = 1`` gives ``L Lᵀ = diag(p) − 2 p pᵀ + p pᵀ``.
    """
    _check_outputs(likelihood, out)
    out = out.detach()
    if isinstance(likelihood, Categorical):
        p = out.softmax(-1)
        sqrt_p = p.sqrt()
        return torch.diag_embed(sqrt_p) - p[:, :, None] * sqrt_p[:, None, :]
    return torch.diag_embed(_diagonal_hessian(likelihood, out).sqrt())
