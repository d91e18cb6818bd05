"""Output Hessians ``H_n = −∂² log p(y | f)/∂f²``: the inner matrix of the GGN.

Subnetwork Inference (Daxberger et al., 2021), eq. (9): ``G = Σ_n J_nᵀ H_n J_n``. The math lives
on each likelihood (`Likelihood.output_hessian`, `Likelihood.hessian_factor`); these functions
are the curvature package's names for them.
"""

from __future__ import annotations

import torch

from ..likelihoods import Likelihood, check_likelihood


def output_hessian(likelihood: Likelihood, outputs: torch.Tensor) -> torch.Tensor:
    """``H_n`` ``(N, O, O)`` at the outputs ``(N, O)``, detached: `Likelihood.output_hessian`."""
    return check_likelihood(likelihood).output_hessian(outputs)


def hessian_factor(likelihood: Likelihood, outputs: torch.Tensor) -> torch.Tensor:
    """``L_n`` with ``L_n L_nᵀ = H_n``, ``(N, O, R)``: `Likelihood.hessian_factor`."""
    return check_likelihood(likelihood).hessian_factor(outputs)
