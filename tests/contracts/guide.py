"""`BaseGuideTestCase`: the contract of a Laplace guide (an `AutoSubspaceLaplace`, a Pyro
``AutoContinuous``), for any subspace kind and posterior structure.

Two problems. (A) a linear-Gaussian model ``y = [X, 1] w + ε`` whose design has orthogonal
columns and one zero column, so ``PᵀGP`` is diagonal of rank 3 and every structure (full,
diagonal, top-3 low rank) is exact: the guide must be the conjugate posterior, its evidence the
closed-form ``log N(y | …)``, and every ``Trace_ELBO`` particle equal to it. (B) a small
classifier: every way of drawing (``forward``, `sample_weights`, ``Predictive`` through an
``AutoGuideList``) samples the one ``Σ`` within Monte Carlo error, the linearised predictive
is ``J Σ Jᵀ`` with autograd Jacobians, `median`/`quantiles`/`get_posterior` agree with it,
re-tuning ``λ`` keeps the curvature, and (via `PersistenceContract`) ``state_dict`` round
trips give bit-identical predictions.
"""

from __future__ import annotations

import pyro
import pytest
import torch
from pyro.infer import Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoGuideList
from test_persistence import PersistenceContract
from torch import nn

from pyro_subspace import FlatNet, likelihoods
from pyro_subspace.flat import eval_mode
from pyro_subspace.infer import Laplace
from pyro_subspace.infer.laplace import linearized_moments

from . import assert_close_mc, mc_covariance_se

LAM = 2.0
SIGMA = 0.3


def linear_problem(n: int = 12):
    """``nn.Linear(3, 1)`` (``D = 4``: three weights, the bias) and data whose augmented design
    ``[X, 1]`` has orthogonal columns, the third zero."""
    gen = torch.Generator().manual_seed(0)
    q = torch.linalg.qr(
        torch.cat([torch.ones(n, 1), torch.randn(n, 2, generator=gen)], 1).double()
    ).Q
    x = torch.cat([3.0 * q[:, 1:2], 1.5 * q[:, 2:3], torch.zeros(n, 1)], 1).double()
    torch.manual_seed(1)
    net = nn.Linear(3, 1).double()
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.4
    y = y + SIGMA * torch.randn(n, generator=gen, dtype=torch.float64)
    return net, x, y


def classifier_problem():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(50, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (50,))
    return net, x, y


def dense_sigma(guide) -> torch.Tensor:
    """``Σ`` ``(K, K)`` of any structure: its functional covariance with ``J = I``."""
    eye = torch.eye(guide.model.rank, dtype=guide.posterior.buffer_dtype)
    return guide.posterior.functional_covariance(eye[None])[0].double()


class _Pair(nn.Module):
    """The guide and its model (whose prior the guide tuned), saved together."""

    def __init__(self, guide) -> None:
        super().__init__()
        self.guide = guide
        self.model = guide.model


