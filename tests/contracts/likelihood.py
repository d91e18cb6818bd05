"""`BaseLikelihoodTestCase`: the contract of `likelihoods.Likelihood` (likelihoods/base.py).

Independent computations: ``torch.autograd.functional.hessian`` of the log-density (or its
expectation over ``y`` by Gauss–Hermite quadrature where the contract promises the Fisher), the
factor's product, the predictive from Gaussian output moments against brute-force Monte Carlo
(exact for regression; the ``"mc"`` link for classification; the probit against its formula),
and the predictive log density against a hand-written density.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import Z_MC, assert_close_mc

N = 7


class BaseLikelihoodTestCase:
    """Subclasses define `create_likelihood` and `num_outputs`."""

    num_outputs: int = 1
    #: the contract promises ``E_y[−∂² log p]`` (the Fisher) rather than ``−∂² log p``.
    hessian_is_expected: bool = False
    #: Monte Carlo draws for the predictive checks.
    num_draws: int = 4000

    def create_likelihood(self):
        raise NotImplementedError

    # ------------------------------------------------------------------ fixtures

    def outputs(self, seed: int = 0, n: int = N) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(n, self.num_outputs, generator=gen, dtype=torch.float64)

    def targets(self, lik, outputs: torch.Tensor, seed: int = 1) -> torch.Tensor:
        """Targets drawn from the likelihood itself (valid by construction)."""
        torch.manual_seed(seed)
        return lik.distribution(outputs).sample()

    def moments(self, seed: int = 2):
        """Output means ``(N, O)`` and SPD covariances ``(N, O, O)``."""
        gen = torch.Generator().manual_seed(seed)
        o = self.num_outputs
        m = torch.randn(N, o, generator=gen, dtype=torch.float64)
        a = torch.randn(N, o, o, generator=gen, dtype=torch.float64)
        return m, a @ a.mT / o + 0.3 * torch.eye(o, dtype=torch.float64)

    # ------------------------------------------------------------------ curvature

    def _autograd_hessian(self, lik, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.autograd.functional.hessian(lambda g: -lik.log_prob(g[None], y).sum(), f)

    def _expected_hessian(self, lik, f: torch.Tensor, nodes: int = 20) -> torch.Tensor:
        """``E_y[−∂² log p(y | f)]`` with ``y = loc + scale·z``, ``z`` on Gauss–Hermite nodes
        (exact: the Hessian is a polynomial of degree 2 in ``y``)."""
        z, wts = np.polynomial.hermite_e.hermegauss(nodes)
        loc, scale = (v.detach() for v in lik.loc_scale(f[None]))
        total = 0
        for zi, wi in zip(z.tolist(), (wts / wts.sum()).tolist()):
            total = total + wi * self._autograd_hessian(lik, f, loc + scale * zi)
        return total

    def test_output_hessian_matches_autograd(self):
        lik = self.create_likelihood()
        out = self.outputs()
        h = lik.output_hessian(out)
        assert h.shape == (N, self.num_outputs, self.num_outputs)
        ys = [self.targets(lik, out, seed) for seed in (1, 2)]  # H must not depend on y
        for n in range(N):
            if self.hessian_is_expected:
                expected = [self._expected_hessian(lik, out[n])]
            else:
                expected = [self._autograd_hessian(lik, out[n], y[n : n + 1]) for y in ys]
            for e in expected:
                assert torch.allclose(h[n], e, rtol=1e-9, atol=1e-12), (n, h[n], e)

    def test_hessian_factor_times_its_transpose_is_the_hessian(self):
        lik = self.create_likelihood()
        out = self.outputs(3) * 2
        f = lik.hessian_factor(out)
        assert torch.allclose(f @ f.mT, lik.output_hessian(out), rtol=1e-12, atol=1e-14)

    def test_output_hessian_sum_is_the_sum_of_the_hessians(self):
        """``Σ_n H_n`` (K-FAC's ``G`` of the output layer) against the per-point Hessians."""
        lik = self.create_likelihood()
        out = self.outputs(4) * 2
        want = lik.output_hessian(out).double().sum(0)
        torch.testing.assert_close(lik.output_hessian_sum(out), want, rtol=1e-10, atol=1e-12)

    def test_log_prob_is_per_point_and_broadcasts_over_draws(self):
        lik = self.create_likelihood()
        out = self.outputs()
        y = self.targets(lik, out)
        draws = torch.stack([out, out + 1.0, out - 0.5])  # (S, N, O)
        lp = lik.log_prob(draws, y)
        assert lp.shape == (3, N)
        for s in range(3):
            for n in range(N):
                one = lik.log_prob(draws[s, n : n + 1], y[n : n + 1])
                assert torch.allclose(lp[s, n], one[0], rtol=1e-12)

    def test_training_loss_and_prepared_log_prob_are_the_log_density(self):
        """`training_loss` (fit_map's fast kernel) is ``−mean log p`` and `log_prob_prepared`
        is `log_prob`, against the distribution's own ``log_prob`` (float64)."""
        lik = self.create_likelihood()
        out = self.outputs().requires_grad_(True)
        y = self.targets(lik, out.detach())
        prepared = lik.validate(out, y)
        density = lik.distribution(out).log_prob(prepared)
        density = density.sum(-1) if density.dim() > 1 else density
        torch.testing.assert_close(lik.log_prob_prepared(out, prepared), density, rtol=1e-12, atol=0)
        loss = lik.training_loss(out, prepared)
        torch.testing.assert_close(loss, -density.mean(), rtol=1e-12, atol=1e-14)
        (g1,) = torch.autograd.grad(loss, out)
        (g2,) = torch.autograd.grad(-density.mean(), out)
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-14)

    # ------------------------------------------------------------------ predictives

    def _brute_force_draws(self, m, c, seed=11):
        """``f ~ N(m, C)``, ``(S, N, O)``, by an eigendecomposition (not the library's Cholesky)."""
        e, v = torch.linalg.eigh(c)
        root = v * e.clamp_min(0).sqrt()[:, None, :]
        gen = torch.Generator().manual_seed(seed)
        eps = torch.randn(self.num_draws, *m.shape, generator=gen, dtype=torch.float64)
        return m + torch.einsum("nop,snp->sno", root, eps)

    def test_predictive_from_moments_against_monte_carlo(self):
        lik = self.create_likelihood()
        m, c = self.moments()
        f = self._brute_force_draws(m, c)
        if lik.is_regression:
            self._check_regression_predictive(lik, m, c, f)
        else:
            self._check_classification_predictive(lik, m, c, f)

    def _check_regression_predictive(self, lik, m, c, f):
        pred = lik.predictive_from_moments(m, c, "closed_form")
        torch.manual_seed(5)
        y = lik.distribution(f).sample()  # y ~ ∫ p(y | f) N(f | m, C) df, exactly
        y = y.reshape(self.num_draws, N, -1)
        mean, var = pred.mean.reshape(N, -1), pred.variance.reshape(N, -1)
        s = self.num_draws
        assert_close_mc(y.mean(0), mean, (var / s).sqrt(), "predictive mean")
        assert_close_mc(y.var(0), var, var * math.sqrt(2 / (s - 1)), "predictive variance")
        noiseless = lik.predictive_from_moments(m, c, "closed_form", include_noise=False)
        assert torch.allclose(
            noiseless.variance.reshape(N, -1),
            f.var(0)[:, : mean.shape[1]],
            rtol=Z_MC * math.sqrt(2 / s),
        )

    def _check_classification_predictive(self, lik, m, c, f):
        s = self.num_draws
        probs = f.softmax(-1) if self.num_outputs > 1 else f.squeeze(-1).sigmoid()
        gen = torch.Generator().manual_seed(3)
        mc = lik.predictive_from_moments(m, c, "mc", num_samples=s, generator=gen).probs
        se = probs.std(0) * math.sqrt(2 / s)  # two independent Monte Carlo means
        assert_close_mc(mc, probs.mean(0), se, "mc predictive")
        kappa = (1 + math.pi / 8 * c.diagonal(dim1=-2, dim2=-1)).rsqrt()
        scaled = m * kappa
        expected = scaled.softmax(-1) if self.num_outputs > 1 else scaled.squeeze(-1).sigmoid()
        probit = lik.predictive_from_moments(m, c, "probit").probs
        assert torch.allclose(probit, expected, rtol=1e-12)
        assert torch.equal(lik.predictive_from_moments(m, c, "auto").probs, probit)

    def test_predictive_from_samples_is_the_likelihood_of_each_draw(self):
        lik = self.create_likelihood()
        draws = torch.stack([self.outputs(4), self.outputs(5)])  # (2, N, O)
        pred = lik.predictive_from_samples(draws)
        assert pred.mean.dtype == torch.float64
        expected = lik.distribution(draws)
        if lik.is_regression:
            assert torch.allclose(pred.mean.reshape(expected.mean.shape), expected.mean)
            assert torch.allclose(pred.stddev.reshape(expected.stddev.shape), expected.stddev)
        else:
            assert torch.allclose(pred.probs, expected.probs, rtol=1e-12)

    def test_predictive_log_prob_against_the_density(self):
        lik = self.create_likelihood()
        m, c = self.moments()
        pred = lik.predictive_from_moments(m, c)
        y = self.targets(lik, m)
        got = lik.predictive_log_prob(pred, y)
        assert got.shape == (N,)
        if lik.is_regression:
            mean, var = pred.mean.reshape(N, -1), pred.variance.reshape(N, -1)
            yy = y.reshape(N, -1)[:, : mean.shape[1]].double()
            expected = (-0.5 * (2 * math.pi * var).log() - (yy - mean) ** 2 / (2 * var)).sum(-1)
        elif self.num_outputs > 1:
            expected = pred.probs[torch.arange(N), y.long()].log()
        else:
            p = pred.probs
            expected = torch.where(y.bool(), p, 1 - p).log()
        assert torch.allclose(got, expected, rtol=1e-12)
