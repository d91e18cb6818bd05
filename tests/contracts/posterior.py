"""`BasePosteriorTestCase`: the contract of a `Posterior` (infer/laplace/posteriors/).

A posterior represents ``Σ⁻¹ = C̃/T + Λ₀`` where ``C̃`` is its approximation of the subspace GGN
``C = PᵀGP`` (``C`` itself, its diagonal, its top-``k`` eigenpairs, Kronecker factors) and
``Λ₀`` the prior as it represents it (``λ PᵀP`` for the full structure, its diagonal for the
others). Subclasses say how to build one (`create_posterior`), what ``C̃`` is as a dense matrix
(`reference_curvature`) and whether the prior is kept dense (`keeps_dense_prior`); every method
of the contract is then checked against dense linear algebra (``torch.linalg.inv``,
``torch.logdet``, ``J Σ Jᵀ`` by ``einsum``), autograd (the evidence's gradient), Monte Carlo
(draws within their standard error) and a ``state_dict`` round trip.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pyro_subspace import FlatNet, SubspaceNet, likelihoods
from pyro_subspace.flat import eval_mode
from pyro_subspace.infer.laplace.posteriors import POSTERIORS, Posterior, PriorPrecision
from pyro_subspace.subspaces import Subspace

from . import assert_close_mc, mc_covariance_se

K = 6
TEMPERATURE = 2.0


def random_ggn(seed: int = 0, rank: int = 4) -> torch.Tensor:
    """A positive semi-definite ``(K, K)`` of rank ``rank`` with distinct eigenvalues."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(K, rank, generator=gen, dtype=torch.float64)
    return a @ a.T


def _gram() -> torch.Tensor:
    """A dense positive definite ``PᵀP`` (``prior_mean="zero"`` on a dense basis)."""
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(K, K, generator=gen, dtype=torch.float64)
    return a @ a.T / K + torch.eye(K, dtype=torch.float64)


#: a ``λ`` per coordinate (a posterior with blocks that need one ``λ`` each overrides it)
PER_COORDINATE = (0.5, 1.0, 2.0, 0.3, 0.9, 1.5)


def assert_fit_statistics(stats, outputs: torch.Tensor, y: torch.Tensor) -> None:
    """What `Posterior.fit_curvature` returns: ``None``, or the Categorical evidence's
    statistics of its own pass, ``(Σ_n log softmax(f_n)_{y_n}, 0, 0)``."""
    if stats is not None:
        loglik = float(torch.log_softmax(outputs, -1)[torch.arange(y.shape[0]), y].sum())
        assert stats[0] == pytest.approx(loglik, rel=1e-12) and tuple(stats[1:]) == (0, 0)


class DenseEvaluator:
    """What `Posterior.fit_curvature` reads from an `Evaluator`, for a given dense ``C``."""

    def __init__(self, c: torch.Tensor, temperature: float = TEMPERATURE) -> None:
        self.c, self.temperature = c, temperature
        self.model = SimpleNamespace(subspace=SimpleNamespace(rank=c.shape[0]))

    def ggn(self, t, diagonal: bool = False, dtype=torch.float64, rows=None, **kwargs):
        c = self.c.to(dtype)
        return c.diagonal().clone() if diagonal else c.clone()


