"""`BaseStructureTestCase`: the contract of a posterior structure (infer/laplace/structures.py).

A structure represents ``Σ⁻¹ = C̃/T + Λ₀`` where ``C̃`` is its approximation of the subspace GGN
``C = PᵀGP`` (``C`` itself, its diagonal, its top-``k`` eigenpairs). Subclasses say what ``C̃``
is as a dense matrix (`reference_curvature`) and how to read their buffers densely
(`to_dense`); every method is then checked against dense linear algebra: ``torch.linalg.inv``,
``torch.logdet``, ``J Σ Jᵀ`` by ``einsum``, the curvature against ``Jᵀ H J`` from autograd
Jacobians, and draws against ``Σ`` within Monte Carlo error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyro_subspace import FlatNet, SubspaceNet, likelihoods
from pyro_subspace.flat import eval_mode
from pyro_subspace.subspaces import Subspace

from . import assert_close_mc, mc_covariance_se

K = 6
TEMPERATURE = 2.0


class _Prior:
    """What `prior_matrix` reads from a model: ``PᵀP = I``."""

    def prior_gram_matrix(self):
        return torch.eye(K, dtype=torch.float64)

    def prior_gram_diagonal(self):
        return torch.ones(K, dtype=torch.float64)


def random_ggn(seed: int = 0, rank: int = 4) -> torch.Tensor:
    """A positive semi-definite ``(K, K)`` of rank ``rank`` with distinct eigenvalues."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(K, rank, generator=gen, dtype=torch.float64)
    return a @ a.T


LAMBDAS = {
    "scalar": torch.tensor(0.7, dtype=torch.float64),
    "per_coordinate": torch.tensor([0.5, 1.0, 2.0, 0.3, 0.9, 1.5], dtype=torch.float64),
}


