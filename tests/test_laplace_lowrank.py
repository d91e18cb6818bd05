"""The low-rank plus isotropic-remainder Laplace (``hessian_structure="lowrank"``) against dense
linear algebra: with ``k = K`` it is the full structure; with ``k < K`` it is the dense
``(U diag(l/T) Uᵀ + λ I)⁻¹`` built from its own eigenpairs (inverse, log-determinant, evidence,
``J Σ Jᵀ``), and those eigenpairs are the top of ``eigh`` of the dense GGN. The structure's
own contract (draws, density, feature covariances) is in ``test_contract_structures.py``; the
guide's (all draws one ``Σ``, persistence) in ``test_contract_guides.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pyro_subspace import FlatNet, likelihoods
from pyro_subspace.flat import eval_mode
from pyro_subspace.infer import AutoSubspaceLaplace, Laplace
from pyro_subspace.infer.laplace import linearized_moments

pytestmark = pytest.mark.usefixtures("one_thread")


def classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()  # D = 38
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (40,), generator=gen)
    return net, x, y


def fit(structure, rank=None, lam=1.5, find_map=False):
    net, x, y = classifier()
    la = Laplace(net, likelihoods.Categorical(), "all", structure, lam, rank=rank)
    return la.fit(x, y, find_map=find_map), x, y


def dense_jacobian(guide, x):
    sub, flat = guide.model.subspace, FlatNet(guide.model.flat.net)
    with eval_mode(flat.net):
        return torch.autograd.functional.jacobian(lambda t: flat(sub.weights(t), x), guide.loc)


def test_full_rank_equals_the_full_structure():
    full, x, _ = fit("full", find_map=True)
    k = full.model.rank
    low, _, _ = fit("lowrank", rank=k, find_map=True)
    assert torch.allclose(low.loc, full.loc, rtol=0, atol=1e-12)
    assert torch.allclose(low.precision, full.precision, rtol=1e-10, atol=1e-10)
    assert torch.allclose(low.covariance, full.covariance, rtol=1e-10, atol=1e-12)
    assert float(low.log_marginal_likelihood()) == pytest.approx(
        float(full.log_marginal_likelihood()), rel=1e-10
    )
    for lam in (0.1, 20.0):  # re-tuned without refitting
        assert float(low.log_marginal_likelihood(lam)) == pytest.approx(
            float(full.log_marginal_likelihood(lam)), rel=1e-10
        )
    _, cov_low = linearized_moments(low, x[:10])
    _, cov_full = linearized_moments(full, x[:10])
    assert torch.allclose(cov_low, cov_full, rtol=1e-10, atol=1e-13)
    assert torch.allclose(low.predict(x).probs, full.predict(x).probs, rtol=1e-10)


@pytest.mark.parametrize("rank", [1, 4])
def test_low_rank_is_the_dense_formula_of_its_own_eigenpairs(rank):
    la, x, y = fit("lowrank", rank=rank)
    k, lam, temp = la.model.rank, 1.5, la.temperature
    assert la.posterior.lanczos_iterations(k) < k  # the eigenpairs come from Lanczos
    u, l = la.posterior.eigenvectors, la.posterior.eigenvalues
    assert u.shape == (k, rank) and l.shape == (rank,)
    precision = u @ torch.diag(l / temp) @ u.T + lam * torch.eye(k, dtype=torch.float64)
    sigma = torch.linalg.inv(precision)
    assert torch.allclose(la.precision, precision, rtol=1e-12, atol=1e-12)
    assert torch.allclose(la.covariance, sigma, rtol=1e-10, atol=1e-12)
    jac = dense_jacobian(la, x[:10])
    _, f_cov = linearized_moments(la, x[:10])
    assert torch.allclose(f_cov, jac @ sigma @ jac.mT, rtol=1e-10, atol=1e-12)
    # evidence: ℓ − ½ dᵀ λ d + ½ log|λI| − ½ log|Σ⁻¹|, ℓ summed by hand, d = t* − t₀ = ŵ
    with eval_mode(la.model.flat.net), torch.no_grad():
        loglik = likelihoods.Categorical().log_prob(la.model.flat.net(x), y).sum()
    d = la.loc + la.model.subspace.shift.double()
    expected = loglik / temp - lam * d @ d / 2 + k * math.log(lam) / 2 - torch.logdet(precision) / 2
    assert float(la.log_marginal_likelihood()) == pytest.approx(float(expected), rel=1e-10)


def test_lanczos_eigenpairs_are_the_top_of_the_dense_ggn():
    full, _, _ = fit("full")
    values, vectors = torch.linalg.eigh(full.ggn)
    low, _, _ = fit("lowrank", rank=4)
    u, l = low.posterior.eigenvectors, low.posterior.eigenvalues
    top = values.flip(0)[:4]
    # Lanczos stops at relative β < 1e-6 (curvature.lanczos): allow that relative error
    assert torch.allclose(l, top, rtol=1e-6, atol=1e-6 * float(top[0]))
    projector = vectors.flip(1)[:, :4] @ vectors.flip(1)[:, :4].T
    assert torch.allclose(u @ u.T, projector, atol=1e-5)


def test_marglik_tuning_finds_the_maximum_of_the_dense_evidence():
    la, _, _ = fit("lowrank", rank=3)
    ggn = la.ggn.clone()
    la.optimize_prior_precision("marglik")
    assert torch.equal(la.ggn, ggn)  # the eigenpairs are kept
    best = float(la.prior_precision)
    at = [float(la.log_marginal_likelihood(best * f)) for f in (0.99, 1.0, 1.01)]
    assert at[1] >= max(at[0], at[2])


def test_noise_scale_retuning_equals_a_refit_at_that_noise():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    x = torch.randn(30, 2, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * x[:, 1]
    a = Laplace(net, likelihoods.Gaussian(0.25), "all", "lowrank", 1.0, rank=3)
    b = Laplace(net, likelihoods.Gaussian(0.5), "all", "lowrank", 1.0, rank=3)
    a.fit(x, y, find_map=False)  # both at t* = 0: the evidence differs only through σ
    b.fit(x, y, find_map=False)
    assert float(a.guide.log_marginal_likelihood(sigma=0.5)) == pytest.approx(
        float(b.log_marginal_likelihood()), rel=1e-10
    )
    a.optimize_prior_precision(optimize_sigma=True)  # rescales the eigenvalues in place
    assert float(a.likelihood.sigma) != 0.25
    b2 = Laplace(
        net, likelihoods.Gaussian(float(a.likelihood.sigma)), "all", "lowrank", 1.0, rank=3
    )
    b2.fit(x, y, find_map=False)
    # σ is held in float32 (rounding 6e-8 relative, 1.2e-7 in σ²)
    assert torch.allclose(a.posterior.eigenvalues, b2.posterior.eigenvalues, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hessian_structure": "lowrnak"}, "hessian_structure: expected one of"),
        ({"hessian_structure": "full", "rank": 3}, "rank: only used with"),
        ({"hessian_structure": "lowrank", "rank": 0}, "rank: expected a positive int"),
        ({"hessian_structure": "lowrank", "rank": 2.5}, "rank: expected a positive int"),
        ({"hessian_structure": "lowrank", "rank": True}, "rank: expected a positive int"),
        ({"hessian_structure": "lowrank", "rank": 39}, r"rank: expected an int in \[1, 38\]"),
    ],
)
def test_bad_structure_arguments_fail_early(kwargs, match):
    net, _, _ = classifier()
    with pytest.raises(ValueError, match=match):
        Laplace(net, likelihoods.Categorical(), "all", **kwargs)


def test_default_rank_and_the_guide_constructor():
    net, _, _ = classifier()
    la = Laplace(net, likelihoods.Categorical(), "all", "lowrank")
    assert la.posterior.rank == 10 and la.posterior.eigenvectors.shape == (38, 10)
    with pytest.raises(ValueError, match="rank: only used with"):
        AutoSubspaceLaplace(la.model, hessian_structure="diag", rank=2)


def test_the_map_search_step_is_sigma_times_the_gradient_without_a_dense_ggn(monkeypatch):
    """The last Gauss–Newton step of the MAP search uses the low-rank ``Σ`` (Woodbury): the
    dense ``PᵀGP`` (`Evaluator.ggn`) is never formed when Lanczos applies."""
    from pyro_subspace.nn.evaluator import Evaluator

    la, x, y = fit("lowrank", rank=4)
    ev = la.model.evaluator(x, y)
    grad = torch.linspace(-1, 1, la.model.rank, dtype=torch.float64)

    def no_dense_ggn(*args, **kwargs):
        raise AssertionError("the dense GGN was formed")

    monkeypatch.setattr(Evaluator, "ggn", no_dense_ggn)
    step = la.posterior.newton_step(ev, la.loc, grad, la.guide.prior())
    u, l = la.posterior.eigenvectors, la.posterior.eigenvalues
    precision = u @ torch.diag(l / la.temperature) @ u.T + 1.5 * torch.eye(la.model.rank).double()
    assert torch.allclose(step, torch.linalg.solve(precision, grad), rtol=1e-10, atol=1e-13)
    net, _, _ = classifier()
    Laplace(net, likelihoods.Categorical(), "all", "lowrank", 1.5, rank=4).fit(
        x, y, find_map=True
    )  # MAP search