class BaseGuideTestCase(PersistenceContract):
    """Subclasses set `subset`, `structure` (and `rank`), or override `build`."""

    subset: object = "last_layer"
    structure: str = "full"
    rank: int | None = None
    num_draws: int = 2000

    def subset_for(self, net: nn.Module):
        return self.subset

    def build(self, net: nn.Module, likelihood):
        subset = self.subset_for(net)
        return Laplace(net, likelihood, subset, self.structure, LAM, rank=self.rank).guide

    # ------------------------------------------------------------------ (A) linear-Gaussian

    def linear_fit(self):
        net, x, y = linear_problem()
        guide = self.build(net, likelihoods.Gaussian(SIGMA)).fit(x, y, find_map=True)
        return guide, x, y

    @staticmethod
    def conjugate(guide, x, y):
        """Posterior mean, covariance and log evidence of ``t`` by dense linear algebra."""
        sub = guide.model.subspace
        p = sub.dense_basis().double()
        shift = sub.shift.double()
        sigma2 = float(guide.likelihood.sigma) ** 2  # the value the likelihood holds
        design = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1) @ p  # (N, K)
        if guide.model.prior_mean == "zero":
            gram = p.T @ p
            m0, lam0 = -torch.linalg.solve(gram, p.T @ shift), LAM * gram
        else:
            m0, lam0 = (
                torch.zeros(p.shape[1], dtype=torch.float64),
                LAM * torch.eye(p.shape[1]).double(),
            )
        resid = y - torch.cat([x, torch.ones_like(x[:, :1])], 1) @ shift
        precision = design.T @ design / sigma2 + lam0
        cov = torch.linalg.inv(precision)
        mean = cov @ (design.T @ resid / sigma2 + lam0 @ m0)
        marginal = torch.distributions.MultivariateNormal(
            design @ m0,
            sigma2 * torch.eye(x.shape[0], dtype=torch.float64)
            + design @ torch.linalg.solve(lam0, design.T),
        )
        return mean, cov, marginal.log_prob(resid)

    def test_linear_gaussian_posterior_is_the_conjugate_posterior(self):
        guide, x, y = self.linear_fit()
        mean, cov, _ = self.conjugate(guide, x, y)
        assert torch.allclose(guide.loc, mean, rtol=1e-7, atol=1e-9)
        assert torch.allclose(dense_sigma(guide), cov, rtol=1e-9, atol=1e-12)

    def test_evidence_and_every_elbo_particle_equal_the_closed_form(self):
        guide, x, y = self.linear_fit()
        exact = float(self.conjugate(guide, x, y)[2])
        assert float(guide.log_marginal_likelihood()) == pytest.approx(exact, rel=1e-9)
        for _ in range(3):  # q is the exact posterior: log p(y, t) − log q(t) = log p(y)
            assert -Trace_ELBO().loss(guide.model, guide, x, y) == pytest.approx(exact, rel=1e-7)

    # ------------------------------------------------------------------ (B) a classifier

    def classifier_fit(self):
        net, x, y = classifier_problem()
        guide = self.build(net, likelihoods.Categorical())
        guide.fit(x, y, find_map=False)
        return guide, x, y

    def test_forward_sample_weights_and_predictive_draw_one_posterior(self):
        guide, x, _ = self.classifier_fit()
        sigma, sub = dense_sigma(guide), guide.model.subspace
        draws = {}
        with pyro.plate("draws", self.num_draws, dim=-1):  # the guide's forward, vectorised
            draws["forward"] = guide(x[:2])["t"].double()
        draws["sample_weights"] = sub.project(guide.sample_weights(self.num_draws, seed=4)).double()
        listed = AutoGuideList(guide.model)  # the guide now belongs to the list (Pyro's rule)
        listed.append(guide)
        predictive = Predictive(  # runs the model per draw: fewer draws
            guide.model, guide=listed, num_samples=400, return_sites=["t"], parallel=True
        )
        draws["Predictive(AutoGuideList)"] = predictive(x[:2])["t"].reshape(400, -1).double()
        for name, t in draws.items():
            s = t.shape[0]
            assert t.shape == (s, guide.model.rank), name
            assert_close_mc(t.mean(0), guide.loc, (sigma.diagonal() / s).sqrt(), f"{name} mean")
            assert_close_mc(t.T.cov(), sigma, mc_covariance_se(sigma, s), f"{name} covariance")

    def test_linearised_predictive_is_j_sigma_jt(self):
        guide, x, _ = self.classifier_fit()
        sub, flat = guide.model.subspace, FlatNet(guide.model.flat.net)
        with eval_mode(flat.net):
            jac = torch.autograd.functional.jacobian(
                lambda t: flat(sub.weights(t), x[:9]), guide.loc
            )
        f_mean, f_cov = linearized_moments(guide, x[:9])
        with eval_mode(flat.net):
            assert torch.allclose(f_mean, flat(sub.weights(guide.loc), x[:9]), rtol=1e-12)
        assert torch.allclose(f_cov, jac @ dense_sigma(guide) @ jac.mT, rtol=1e-9, atol=1e-12)

    def test_median_quantiles_and_get_posterior_agree_with_sigma(self):
        guide, _, _ = self.classifier_fit()
        sigma = dense_sigma(guide)
        assert torch.allclose(guide.median()["t"].double(), guide.loc, rtol=1e-12)
        q = guide.quantiles([0.1, 0.5, 0.9])["t"].double()
        z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor([0.1, 0.5, 0.9])).double()
        expected = guide.loc + z[:, None] * sigma.diagonal().sqrt()
        assert torch.allclose(q, expected, rtol=1e-6, atol=1e-9)
        post = guide.get_posterior()
        exact = torch.distributions.MultivariateNormal(guide.loc, sigma)
        t = exact.sample((3,))
        assert torch.allclose(post.log_prob(t), exact.log_prob(t), rtol=1e-9)

    def test_retuning_the_prior_keeps_the_curvature_and_equals_a_refit(self):
        guide, x, y = self.classifier_fit()
        ggn = guide.ggn.clone()
        guide.set_prior_precision(7.5)
        assert torch.equal(guide.ggn, ggn)
        net, _, _ = classifier_problem()
        refit = self.build(net, likelihoods.Categorical())
        refit.set_prior_precision(7.5)
        refit.fit(x, y, find_map=False)
        assert torch.allclose(dense_sigma(guide), dense_sigma(refit), rtol=1e-10, atol=1e-13)
        assert float(guide.log_marginal_likelihood()) == pytest.approx(
            float(refit.log_marginal_likelihood()), rel=1e-10
        )

    # ------------------------------------------------------------------ persistence

    def fitted(self):
        guide, x, y = self.classifier_fit()
        guide.optimize_prior_precision("grid", x_val=x[:20], y_val=y[:20])
        return _Pair(guide)

    def fresh(self):
        net, _, _ = classifier_problem()
        return _Pair(self.build(net, likelihoods.Categorical()))

    def outputs(self, pair):
        x = classifier_problem()[1]
        la = pair.guide
        return (
            la.predict(x).probs,
            la.predict(x, link_approx="mc", num_samples=50, seed=3).probs,
            la.sample_weights(5, seed=1),
            la.log_marginal_likelihood(),
        )