class BaseStructureTestCase:
    """Subclasses define `create_structure`, `from_dense`, `reference_curvature`, `to_dense`."""

    #: tolerance of the structure's own curvature against the dense GGN (Lanczos: ~1e-6).
    curvature_rtol: float = 1e-10
    #: the coordinates (flat indices of a 27-weight net) of `test_curvature_...`.
    curvature_indices = torch.tensor([0, 3, 8, 10, 15, 20])

    def create_structure(self, k: int):
        raise NotImplementedError

    def from_dense(self, c: torch.Tensor) -> torch.Tensor:
        """The structure's curvature buffer for the dense GGN ``c``."""
        raise NotImplementedError

    def reference_curvature(self, c: torch.Tensor) -> torch.Tensor:
        """``C̃`` ``(K, K)``: what the structure keeps of ``c``."""
        raise NotImplementedError

    def to_dense(self, buffer: torch.Tensor) -> torch.Tensor:
        """A precision or covariance buffer as a dense ``(K, K)`` matrix."""
        raise NotImplementedError

    # ------------------------------------------------------------------ fixtures

    def posterior(self, lam: torch.Tensor, seed: int = 0):
        s = self.create_structure(K)
        c = random_ggn(seed)
        prior = s.prior_matrix(lam, _Prior())
        precision = s.precision(self.from_dense(c), TEMPERATURE, prior)
        factor = s.factor(precision)
        reference = self.reference_curvature(c) / TEMPERATURE + torch.diag(lam.expand(K))
        return s, prior, precision, factor, s.covariance(factor), reference

    @staticmethod
    def dense_factor(s, factor: torch.Tensor) -> torch.Tensor:
        """``F`` ``(K, K)`` from the structure's own `draw` of the unit vectors."""
        return s.draw(factor, torch.eye(K, dtype=torch.float64)).T

    # ------------------------------------------------------------------ the posterior

    @pytest.mark.parametrize("lam", list(LAMBDAS))
    def test_precision_covariance_and_factor_against_dense_inverse(self, lam):
        s, prior, precision, factor, cov, reference = self.posterior(LAMBDAS[lam])
        sigma = torch.linalg.inv(reference)
        assert torch.allclose(self.to_dense(precision), reference, rtol=1e-12, atol=1e-13)
        assert torch.allclose(self.to_dense(cov), sigma, rtol=1e-10, atol=1e-12)
        f = self.dense_factor(s, factor)
        assert torch.allclose(f @ f.T, sigma, rtol=1e-10, atol=1e-12)
        assert torch.allclose(s.marginal_std(factor), sigma.diagonal().sqrt(), rtol=1e-10)

    @pytest.mark.parametrize("lam", list(LAMBDAS))
    def test_logdet_and_quadratic_form_against_dense(self, lam):
        s, prior, precision, _, _, reference = self.posterior(LAMBDAS[lam])
        lam_dense = torch.diag(LAMBDAS[lam].expand(K))
        d = torch.linspace(-1, 2, K, dtype=torch.float64)
        assert float(s.logdet(precision, "posterior")) == pytest.approx(
            float(torch.logdet(reference)), rel=1e-11
        )
        assert float(s.logdet(prior, "prior")) == pytest.approx(
            float(torch.logdet(lam_dense)), rel=1e-12
        )
        assert float(s.quad(precision, d)) == pytest.approx(float(d @ reference @ d), rel=1e-11)
        assert float(s.quad(prior, d)) == pytest.approx(float(d @ lam_dense @ d), rel=1e-12)

    def test_logdet_is_differentiable_in_the_prior_precision(self):
        """The evidence is maximised over ``λ`` by autograd: its gradient must be right."""
        s = self.create_structure(K)
        curv = self.from_dense(random_ggn())

        def logdet(lam):
            return s.logdet(s.precision(curv, TEMPERATURE, s.prior_matrix(lam, _Prior())), "p")

        lam = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
        (grad,) = torch.autograd.grad(logdet(lam), lam)
        reference = self.reference_curvature(random_ggn()) / TEMPERATURE
        expected = torch.linalg.inv(reference + 0.7 * torch.eye(K, dtype=torch.float64)).trace()
        assert float(grad) == pytest.approx(float(expected), rel=1e-10)

    def test_functional_covariance_is_j_sigma_jt(self):
        s, _, _, _, cov, reference = self.posterior(LAMBDAS["scalar"])
        jp = torch.randn(5, 3, K, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        expected = jp @ torch.linalg.inv(reference) @ jp.mT
        assert torch.allclose(s.functional_covariance(jp, cov), expected, rtol=1e-10, atol=1e-12)

    def test_feature_covariance_is_j_sigma_jt_of_a_last_layer(self):
        """Features ``φ̃`` ``(n, 3)`` and ``rows`` ``(2, 3)``: ``J[n, c, rows[c, p]] = φ̃[n, p]``."""
        s, _, _, _, cov, reference = self.posterior(LAMBDAS["per_coordinate"])
        phi = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        rows = torch.tensor([[4, 0, 2], [1, 5, 3]])
        jp = torch.zeros(4, 2, K, dtype=torch.float64)
        for c in range(2):
            jp[:, c, rows[c]] = phi
        expected = jp @ torch.linalg.inv(reference) @ jp.mT
        full = s.feature_covariance(phi, rows, cov, False)
        diagonal = s.feature_covariance(phi, rows, cov, True)
        assert torch.allclose(full, expected, rtol=1e-10, atol=1e-12)
        assert torch.allclose(
            diagonal.diagonal(dim1=-2, dim2=-1), expected.diagonal(dim1=-2, dim2=-1), rtol=1e-10
        )

    def test_draws_have_covariance_sigma(self):
        s, _, _, factor, _, reference = self.posterior(LAMBDAS["per_coordinate"])
        sigma = torch.linalg.inv(reference)
        num = 20000
        gen = torch.Generator().manual_seed(7)
        eps = torch.randn(num, K, generator=gen, dtype=torch.float64)
        draws = s.draw(factor, eps)
        assert_close_mc(draws.mean(0), torch.zeros(K), (sigma.diagonal() / num).sqrt(), "mean")
        assert_close_mc(draws.T.cov(), sigma, mc_covariance_se(sigma, num), "covariance")

    def test_distribution_density_and_draws(self):
        s, _, _, factor, _, reference = self.posterior(LAMBDAS["per_coordinate"])
        loc = torch.linspace(-1, 1, K, dtype=torch.float64)
        dist = s.distribution(loc, factor)
        exact = torch.distributions.MultivariateNormal(loc, precision_matrix=reference)
        x = exact.sample((4,))
        assert dist.event_shape == (K,)
        assert torch.allclose(dist.log_prob(x), exact.log_prob(x), rtol=1e-10)
        assert torch.allclose(dist.mean, loc)
        assert float(dist.entropy()) == pytest.approx(float(exact.entropy()), rel=1e-12)
        assert torch.allclose(dist.variance, exact.variance, rtol=1e-10)
        torch.manual_seed(0)
        draws = dist.sample((20000,))
        sigma = torch.linalg.inv(reference)
        assert_close_mc(draws.T.cov(), sigma, mc_covariance_se(sigma, 20000), "covariance")

    # ------------------------------------------------------------------ the curvature

    def test_curvature_is_the_dense_ggn_of_the_subspace(self):
        """``structure.curvature(evaluator, t)`` against ``Σ_n J_nᵀ H_n J_n`` from autograd."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()  # D = 27
        flat = FlatNet(net)
        w0 = flat.vector()
        sub = Subspace(w0, self.curvature_indices)
        k = sub.rank
        lik = likelihoods.Categorical()
        model = SubspaceNet(net, sub, lik)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(8, 2, generator=gen, dtype=torch.float64)
        t = 0.2 * torch.randn(k, generator=gen, dtype=torch.float64)
        ev = model.evaluator(x, torch.zeros(8, dtype=torch.long), chunk_size=3)
        s = self.create_structure(k)
        with eval_mode(net):
            j = torch.autograd.functional.jacobian(lambda tt: flat(sub.weights(tt), x), t)
            h = lik.output_hessian(flat(sub.weights(t), x))
        c = torch.einsum("nok,nop,npj->kj", j, h, j)
        got = self.to_dense(s.curvature(ev, t))
        expected = self.reference_curvature(c)
        assert torch.allclose(
            got, expected, rtol=self.curvature_rtol, atol=self.curvature_rtol * float(c.norm())
        )
