"""The Laplace guide as a Pyro autoguide: SVI, Predictive, AutoGuideList, one prior, persistence.

Independent targets: for a linear-Gaussian model the Laplace posterior is exact, so every ELBO
particle equals ``log p(y)`` (the closed-form evidence), and the guide's draws must have the
conjugate posterior's moments (tolerances from the Monte Carlo standard error).
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList
from test_persistence import PersistenceContract
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces
from pyro_subspace.infer import AutoSubspaceLaplace, DiagonalLaplace, Laplace

pytestmark = pytest.mark.usefixtures("one_thread")


def linear_problem(n: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    net = nn.Linear(3, 1, bias=False).double()
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.3 * torch.randn(
        n, generator=gen, dtype=torch.float64
    )
    return net, x, y


def exact_log_evidence(x, y, sigma, lam, shift):
    """``log N(y | X ŵ, σ² I + X Xᵀ/λ)`` for ``w = ŵ + t``, ``t ~ N(0, λ⁻¹ I)``."""
    cov = sigma**2 * torch.eye(x.shape[0], dtype=x.dtype) + x @ x.T / lam
    return torch.distributions.MultivariateNormal(x @ shift, cov).log_prob(y)


def fitted_linear_guide(prior_mean: str = "shift"):
    net, x, y = linear_problem()
    sub = subspaces.Subspace(torch.zeros(3, dtype=torch.float64), torch.arange(3))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.3), prior_mean=prior_mean)
    guide = AutoSubspaceLaplace(model, prior_precision=2.0).fit(x, y)
    return model, guide, x, y


def test_every_elbo_particle_equals_the_exact_evidence():
    model, guide, x, y = fitted_linear_guide()
    sigma = float(model.likelihood.sigma)  # the float32 value the likelihood holds (issue 12)
    exact = float(exact_log_evidence(x, y, sigma, 2.0, torch.zeros(3, dtype=torch.float64)))
    assert float(guide.log_marginal_likelihood()) == pytest.approx(exact, rel=1e-10)
    for _ in range(3):  # q is the exact posterior: log p(y, t) − log q(t) = log p(y) for every t
        loss = Trace_ELBO(num_particles=1).loss(model, guide, x, y)
        assert -loss == pytest.approx(exact, rel=1e-8)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), Trace_ELBO())  # no params to learn
    assert -svi.evaluate_loss(x, y) == pytest.approx(exact, rel=1e-8)


@pytest.mark.parametrize("in_list", [False, True])
def test_predictive_and_autoguidelist_draw_the_posterior(in_list):
    model, guide, x, y = fitted_linear_guide()
    cov = torch.linalg.inv(x.T @ x / 0.09 + 2.0 * torch.eye(3, dtype=torch.float64))
    mean = cov @ x.T @ y / 0.09
    g = guide
    if in_list:
        g = AutoGuideList(model)
        g.append(guide)
    s = 4000
    t = Predictive(model, guide=g, num_samples=s, return_sites=["t"])(x)["t"].reshape(s, 3)
    se = (cov.diagonal() / s).sqrt()
    assert ((t.mean(0) - mean).abs() < 5 * se).all()
    assert torch.allclose(t.T.cov(), cov, rtol=0.15, atol=5 * float(cov.diagonal().max()) / s**0.5)
    assert torch.allclose(guide.median()["t"], mean, rtol=1e-8)
    q = guide.quantiles([0.5])["t"][0]
    assert torch.allclose(q, mean, rtol=1e-8)


def test_model_and_guide_share_one_prior():
    model, guide, x, y = fitted_linear_guide(prior_mean="zero")
    guide.set_prior_precision(5.0)
    assert torch.allclose(model.prior_precision, torch.full((3,), 5.0, dtype=torch.float64))
    # the model's prior is the guide's: log N(t | t₀, Λ₀⁻¹) at the posterior mean
    t = guide.loc
    lam = guide.prior_precision_matrix()
    d = t - guide.prior_loc
    expected = -0.5 * d @ lam @ d + 0.5 * torch.logdet(lam) - 1.5 * torch.log(
        torch.tensor(2 * torch.pi, dtype=torch.float64)
    )
    assert float(model.prior().log_prob(t)) == pytest.approx(float(expected), rel=1e-10)


def test_diagonal_laplace_is_the_diag_structure_on_all_weights():
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(30, 2, dtype=torch.float64)
    diag = DiagonalLaplace(net, likelihoods.Categorical(), prior_precision=3.0).fit(x)
    front = Laplace(net, likelihoods.Categorical(), "all", "diag", prior_precision=3.0).fit(
        x, find_map=False
    )
    assert torch.equal(diag.variance, front.covariance)
    assert diag.variance.shape == (sum(p.numel() for p in net.parameters()),)


# ---------------------------------------------------------------------- persistence


def _classifier():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(50, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (50,))
    return net, x, y


class _GuideContract(PersistenceContract):
    subset = "last_layer"
    structure = "full"

    def _build(self):
        net, x, y = _classifier()
        return Laplace(net, likelihoods.Categorical(), self.subset, self.structure, 2.0), x, y

    def fitted(self):
        la, x, y = self._build()
        la.fit(x, y, find_map=False)
        la.optimize_prior_precision("grid", x_val=x[:20], y_val=y[:20])
        return _Pair(la)

    def fresh(self):
        return _Pair(self._build()[0])

    def outputs(self, pair):
        x = _classifier()[1]
        la = pair.guide
        return (
            la.predict(x).probs,
            la.predict(x, link_approx="mc", num_samples=50, seed=3).probs,
            la.sample_weights(5, seed=1),
            la.log_marginal_likelihood(),
        )


class _Pair(nn.Module):
    """The guide and its model (whose prior the guide tuned), saved together."""

    def __init__(self, guide) -> None:
        super().__init__()
        self.guide = guide
        self.model = guide.model


class TestLastLayerFull(_GuideContract):
    pass


class TestAllWeightsDiag(_GuideContract):
    subset, structure = "all", "diag"


class TestSubnetworkFull(_GuideContract):
    subset = torch.tensor([0, 5, 9, 40, 60])


def test_a_dataloader_gives_the_fit_of_the_tensors():
    """The evaluator streams a DataLoader chunk by chunk; the MAP, curvature and evidence equal
    those of the in-memory tensors (same sums, other chunking: float64 rounding only)."""
    from torch.utils.data import DataLoader, TensorDataset

    net, x, y = _classifier()
    a = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=2.0).fit(x, y)
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    b = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=2.0).fit(loader)
    c = Laplace(net, likelihoods.Categorical(), "last_layer", prior_precision=2.0).fit(
        TensorDataset(x, y)
    )
    for other in (b, c):
        assert torch.allclose(other.loc, a.loc, rtol=1e-9, atol=1e-12)
        assert torch.allclose(other.ggn, a.ggn, rtol=1e-10)
        assert float(other.log_marginal_likelihood()) == pytest.approx(
            float(a.log_marginal_likelihood()), rel=1e-10
        )
    with pytest.raises(ValueError, match="y: give either"):
        Laplace(net, likelihoods.Categorical(), "last_layer").fit(loader, y)
    with pytest.raises(TypeError, match="x: expected"):
        Laplace(net, likelihoods.Categorical(), "last_layer").fit([1, 2], y)
