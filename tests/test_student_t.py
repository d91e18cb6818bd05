"""The maximum-likelihood multivariate t (ECME) against scipy's density maximised by L-BFGS on
the same draws, ν recovered from draws of a known t within its standard error, the Gaussian
limit in closed form, and the shrunk scale of too few or degenerate states."""

import math

import numpy as np
import pytest
from scipy import optimize, stats

from pyro_subspace.infer.student_t import fit_multivariate_t, multivariate_t_log_density

LOC = np.array([1.0, -2.0, 0.5])
TRIL = np.array([[1.0, 0.0, 0.0], [0.5, 0.8, 0.0], [-0.3, 0.2, 0.4]])


def draws(n, df, seed, loc=LOC, tril=TRIL):
    """``n`` draws of ``t_df(loc, tril trilᵀ)`` by its scale-mixture form."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, loc.shape[0])) @ tril.T
    if math.isinf(df):
        return loc + z
    return loc + z / np.sqrt(rng.chisquare(df, (n, 1)) / df)


def unpack(theta, k, df=None):
    """``(μ, Σ, ν)`` from the unconstrained vector ``(μ, log-Cholesky of Σ, log ν)``."""
    loc = theta[:k]
    rows, cols = np.tril_indices(k)
    tril = np.zeros((k, k))
    tril[rows, cols] = theta[k : k + len(rows)]
    tril[np.diag_indices(k)] = np.exp(np.diag(tril))
    nu = math.exp(theta[-1]) if df is None else df
    return loc, tril @ tril.T, nu


def scipy_loglik(theta, x, df=None):
    loc, scale, nu = unpack(theta, x.shape[1], df)
    return stats.multivariate_t(loc, scale, df=nu).logpdf(x).sum()


def lbfgs_fit(x, df=None):
    """scipy's t log-likelihood maximised by L-BFGS, started from the draws' mean, covariance
    and ν = 10: an optimiser that shares nothing with ECME but the data."""
    k = x.shape[1]
    tril = np.linalg.cholesky(np.cov(x.T))
    tril[np.diag_indices(k)] = np.log(np.diag(tril))
    theta0 = np.concatenate([x.mean(0), tril[np.tril_indices(k)]])
    if df is None:
        theta0 = np.append(theta0, math.log(10.0))
    res = optimize.minimize(
        lambda th: -scipy_loglik(th, x, df) / len(x),
        theta0,
        method="L-BFGS-B",
        options={"ftol": 1e-15, "gtol": 1e-9, "maxiter": 5000},
    )
    assert res.success, res.message
    return res.x, unpack(res.x, k, df), -res.fun * len(x)


@pytest.mark.parametrize("df_true", [4.0, 12.0])
def test_ecme_is_the_maximum_scipy_and_lbfgs_find(df_true):
    x = draws(1500, df_true, seed=1)
    fit = fit_multivariate_t(x, tol=1e-13)
    assert fit.converged
    _, (loc, scale, nu), best = lbfgs_fit(x)
    # the same objective: our density is scipy's
    ours = stats.multivariate_t(fit.loc, fit.scale, df=fit.df).logpdf(x).sum()
    assert fit.log_likelihood == pytest.approx(ours, rel=1e-12)
    # at least as high as L-BFGS's maximum, and the same point to the optimisers' tolerances
    # (L-BFGS stops at a projected gradient of 1e-9 per state; measured: 1e-7 on μ, 4e-6
    # relative on Σ, 1.5e-6 on ν)
    assert fit.log_likelihood >= best - 1e-6
    np.testing.assert_allclose(fit.loc, loc, atol=1e-5)
    np.testing.assert_allclose(fit.scale, scale, rtol=1e-4, atol=1e-5)
    assert fit.df == pytest.approx(nu, rel=1e-4)


def test_fixed_df_is_the_maximum_over_location_and_scale():
    x = draws(800, 3.0, seed=2)
    fit = fit_multivariate_t(x, df=3.0, tol=1e-13)
    assert fit.df == 3.0
    _, (loc, scale, _), best = lbfgs_fit(x, df=3.0)
    assert fit.log_likelihood >= best - 1e-6
    np.testing.assert_allclose(fit.loc, loc, atol=1e-5)
    np.testing.assert_allclose(fit.scale, scale, rtol=1e-4, atol=1e-5)


def test_infinite_df_is_the_gaussian_maximum_likelihood_in_closed_form():
    x = draws(300, math.inf, seed=3)
    fit = fit_multivariate_t(x, df=math.inf)
    np.testing.assert_allclose(fit.loc, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(fit.scale, np.cov(x.T, bias=True), rtol=1e-10)
    gauss = stats.multivariate_normal(x.mean(0), np.cov(x.T, bias=True)).logpdf(x).sum()
    assert fit.log_likelihood == pytest.approx(gauss, rel=1e-12)
    assert multivariate_t_log_density(x, fit.loc, fit.scale, math.inf).sum() == pytest.approx(
        gauss, rel=1e-12
    )


def numerical_hessian(f, theta, step=1e-4):
    k = len(theta)
    h = np.zeros((k, k))
    for i in range(k):
        for j in range(i, k):
            ei, ej = np.eye(k)[i] * step, np.eye(k)[j] * step
            h[i, j] = h[j, i] = (
                f(theta + ei + ej) - f(theta + ei - ej) - f(theta - ei + ej) + f(theta - ei - ej)
            ) / (4 * step**2)
    return h


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_df_is_recovered_within_its_standard_error(seed):
    """ν̂ from 3000 draws of t_6 is within 3 standard errors of 6 (a 99.7 % band; the standard
    error from the observed information, the inverse of scipy's log-likelihood's numerical
    Hessian over all parameters at the optimum, delta method for ν = exp(log ν))."""
    x = draws(3000, 6.0, seed=seed)
    fit = fit_multivariate_t(x, tol=1e-12)
    theta, _, _ = lbfgs_fit(x)
    cov = np.linalg.inv(-numerical_hessian(lambda th: scipy_loglik(th, x), theta))
    se = fit.df * math.sqrt(cov[-1, -1])
    assert 0.1 < se < 2  # an informative estimate (0.32-0.39 for these seeds)
    assert abs(fit.df - 6.0) <= 3 * se, (fit.df, se)


def test_gaussian_draws_give_a_large_or_infinite_df():
    fit = fit_multivariate_t(draws(4000, math.inf, seed=4))
    assert fit.df > 50  # ∞ or a t indistinguishable from the Gaussian


def test_too_few_states_shrink_the_scale_towards_the_fallback():
    fallback = np.diag([2.0, 1.0, 0.5])
    x = draws(2, math.inf, seed=5)  # K = 3: two states span a line, the ML scale is singular
    fit = fit_multivariate_t(x, df=math.inf, fallback=fallback)
    assert fit.shrinkage == 3  # min_states = K + 2 = 5 states, 3 of them pseudo-states
    centred = x - x.mean(0)
    np.testing.assert_allclose(fit.loc, x.mean(0))
    np.testing.assert_allclose(fit.scale, (centred.T @ centred + 3 * fallback) / 5, rtol=1e-12)
    free = fit_multivariate_t(x, fallback=fallback)  # ν fitted too: positive definite
    assert np.linalg.eigvalsh(free.scale).min() > 0
    one = fit_multivariate_t(x[:1], fallback=fallback)
    np.testing.assert_allclose(one.loc, x[0])
    enough = fit_multivariate_t(draws(5, 5.0, seed=6), fallback=fallback)
    assert enough.shrinkage == 0


def test_degenerate_states_never_raise():
    stuck = np.tile(LOC, (20, 1))  # chains stuck at one point: the ML scale is zero
    fit = fit_multivariate_t(stuck, fallback=np.eye(3))
    assert np.linalg.eigvalsh(fit.scale).min() > 0 and fit.shrinkage == 5
    flat = draws(30, 5.0, seed=7)
    flat[:, 2] = flat[:, 0]  # rank 2
    fit = fit_multivariate_t(flat)  # no fallback: isotropic at the states' variance
    assert np.linalg.eigvalsh(fit.scale).min() > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"x": np.full((3, 2), np.nan)}, "x: the states contain NaN"),
        ({"x": np.zeros(3)}, r"x: expected states of shape \(n, K\)"),
        ({"df": 0}, "df: expected None"),
        ({"df": True}, "df: expected None"),
        ({"fallback": np.eye(3)}, r"fallback: expected a finite \(2, 2\)"),
        ({"fallback": -np.eye(2)}, "fallback: the covariance is not positive definite"),
        ({"min_states": 0}, "min_states: expected a positive int"),
        ({"df_bounds": (2.0, 1.0)}, "df_bounds: expected 0 < low < high"),
        ({"max_iter": 0}, "max_iter: expected a positive int"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {"x": draws(10, 5.0, seed=8)[:, :2], **kwargs}
    with pytest.raises(ValueError, match=match):
        fit_multivariate_t(**args)


def test_a_gamma_prior_on_df_gives_its_posterior_mode():
    """``df_prior=(a, b)``: ν maximises the log-likelihood plus log Gamma(ν | a, b), found here by
    L-BFGS on scipy's density plus scipy's gamma log-density; finite also where the maximum
    likelihood is ∞ (few Gaussian states)."""
    x = draws(60, 8.0, seed=9)
    fit = fit_multivariate_t(x, df_prior=(2.0, 0.1), tol=1e-13)
    k = x.shape[1]

    def objective(th):
        return -(scipy_loglik(th, x) + stats.gamma(2.0, scale=10.0).logpdf(math.exp(th[-1])))

    th0 = np.concatenate([fit.loc, np.zeros(k * (k + 1) // 2), [math.log(10.0)]])
    res = optimize.minimize(objective, th0, method="L-BFGS-B", options={"ftol": 1e-15})
    _, _, nu = unpack(res.x, k)
    assert fit.df == pytest.approx(nu, rel=1e-5)  # measured: 6e-7
    few = fit_multivariate_t(draws(6, math.inf, seed=10), df_prior=(2.0, 0.1))
    assert math.isfinite(few.df) and 2 < few.df < 100
    with pytest.raises(ValueError, match=r"df_prior: expected None or \(shape >= 1, rate > 0\)"):
        fit_multivariate_t(x, df_prior=(2.0, 0.0))


def test_pseudo_states_at_a_location_shrink_the_location_too():
    """``fallback_loc``: the fit maximises the log-likelihood plus the Gaussian log-likelihood
    of ``n₀`` pseudo-states with mean μ₀ and scatter Σ₀ (checked with L-BFGS on scipy's
    densities), and with ν = ∞ fixed it is the closed form of pooled data."""
    fallback, loc0 = np.diag([2.0, 1.0, 0.5]), np.array([3.0, 0.0, -1.0])
    x = draws(4, math.inf, seed=11)  # 4 states, min_states 5 + 4 = 9: n₀ = 5
    fit = fit_multivariate_t(x, df=math.inf, fallback=fallback, fallback_loc=loc0, min_states=9)
    n0 = 5
    mean = (x.sum(0) + n0 * loc0) / (4 + n0)
    scatter = (x - mean).T @ (x - mean) + n0 * (fallback + np.outer(loc0 - mean, loc0 - mean))
    np.testing.assert_allclose(fit.loc, mean, rtol=1e-10)
    np.testing.assert_allclose(fit.scale, scatter / (4 + n0), rtol=1e-10)

    x = draws(6, 5.0, seed=12)  # 6 states: n₀ = 3
    fit = fit_multivariate_t(x, fallback=fallback, fallback_loc=loc0, min_states=9, tol=1e-13)
    k, n0 = 3, 3

    def objective(th):  # the t log-likelihood + n₀ log N(μ₀ | μ, Σ) − (n₀/2) tr(Σ⁻¹ Σ₀)
        loc, scale, _ = unpack(th, k, df=5.0)
        pseudo = n0 * stats.multivariate_normal(loc, scale).logpdf(loc0)
        trace = np.trace(np.linalg.solve(scale, fallback))
        return -(scipy_loglik(th, x, df=5.0) + pseudo - 0.5 * n0 * trace)

    fixed = fit_multivariate_t(
        x, df=5.0, fallback=fallback, fallback_loc=loc0, min_states=9, tol=1e-13
    )
    th0 = np.concatenate([x.mean(0), np.zeros(k * (k + 1) // 2)])
    res = optimize.minimize(objective, th0, method="L-BFGS-B", options={"ftol": 1e-15})
    loc, scale, _ = unpack(res.x, k, df=5.0)
    np.testing.assert_allclose(fixed.loc, loc, atol=1e-5)  # measured: 5e-8
    np.testing.assert_allclose(fixed.scale, scale, rtol=1e-4, atol=1e-5)  # measured: 2e-7
    assert np.linalg.norm(fit.loc - loc0) < np.linalg.norm(x.mean(0) - loc0)  # pulled towards
    with pytest.raises(ValueError, match="fallback_loc: needs fallback="):
        fit_multivariate_t(x, fallback_loc=loc0)
