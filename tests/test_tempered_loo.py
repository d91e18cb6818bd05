"""`convert.tempered_loo` against the exact leave-one-out predictive densities of a conjugate
tempered posterior (linear-Gaussian: ``p_T(t | y_{−n})`` in closed form), and against
``az.loo`` where the two must agree (``T = 1``); through both PSIS engines: arviz 0.x
(``az.psislw``) and ArviZ 1.x's ``arviz_stats``, which install side by side."""

from __future__ import annotations

import importlib.util
import sys

import arviz as az
import numpy as np
import pytest
from scipy import stats

from pyro_subspace import convert
from pyro_subspace.convert import tempered_loo

N, K, SIGMA, PRIOR, CHAINS, DRAWS = 30, 3, 0.5, 1.0, 4, 5000
ARVIZ0 = int(az.__version__.split(".")[0]) < 1
HAS_ARVIZ_STATS = importlib.util.find_spec("arviz_stats") is not None
HAS_ARVIZ_BASE = importlib.util.find_spec("arviz_base") is not None


@pytest.fixture(params=["arviz", "arviz_stats"])
def engine(request):
    if request.param == "arviz" and not ARVIZ0:
        pytest.skip(f"arviz 0.x is not installed (arviz {az.__version__})")
    if request.param == "arviz_stats" and not HAS_ARVIZ_STATS:
        pytest.skip("arviz_stats is not installed (pip install arviz-stats)")
    return request.param


def from_dict(engine: str, **groups):
    """The engine's own data type: arviz 0.x ``InferenceData`` or arviz-base ``DataTree``."""
    if engine == "arviz" or not HAS_ARVIZ_BASE:
        return az.from_dict(**groups)
    import arviz_base

    return arviz_base.from_dict(groups)


def az_loo(engine: str, data, **kwargs):
    if engine == "arviz":
        return az.loo(data, **kwargs)
    import arviz_stats

    return arviz_stats.loo(data, **kwargs)


def compare(engine: str, results):
    if engine == "arviz":
        return az.compare(results)
    import arviz_stats

    return arviz_stats.compare(results)


def field(result, name: str):
    """``elpd``, ``p``, ``se``, ``warning``, ``pointwise`` or ``pareto_k`` of either result type."""
    arviz0 = {"elpd": "elpd_loo", "p": "p_loo", "pointwise": "loo_i"}
    stats_ = {"pointwise": "elpd_i"}
    is_arviz0 = type(result).__module__.startswith("arviz.")
    value = getattr(result, (arviz0 if is_arviz0 else stats_).get(name, name))
    return np.asarray(value) if name in ("pointwise", "pareto_k") else value


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
def test_tempered_loo_matches_the_exact_leave_one_out_densities(temperature, engine):
    t, ll, exact = tempered_problem(temperature)
    data = from_dict(engine, posterior={"t": t}, log_likelihood={"obs": ll})
    result = tempered_loo(data, temperature=temperature, reff=1.0, engine=engine)  # exact draws
    loo_i = field(result, "pointwise")
    se = importance_se(ll, temperature)
    assert np.all(np.abs(loo_i - exact) <= 4 * se + 1e-3)
    assert field(result, "elpd") == pytest.approx(
        exact.sum(), abs=4 * np.sqrt((se**2).sum()) + 0.01
    )
    assert not field(result, "warning")
    # az.loo on the tempered export (log p / T) is far from any predictive density
    tempered = from_dict(engine, posterior={"t": t}, log_likelihood={"obs": ll / temperature})
    assert abs(field(az_loo(engine, tempered, reff=1.0), "elpd") - exact.sum()) > 5.0
    # the tempered export read back by its attributes gives the same result
    tempered["log_likelihood"].attrs.update(tempered=1, temperature=temperature)
    again = tempered_loo(tempered, reff=1.0, engine=engine)
    assert field(again, "elpd") == pytest.approx(field(result, "elpd"), rel=1e-12)
    # the engine's compare takes it, next to its own loo results
    ranked = compare(engine, {"a": result, "b": again})
    assert set(ranked.index) == {"a", "b"}


