"""`infer.marglik_training` (Immer et al. 2021, Algorithm 1) against laplace-torch 0.3's, and
what it is for: the noise learned without post-hoc tuning.

- One epoch and one hyperparameter step on a float64 regression MLP, same batches: the log
  joint losses, the negative log evidence, the trained weights and the returned Laplace's
  hyperparameters equal laplace-torch's (CurvlinopsGGN, K-FAC) to ``1e-6`` (skipped without
  laplace-torch).
- The evidence's gradient in ``σ`` (what the hyperparameter steps follow) equals central
  finite differences, for every structure.
- On ``y = sin(x) + σ ε`` with ``σ = 0.2``, ``N = 200``, the trained ``σ̂`` is within three
  standard errors of the truth, ``|σ̂ − σ| ≤ 3σ/√(2N)``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from pyro_subspace import infer

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def _problem(n: int = 60, sigma: float = 0.2, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.linspace(-3, 3, n, dtype=F64)[:, None]
    y = torch.sin(x) + sigma * torch.randn(n, 1, dtype=F64)
    net = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1)).to(F64)
    return net, DataLoader(TensorDataset(x, y), batch_size=20)


def test_one_step_equals_laplace_torch():
    laplace = pytest.importorskip("laplace", reason="laplace-torch is a comparison only")
    from laplace.curvature import CurvlinopsGGN

    net, loader = _problem()
    ours = infer.marglik_training(
        copy.deepcopy(net), loader, "regression", n_epochs=1, n_hypersteps=1,
        optimizer_kwargs={"lr": 1e-2},
    )  # fmt: skip
    theirs = laplace.marglik_training(
        copy.deepcopy(net), loader, "regression", n_epochs=1, n_hypersteps=1,
        backend=CurvlinopsGGN, optimizer_kwargs={"lr": 1e-2},
    )  # fmt: skip
    (la, model, margliks, losses), (la_t, model_t, margliks_t, losses_t) = ours, theirs
    assert abs(losses[0] - losses_t[0]) <= 1e-6 * abs(losses_t[0])
    assert abs(margliks[0] - margliks_t[0]) <= 1e-6 * abs(margliks_t[0])
    for a, b in zip(model.parameters(), model_t.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert float(la.prior_precision.max()) == pytest.approx(float(la_t.prior_precision.max()), rel=1e-6)
    assert float(la.sigma_noise) == pytest.approx(float(la_t.sigma_noise), rel=1e-6)
    lml, lml_t = float(la.log_marginal_likelihood()), float(la_t.log_marginal_likelihood())
    assert abs(lml - lml_t) <= 1e-6 * abs(lml_t)


@pytest.mark.parametrize("structure", ["kron", "full", "diag"])
def test_the_evidence_gradient_in_sigma_is_its_finite_difference(structure):
    net, loader = _problem()
    la = infer.Laplace(net, "regression", "all", structure, sigma_noise=1.0).fit(loader)
    lam = torch.full((4,), 0.7, dtype=F64)
    s = torch.tensor([0.6], dtype=F64, requires_grad=True)
    la.log_marginal_likelihood(lam, s).backward()
    h = 1e-6
    up = float(la.log_marginal_likelihood(lam, torch.tensor([0.6 + h], dtype=F64)))
    down = float(la.log_marginal_likelihood(lam, torch.tensor([0.6 - h], dtype=F64)))
    assert s.grad.item() == pytest.approx((up - down) / (2 * h), rel=1e-6)


def test_the_noise_is_learned_within_three_standard_errors():
    sigma, n = 0.2, 200
    net, loader = _problem(n, sigma, seed=1)
    la, _, margliks, _ = infer.marglik_training(
        net, loader, "regression", n_epochs=300, marglik_frequency=10, n_hypersteps=20,
        optimizer_kwargs={"lr": 1e-2},
    )  # fmt: skip
    assert margliks[-1] < margliks[0]
    assert abs(float(la.sigma_noise) - sigma) <= 3 * sigma / (2 * n) ** 0.5
