"""`convert.tempered_loo` against the exact leave-one-out predictive densities of a conjugate
tempered posterior (linear-Gaussian: ``p_T(t | y_{−n})`` in closed form), and against
``az.loo`` where the two must agree (``T = 1``)."""

from __future__ import annotations

import arviz as az
import numpy as np
import pytest
from scipy import stats

from pyro_subspace.convert import tempered_loo

N, K, SIGMA, PRIOR, CHAINS, DRAWS = 30, 3, 0.5, 1.0, 4, 5000


def tempered_problem(temperature: float, seed: int = 0):
    """Exact draws ``(C, S, K)`` of the tempered posterior, the untempered pointwise
    log-likelihood ``(C, S, N)`` and the exact LOO log predictive densities ``(N,)``."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, K))
    y = x @ np.array([1.0, -0.5, 0.3]) + SIGMA * rng.standard_normal(N)
    a = 1.0 / (SIGMA**2 * temperature)
    precision = a * x.T @ x + np.eye(K) / PRIOR**2
    cov = np.linalg.inv(precision)
    mean = cov @ (a * x.T @ y)
    t = rng.multivariate_normal(mean, cov, size=(CHAINS, DRAWS))
    ll = stats.norm(t @ x.T, SIGMA).logpdf(y)  # (C, S, N)
    exact = np.empty(N)
    for n in range(N):  # the tempered posterior without y_n, then its predictive for y_n
        p_n = precision - a * np.outer(x[n], x[n])
        c_n = np.linalg.inv(p_n)
        m_n = c_n @ (a * (x.T @ y - x[n] * y[n]))
        exact[n] = stats.norm(x[n] @ m_n, np.sqrt(SIGMA**2 + x[n] @ c_n @ x[n])).logpdf(y[n])
    return t, ll, exact


def importance_se(ll: np.ndarray, temperature: float) -> np.ndarray:
    """Delta-method Monte Carlo standard error of each self-normalised estimate ``(N,)``."""
    ll = ll.reshape(-1, N).T  # (N, S)
    w = np.exp(-ll / temperature - (-ll / temperature).max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    p = np.exp(ll)
    est = (w * p).sum(1)
    return np.sqrt((w**2 * (p - est[:, None]) ** 2).sum(1)) / est


@pytest.mark.parametrize("temperature", [3.0, 10.0])
def test_tempered_loo_matches_the_exact_leave_one_out_densities(temperature):
    t, ll, exact = tempered_problem(temperature)
    data = az.from_dict(posterior={"t": t}, log_likelihood={"obs": ll})
    result = tempered_loo(data, temperature=temperature, reff=1.0)  # independent exact draws
    loo_i = np.asarray(result.loo_i)
    se = importance_se(ll, temperature)
    assert np.all(np.abs(loo_i - exact) <= 4 * se + 1e-3)
    assert result["elpd_loo"] == pytest.approx(exact.sum(), abs=4 * np.sqrt((se**2).sum()) + 0.01)
    assert not result["warning"]
    # az.loo on the tempered export (log p / T) is far from any predictive density
    tempered = az.from_dict(posterior={"t": t}, log_likelihood={"obs": ll / temperature})
    assert abs(az.loo(tempered, reff=1.0)["elpd_loo"] - exact.sum()) > 5.0
    # the tempered export read back by its attributes gives the same result
    tempered.log_likelihood.attrs.update(tempered=1, temperature=temperature)
    again = tempered_loo(tempered, reff=1.0)
    assert again["elpd_loo"] == pytest.approx(result["elpd_loo"], rel=1e-12)
    # az.compare takes it, next to az.loo results
    ranked = az.compare({"a": result, "b": again})
    assert set(ranked.index) == {"a", "b"}


def test_at_temperature_one_it_is_az_loo():
    t, ll, _ = tempered_problem(1.0)
    data = az.from_dict(posterior={"t": t}, log_likelihood={"obs": ll})
    ours, theirs = tempered_loo(data, temperature=1.0), az.loo(data, pointwise=True)
    assert ours["elpd_loo"] == pytest.approx(theirs["elpd_loo"], rel=1e-12)
    assert ours["p_loo"] == pytest.approx(theirs["p_loo"], rel=1e-9)
    np.testing.assert_allclose(np.asarray(ours.pareto_k), np.asarray(theirs.pareto_k))


def test_bad_arguments_are_named():
    t, ll, _ = tempered_problem(1.0)
    data = az.from_dict(posterior={"t": t}, log_likelihood={"obs": ll, "other": ll})
    with pytest.raises(ValueError, match="var_name: the log_likelihood group has"):
        tempered_loo(data, temperature=2.0)
    with pytest.raises(ValueError, match="temperature: not recorded"):
        tempered_loo(data, var_name="obs")
    with pytest.raises(ValueError, match="temperature"):
        tempered_loo(data, temperature=-1.0, var_name="obs")
