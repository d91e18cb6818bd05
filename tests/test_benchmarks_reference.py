"""benchmarks/ess_vs_nuts.py's `importance_reference`: the reference of a row on which NUTS does
not converge, checked against one-dimensional quadrature on a posterior with two modes of
unequal mass."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks.ess_vs_nuts import importance_reference
from pyro_subspace import SubspaceNet, likelihoods
from pyro_subspace.subspaces import DenseSubspace

pytestmark = pytest.mark.usefixtures("one_thread")

SIGMA = 0.3


class Quadratic(nn.Module):
    """``f(x) = (w² + 0.4 w) x``: with ``x = 1`` and ``y = 1`` the posterior of ``w`` has modes
    near ``w = 0.83`` and ``w = −1.23`` with unequal mass."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        return (self.w**2 + 0.4 * self.w) * x


def test_importance_reference_matches_quadrature_on_two_modes():
    net = Quadratic()
    sub = DenseSubspace(torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(SIGMA))
    x = torch.ones(4, 1, dtype=torch.float64)
    y = torch.ones(4, dtype=torch.float64)
    starts = np.array([[0.9], [-1.1]])
    ref = importance_reference(model, x, y, starts, draws=20_000, seed=1)
    # the oracle: log p(t) + Σ log N(y | f(t), σ²) on a fine grid
    t = np.linspace(-4, 4, 400_001)
    f = t**2 + 0.4 * t
    log_post = -0.5 * t**2 - 4 * 0.5 * (1 - f) ** 2 / SIGMA**2
    p = np.exp(log_post - log_post.max())
    mean = (t * p).sum() / p.sum()
    right = p[t > -0.2].sum() / p.sum()  # the mass of the mode near 0.83
    assert len(ref.weights) == 2
    assert ref.pareto_k < 0.7
    assert abs(ref.mean[0] - mean) < 4 * ref.mcse[0]
    order = np.argsort(-ref.log_density)  # the better mode (near 0.83) first
    spread = math.sqrt(right * (1 - right) / ref.ess)
    assert abs(ref.weights[order[0]] - right) < 4 * spread + 1e-3
    assert 0.55 < right < 0.95  # both modes carry mass: the test can fail either way
