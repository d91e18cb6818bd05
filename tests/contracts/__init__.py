"""Contract test suites, one per abstraction, in the style of GPyTorch's ``Base*TestCase``.

Each module holds a base class (not collected: its name does not start with ``Test``) whose tests
check an implementation against an independent computation: autograd Hessians and Jacobians,
dense linear algebra, closed forms and brute-force Monte Carlo. An implementation is tested by a
subclass named ``Test...`` in a ``tests/test_contract_*.py`` file that only says how to build it:

- `likelihood.BaseLikelihoodTestCase`: ``create_likelihood``, ``num_outputs``, ``targets``;
- `subspace.BaseSubspaceTestCase`: ``create_subspace(net)``;
- `posterior.BasePosteriorTestCase`: ``create_posterior(K)``, ``reference_curvature(C)``;
- `guide.BaseGuideTestCase`: ``subset``, ``structure``, ``rank`` of ``infer.Laplace``.

Tolerances: ``1e-10``-ish for float64 identities, ``Z_MC`` standard errors for Monte Carlo
(``MC_SE`` gives the standard error of a sample covariance).
"""

from __future__ import annotations

import torch

#: standard errors allowed for a Monte Carlo estimate (many entries are checked per test:
#: P(|z| > 5) = 5.7e-7 per entry).
Z_MC = 5.0


def mc_covariance_se(cov: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Standard errors of the entries of a Gaussian sample covariance of ``num_samples`` draws:
    ``√((Σ_ii Σ_jj + Σ_ij²) / S)`` (Wishart variance)."""
    d = cov.diagonal()
    return ((d[:, None] * d[None, :] + cov.square()) / num_samples).sqrt()


def assert_close_mc(estimate, expected, se, what: str) -> None:
    """``|estimate − expected| <= Z_MC · se`` entrywise, with the worst z in the message."""
    z = ((estimate - expected).abs() / se).max()
    assert bool(z <= Z_MC), f"{what}: off by {float(z):.2f} standard errors (allowed {Z_MC})"