def test_at_temperature_one_it_is_az_loo(engine):
    t, ll, _ = tempered_problem(1.0)
    data = from_dict(engine, posterior={"t": t}, log_likelihood={"obs": ll})
    ours = tempered_loo(data, temperature=1.0, engine=engine)
    theirs = az_loo(engine, data, pointwise=True)
    assert field(ours, "elpd") == pytest.approx(field(theirs, "elpd"), rel=1e-12)
    assert field(ours, "p") == pytest.approx(field(theirs, "p"), rel=1e-9)
    np.testing.assert_allclose(field(ours, "pareto_k"), field(theirs, "pareto_k"))


@pytest.mark.skipif(
    not (ARVIZ0 and HAS_ARVIZ_STATS and HAS_ARVIZ_BASE),
    reason="needs arviz 0.x, arviz_stats and arviz_base side by side",
)
def test_both_engines_and_both_data_types_agree():
    import arviz_base

    temperature = 3.0
    t, ll, exact = tempered_problem(temperature)
    groups = {"posterior": {"t": t}, "log_likelihood": {"obs": ll}}
    idata, tree = az.from_dict(**groups), arviz_base.from_dict(groups)
    results = {
        (kind, engine): tempered_loo(data, temperature=temperature, engine=engine)
        for kind, data in (("InferenceData", idata), ("DataTree", tree))
        for engine in ("arviz", "arviz_stats")
    }
    assert type(results["InferenceData", "arviz"]).__module__.startswith("arviz.")
    assert type(results["DataTree", "arviz_stats"]).__module__.startswith("arviz_stats")
    default = tempered_loo(tree, temperature=temperature)  # arviz 0.x when installed
    assert type(default) is type(results["InferenceData", "arviz"])
    reference = field(results["InferenceData", "arviz"], "elpd")
    for result in results.values():  # only the PSIS implementations differ
        assert field(result, "elpd") == pytest.approx(reference, abs=1e-4)
        np.testing.assert_allclose(
            field(result, "pointwise"), field(results["InferenceData", "arviz"], "pointwise"),
            atol=1e-4,
        )  # fmt: skip
    assert reference == pytest.approx(exact.sum(), abs=0.05)


def test_bad_arguments_are_named(engine):
    t, ll, _ = tempered_problem(1.0)
    data = from_dict(engine, posterior={"t": t}, log_likelihood={"obs": ll, "other": ll})
    with pytest.raises(ValueError, match="var_name: the log_likelihood group has"):
        tempered_loo(data, temperature=2.0, engine=engine)
    with pytest.raises(ValueError, match="temperature: not recorded"):
        tempered_loo(data, var_name="obs", engine=engine)
    with pytest.raises(ValueError, match="temperature"):
        tempered_loo(data, temperature=-1.0, var_name="obs", engine=engine)
    with pytest.raises(ValueError, match="engine: expected None, 'arviz' or 'arviz_stats'"):
        tempered_loo(data, temperature=2.0, var_name="obs", engine="pymc")


def test_without_an_engine_the_import_error_names_both(monkeypatch):
    class Arviz1:  # arviz >= 1 has no az.psislw
        __version__ = "1.0.0"

    monkeypatch.setattr(convert, "az", Arviz1)
    monkeypatch.setitem(sys.modules, "arviz_stats", None)  # `import arviz_stats` fails
    with pytest.raises(ImportError, match="arviz 0.x .* arviz_stats"):
        tempered_loo(object(), temperature=2.0)
    with pytest.raises(ImportError, match="engine='arviz' needs arviz 0.x"):
        tempered_loo(object(), temperature=2.0, engine="arviz")
    with pytest.raises(ImportError, match="arviz_stats"):
        tempered_loo(object(), temperature=2.0, engine="arviz_stats")