class BasePosteriorTestCase:
    """Subclasses define `create_posterior`, `reference_curvature` and `keeps_dense_prior`."""

    #: tolerance of the posterior's own curvature against the dense GGN (Lanczos: ~1e-6).
    curvature_rtol: float = 1e-10
    #: the coordinates (flat indices of a 27-weight net) of `test_curvature_...`.
    curvature_indices = torch.tensor([0, 3, 8, 10, 15, 20])
    #: the full structure keeps ``λ PᵀP``; the others its diagonal
    keeps_dense_prior: bool = False
    #: the ``λ`` of the sweep test (a float32 posterior leaves out the ill-conditioned 0.01)
    sweep_lambdas: tuple[float, ...] = (0.01, 1.0, 30.0)
    #: the per-coordinate ``λ`` of the tests
    per_coordinate: tuple[float, ...] = PER_COORDINATE

    def prior(self, kind: str) -> PriorPrecision:
        """``"scalar"`` (0.7), ``"per_coordinate"`` or ``"dense_gram"`` (``0.7 PᵀP``)."""
        lam = torch.tensor(0.7, dtype=torch.float64)
        if kind == "per_coordinate":
            return PriorPrecision(torch.tensor(self.per_coordinate, dtype=torch.float64), None, K)
        return PriorPrecision(lam, _gram() if kind == "dense_gram" else None, K)

    def create_posterior(self, k: int) -> Posterior:
        raise NotImplementedError

    def reference_curvature(self, c: torch.Tensor) -> torch.Tensor:
        """``C̃`` ``(K, K)``: what the posterior keeps of ``c``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ fixtures

    def fit_posterior(self, post: Posterior, seed: int = 0) -> torch.Tensor:
        """Fit ``post``'s curvature (at temperature `TEMPERATURE`); returns the ``C̃`` ``(K, K)``
        it keeps. By default from `random_ggn` through `DenseEvaluator`."""
        c = random_ggn(seed)
        post.fit_curvature(DenseEvaluator(c), torch.zeros(K, dtype=torch.float64))
        return self.reference_curvature(c)

    def fitted(self, prior: PriorPrecision, seed: int = 0) -> tuple[Posterior, torch.Tensor]:
        """A posterior fitted by `fit_posterior` with ``Σ`` formed for ``prior``, and the dense
        reference precision ``C̃/T + Λ₀``."""
        post = self.create_posterior(K)
        curvature = self.fit_posterior(post, seed)
        post.set_prior(prior)
        lam0 = prior.matrix() if self.keeps_dense_prior else torch.diag(prior.diagonal())
        return post, curvature / TEMPERATURE + lam0

    # ------------------------------------------------------------------ the posterior

    def test_is_a_posterior_module_named_by_its_structure(self):
        post = self.create_posterior(K)
        assert isinstance(post, Posterior) and isinstance(post, nn.Module)
        assert POSTERIORS[post.name] is type(post)

    @pytest.mark.parametrize("prior", ["scalar", "per_coordinate", "dense_gram"])
    def test_precision_covariance_and_factor_against_dense_inverse(self, prior):
        post, reference = self.fitted(self.prior(prior))
        sigma = torch.linalg.inv(reference)
        torch.testing.assert_close(post.precision().double(), reference, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(post.covariance().double(), sigma, rtol=1e-10, atol=1e-12)
        lower = post.cholesky().double()
        assert torch.equal(lower, lower.tril())
        torch.testing.assert_close(lower @ lower.T, sigma, rtol=1e-10, atol=1e-12)
        f = post.draw(torch.eye(K, dtype=torch.float64)).double().T  # F from F eᵢ
        torch.testing.assert_close(f @ f.T, sigma, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(post.marginal_variance(), sigma.diagonal(), rtol=1e-10, atol=0)

    @pytest.mark.parametrize("prior", ["scalar", "per_coordinate", "dense_gram"])
    def test_log_det_and_prior_terms_against_dense(self, prior):
        p = self.prior(prior)
        post, reference = self.fitted(p)
        eff = post.effective_prior(p)
        lam0 = p.matrix() if self.keeps_dense_prior else torch.diag(p.diagonal())
        d = torch.linspace(-1, 2, K, dtype=torch.float64)
        assert float(post.log_det(eff)) == pytest.approx(float(torch.logdet(reference)), rel=1e-11)
        scaled = reference - lam0  # C̃/T: at half the curvature
        half = float(torch.logdet(scaled / 2 + lam0))
        assert float(post.log_det(eff, 0.5)) == pytest.approx(half, rel=1e-11)
        assert float(eff.log_det()) == pytest.approx(float(torch.logdet(lam0)), rel=1e-12)
        assert float(eff.quad(d)) == pytest.approx(float(d @ lam0 @ d), rel=1e-12)

    @pytest.mark.parametrize("prior", ["scalar", "per_coordinate"])
    def test_log_det_is_differentiable_in_the_prior_precision_and_the_scale(self, prior):
        """The evidence is maximised over ``λ`` (and ``σ``) by autograd: ``∂/∂λ_i log|Σ⁻¹| =
        Σ_ii`` (per coordinate; the trace for a shared ``λ``), ``∂/∂s = tr(Σ C̃/T)``."""
        p = self.prior(prior)
        post, reference = self.fitted(p)
        lam = p.lam.clone().requires_grad_(True)
        scale = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        value = post.log_det(post.effective_prior(p.with_lam(lam)), scale)
        g_lam, g_scale = torch.autograd.grad(value, (lam, scale))
        sigma = torch.linalg.inv(reference)
        want = sigma.diagonal() if lam.dim() == 1 else sigma.trace()
        torch.testing.assert_close(g_lam, want, rtol=1e-10, atol=0)
        curv = reference - torch.diag(p.diagonal())
        assert float(g_scale) == pytest.approx(float((sigma @ curv).trace()), rel=1e-10)

    def test_functional_covariance_and_variance_are_j_sigma_jt(self):
        post, reference = self.fitted(self.prior("scalar"))
        gen = torch.Generator().manual_seed(1)
        jp = torch.randn(5, 3, K, generator=gen, dtype=torch.float64)
        expected = jp @ torch.linalg.inv(reference) @ jp.mT
        got = post.functional_covariance(jp.clone()).double()
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
        var = post.functional_variance(jp.clone()).double()
        torch.testing.assert_close(var, expected.diagonal(dim1=-2, dim2=-1), rtol=1e-10, atol=1e-12)

    def test_feature_covariance_is_j_sigma_jt_of_a_last_layer(self):
        """Features ``φ̃`` ``(n, 3)`` and ``rows`` ``(2, 3)``: ``J[n, c, rows[c, p]] = φ̃[n, p]``."""
        post, reference = self.fitted(self.prior("per_coordinate"))
        phi = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        rows = torch.tensor([[4, 0, 2], [1, 5, 3]])
        jp = torch.zeros(4, 2, K, dtype=torch.float64)
        for c in range(2):
            jp[:, c, rows[c]] = phi
        expected = jp @ torch.linalg.inv(reference) @ jp.mT
        full = post.feature_covariance(phi, rows, False).double()
        diagonal = post.feature_covariance(phi, rows, True).double()
        torch.testing.assert_close(full, expected, rtol=1e-10, atol=1e-12)
        assert diagonal.shape == (4, 2)  # the variances only: no (n, C, C) array
        torch.testing.assert_close(
            diagonal, expected.diagonal(dim1=-2, dim2=-1), rtol=1e-10, atol=1e-12
        )

    def test_newton_decrement_is_the_mahalanobis_norm(self):
        post, reference = self.fitted(self.prior("per_coordinate"))
        g = torch.linspace(-1, 1, K, dtype=torch.float64)
        want = float(g @ torch.linalg.solve(reference, g)) ** 0.5
        assert post.newton_decrement(g) == pytest.approx(want, rel=1e-9)

    # ------------------------------------------------------------------ draws

    def test_draws_have_covariance_sigma_and_leave_the_global_generator_alone(self):
        post, reference = self.fitted(self.prior("per_coordinate"))
        sigma = torch.linalg.inv(reference)
        num = 20000
        state = torch.get_rng_state()
        draws = post.sample(num, torch.Generator().manual_seed(7))
        assert torch.equal(torch.get_rng_state(), state)
        assert draws.shape == (num, K) and draws.dtype == torch.float64
        assert_close_mc(draws.mean(0), torch.zeros(K), (sigma.diagonal() / num).sqrt(), "mean")
        assert_close_mc(draws.T.cov(), sigma, mc_covariance_se(sigma, num), "covariance")
        again = post.sample(num, torch.Generator().manual_seed(7))
        assert torch.equal(draws, again)

    def test_distribution_density_and_draws(self):
        post, reference = self.fitted(self.prior("per_coordinate"))
        loc = torch.linspace(-1, 1, K, dtype=torch.float64)
        dist = post.distribution(loc)
        exact = torch.distributions.MultivariateNormal(loc, precision_matrix=reference)
        x = exact.sample((4,))
        assert dist.event_shape == (K,)
        torch.testing.assert_close(dist.log_prob(x), exact.log_prob(x), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(dist.mean, loc)
        assert float(dist.entropy()) == pytest.approx(float(exact.entropy()), rel=1e-10)
        torch.testing.assert_close(dist.variance, exact.variance, rtol=1e-10, atol=1e-12)
        torch.manual_seed(0)
        draws = dist.sample((20000,))
        sigma = torch.linalg.inv(reference)
        assert_close_mc(draws.T.cov(), sigma, mc_covariance_se(sigma, 20000), "covariance")

    # ------------------------------------------------------------------ re-tuning

    def test_at_prior_leaves_it_alone_and_equals_set_prior(self):
        post, _ = self.fitted(self.prior("scalar"))
        before = post.covariance().clone()
        other_prior = self.prior("per_coordinate")
        other = post.at_prior(other_prior)
        assert torch.equal(post.covariance(), before)
        _, reference = self.fitted(other_prior)
        torch.testing.assert_close(
            other.covariance().double(), torch.linalg.inv(reference), rtol=1e-10, atol=1e-12
        )

    def test_the_sweep_over_lambda_equals_a_posterior_per_lambda(self):
        post, _ = self.fitted(self.prior("scalar"))
        gen = torch.Generator().manual_seed(3)
        blocks = [torch.randn(n, 2, K, generator=gen, dtype=torch.float64) for n in (3, 4)]
        base = self.prior("scalar")
        f_cov = post.functional_covariance_on_grid(blocks, base.with_lam)
        jp = torch.cat(blocks)
        for lam in self.sweep_lambdas:
            _, reference = self.fitted(base.with_lam(torch.tensor(lam, dtype=torch.float64)))
            want = jp @ torch.linalg.inv(reference) @ jp.mT
            got = f_cov(torch.tensor(lam, dtype=torch.float64))
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)

    def test_scaled_curvature_is_the_posterior_of_the_scaled_ggn(self):
        """A new noise scale ``σ`` multiplies the GGN by ``(σ₀/σ)²`` (`set_sigma`)."""
        prior = self.prior("per_coordinate")
        post, reference = self.fitted(prior)
        lam0 = torch.diag(prior.diagonal())
        post.scale_curvature_(0.3)
        post.set_prior(prior)
        want = torch.linalg.inv(0.3 * (reference - lam0) + lam0)
        torch.testing.assert_close(post.covariance().double(), want, rtol=1e-9, atol=1e-12)

    def test_apply_covariance_and_precision_are_the_matrix_products(self):
        post, reference = self.fitted(self.prior("per_coordinate"))
        v = torch.randn(3, K, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        torch.testing.assert_close(post.apply_precision(v), v @ reference, rtol=1e-10, atol=1e-12)
        sigma = torch.linalg.inv(reference)
        torch.testing.assert_close(post.apply_covariance(v), v @ sigma, rtol=1e-9, atol=1e-12)

    def test_module_conversions_keep_the_posterior(self):
        """``.to``/``.cpu``/``.double`` (what moving a guide does) go through ``nn.Module``'s
        own machinery: nothing in a posterior may shadow it."""
        post, _ = self.fitted(self.prior("per_coordinate"))
        before = post.covariance().clone()
        moved = post.cpu().to(torch.device("cpu"))
        assert moved is post
        torch.testing.assert_close(post.covariance(), before, rtol=0, atol=0)

    # ------------------------------------------------------------------ persistence

    def test_state_dict_round_trip(self):
        post, _ = self.fitted(self.prior("per_coordinate"))
        state = copy.deepcopy(post.state_dict())
        fresh = self.create_posterior(K)
        fresh.load_state_dict(state)
        for value in state.values():  # nothing of the state is kept by reference
            if isinstance(value, torch.Tensor) and value.is_floating_point() and 0 not in value.stride():
                value.fill_(float("nan"))
        for method in ("covariance", "precision", "curvature", "marginal_variance"):
            assert torch.equal(getattr(fresh, method)(), getattr(post, method)()), method
        gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
        assert torch.equal(fresh.sample(3, gen()), post.sample(3, gen()))
        p = post.effective_prior(self.prior("per_coordinate"))
        assert float(fresh.log_det(p)) == float(post.log_det(p))

    # ------------------------------------------------------------------ the curvature

    def test_curvature_is_the_dense_ggn_of_the_subspace(self):
        """``fit_curvature(evaluator, t)`` against ``Σ_n J_nᵀ H_n J_n`` from autograd."""
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
        y = torch.randint(3, (8,), generator=gen)
        ev = model.evaluator(x, y, chunk_size=3)
        post = self.create_posterior(k)
        stats = post.fit_curvature(ev, t)
        with eval_mode(net):
            j = torch.autograd.functional.jacobian(lambda tt: flat(sub.weights(tt), x), t)
            f = flat(sub.weights(t), x)
            h = lik.output_hessian(f)
        assert_fit_statistics(stats, f, y)
        c = torch.einsum("nok,nop,npj->kj", j, h, j)
        expected = self.reference_curvature(c)
        tol = self.curvature_rtol
        torch.testing.assert_close(
            post.curvature().double(), expected, rtol=tol, atol=tol * float(c.norm())
        )
        assert float(post.temperature) == ev.temperature
