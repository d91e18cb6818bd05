import arviz as az
import numpy as np
import pytest
import torch
from pyro.infer import MCMC, NUTS
from torch import nn

from pyro_subspace import SubspaceNet, convert, likelihoods, subspaces

# the fixture's model has T = 2: every export warns that az.loo on it is not the tempered LOO
# (test_at_t_not_one_one_warning_names_tempered_loo checks it); the other tests need not see it
pytestmark = pytest.mark.filterwarnings(
    "ignore:to_inference_data. az.loo on this export is not the tempered LOO:UserWarning"
)


@pytest.fixture(scope="module")
def fitted():
    import pyro

    pyro.set_rng_seed(0)
    torch.manual_seed(0)
    x = torch.randn(40, 2)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(40)
    net = nn.Sequential(nn.Linear(2, 10), nn.Tanh(), nn.Linear(10, 1))
    model = SubspaceNet(
        net, subspaces.random(net, 3, seed=0), likelihoods.Gaussian(0.3), temperature=2.0
    )
    mcmc = MCMC(NUTS(model), num_samples=60, warmup_steps=40, num_chains=2, disable_progbar=True)
    mcmc.run(x, y)
    return model, mcmc, x, y


def test_mcmc_export_has_all_groups_and_passes_arviz(fitted):
    _, mcmc, _, y = fitted
    idata = convert.to_inference_data(mcmc, seed=0)
    assert idata.posterior["t"].shape == (2, 60, 3)
    assert idata.log_likelihood["obs"].shape == (2, 60, 40)
    assert idata.posterior_predictive["obs"].shape == (2, 60, 40)
    np.testing.assert_allclose(idata.observed_data["obs"].values, y.numpy())
    assert idata.sample_stats["diverging"].shape == (2, 60)
    summary = az.summary(idata, var_names=["t"])
    assert np.isfinite(summary["r_hat"]).all() and (summary["ess_bulk"] > 0).all()
    assert np.isfinite(az.rhat(idata)["t"].values).all()
    loo = az.loo(idata)
    # elpd_loo is a sum of per-point terms, bounded above by the log pointwise predictive density.
    ll = idata.log_likelihood["obs"].values.reshape(120, 40)
    lppd = (np.logaddexp.reduce(ll, axis=0) - np.log(120)).sum()
    assert np.isfinite(loo.elpd_loo) and loo.elpd_loo <= lppd + 1e-6


def _direct_gaussian_loglik(net, t, sub, x, y, sigma):
    """log N(y_n | net(x_n; ŵ + P t), σ²) draw by draw with the module itself (no FlatNet)."""
    out = torch.empty(*t.shape[:-1], x.shape[0], dtype=torch.float64)
    for idx in np.ndindex(*t.shape[:-1]):
        nn.utils.vector_to_parameters(sub.shift + sub.dense_basis() @ t[idx], net.parameters())
        with torch.no_grad():
            f = net(x)[:, 0].double()
        out[idx] = -0.5 * ((y.double() - f) / sigma) ** 2 - np.log(sigma) - 0.5 * np.log(2 * np.pi)
    return out


def test_pointwise_log_likelihood_is_tempered_and_matches_a_direct_computation(fitted):
    model, mcmc, x, y = fitted
    idata = convert.to_inference_data(mcmc, draws_per_chunk=7)  # chunks that split chains
    t = mcmc.get_samples(group_by_chain=True)["t"]  # (2, 60, 3)
    net = nn.Sequential(nn.Linear(2, 10), nn.Tanh(), nn.Linear(10, 1))
    direct = _direct_gaussian_loglik(net, t, model.subspace, x, y, 0.3)  # (2, 60, 40)
    # the posterior is p(t) prod_n p(y_n | t)^(1/T), T = 2: the matching pointwise term is ll/2
    np.testing.assert_allclose(idata.log_likelihood["obs"].values, direct.numpy() / 2.0, atol=1e-4)
    assert idata.log_likelihood.attrs["log_likelihood"].startswith("tempered")
    assert "T = 2" in idata.log_likelihood.attrs["log_likelihood"]
    with pytest.warns(UserWarning, match="untempered"):
        raw = convert.to_inference_data(mcmc, log_likelihood="untempered")
    np.testing.assert_allclose(raw.log_likelihood["obs"].values, direct.numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="log_likelihood: expected"):
        convert.to_inference_data(mcmc, log_likelihood="scaled")
    # lp is the joint the sampler targets: log prior + tempered log-likelihood (T = 2).
    prior = model.prior().log_prob(t).double()
    np.testing.assert_allclose(
        idata.sample_stats["lp"].values, (prior + direct.sum(-1) / 2.0).numpy(), rtol=1e-4
    )


def test_arviz_from_pyro_then_loo_works_and_our_loo_uses_the_tempered_term(fitted):
    """az.from_pyro (arviz 0.x) sees one observed site, 'obs', so az.loo runs; our export's
    LOO equals PSIS-LOO computed by arviz on an independently recomputed ll / T."""
    model, mcmc, x, y = fitted
    if not hasattr(az, "from_pyro"):  # arviz 1.x has no Pyro converter
        pytest.skip("arviz >= 1 has no from_pyro")
    idata = az.from_pyro(mcmc)
    assert list(idata.log_likelihood.data_vars) == ["obs"]
    loo = az.loo(idata)
    assert np.isfinite(loo.elpd_loo)
    ours = az.loo(convert.to_inference_data(mcmc))
    t = mcmc.get_samples(group_by_chain=True)["t"]
    net = nn.Sequential(nn.Linear(2, 10), nn.Tanh(), nn.Linear(10, 1))
    direct = _direct_gaussian_loglik(net, t, model.subspace, x, y, 0.3).numpy() / 2.0
    ref = az.loo(az.from_dict(posterior={"t": t.numpy()}, log_likelihood={"obs": direct}))
    np.testing.assert_allclose(ours.elpd_loo, ref.elpd_loo, rtol=1e-4)
    np.testing.assert_allclose(ours.p_loo, ref.p_loo, rtol=1e-3, atol=1e-3)


def test_samples_path_and_errors(fitted):
    model, mcmc, x, y = fitted
    flat = mcmc.get_samples()
    idata = convert.to_inference_data(samples=flat, model=model, args=(x, y))
    assert idata.posterior["t"].shape == (1, 120, 3)
    grouped = convert.to_inference_data(
        samples=mcmc.get_samples(group_by_chain=True), model=model, args=(x, y), group_by_chain=True
    )
    assert grouped.posterior["t"].shape == (2, 60, 3)
    with pytest.raises(ValueError, match="model: required"):
        convert.to_inference_data(samples=flat)
    with pytest.raises(ValueError, match="samples: give either"):
        convert.to_inference_data(mcmc, samples=flat)
    with pytest.raises(ValueError, match=r"samples\['t'\]: contains NaN"):
        convert.to_inference_data(samples={"t": flat["t"] * float("nan")}, model=model, args=(x, y))
    with pytest.raises(ValueError, match="not a sample site"):
        convert.to_inference_data(samples={"u": flat["t"]}, model=model, args=(x, y))


def _loo_warnings(caught):
    return [w for w in caught if issubclass(w.category, UserWarning) and "az.loo" in str(w.message)]


def test_at_t_not_one_one_warning_names_tempered_loo(fitted):
    """T = 2: az.loo on the export is not the tempered LOO; one warning per export (not one per
    chunk of draws) and the same note in the log_likelihood group's attributes."""
    import warnings

    _, mcmc, _, _ = fitted
    for log_likelihood in ("tempered", "untempered"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idata = convert.to_inference_data(
                mcmc, draws_per_chunk=7, log_likelihood=log_likelihood
            )  # 18 chunks
        found = _loo_warnings(caught)
        assert len(found) == 1, [str(w.message) for w in caught]
        message = str(found[0].message)
        assert "az.loo on this export is not the tempered LOO" in message
        assert "tempered_loo" in message and "T = 2" in message
        assert found[0].filename == __file__  # points at the caller
        if log_likelihood == "untempered":  # the one warning also says the weights are wrong
            assert "untempered" in message
        note = idata["log_likelihood"].attrs["loo"]
        assert note in message and "tempered_loo" in note
    elpd = convert.tempered_loo(idata)  # reads T from the attributes; either engine's type
    assert np.isfinite(float(getattr(elpd, "elpd_loo", getattr(elpd, "elpd", np.nan))))


def test_at_t_one_no_loo_warning_and_no_note():
    import warnings

    import pyro
    import pyro.distributions as dist

    y = torch.tensor([0.3, -0.1, 0.8, 0.2])

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    samples = {"mu": torch.linspace(-1.0, 1.0, 50)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        idata = convert.to_inference_data(samples=samples, model=model, args=(y,), seed=0)
    assert not _loo_warnings(caught), [str(w.message) for w in caught]
    assert "loo" not in idata["log_likelihood"].attrs
    assert idata["log_likelihood"].attrs["temperature"] == 1.0


def _toy_subspace_model(temperature=1.0):
    torch.manual_seed(0)
    x = torch.randn(40, 2)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(40)
    net = nn.Sequential(nn.Linear(2, 10), nn.Tanh(), nn.Linear(10, 1))
    model = SubspaceNet(
        net, subspaces.random(net, 3, seed=0), likelihoods.Gaussian(0.3), temperature=temperature
    )
    return model, net, x, y


def test_slice_sampler_export_counts_every_likelihood_evaluation():
    """``sample_stats.n_evals``: per draw, the likelihood evaluations of its transition: the
    forward passes of the network between the driver's hook after the previous draw and the
    one after this draw (a forward hook counts them independently)."""
    from pyro_subspace import EllipticalSliceSampler

    model, net, x, y = _toy_subspace_model()
    calls, at_draw = [], []
    handle = net.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        mcmc = MCMC(EllipticalSliceSampler(model), num_samples=30, warmup_steps=0,
                    disable_progbar=True, hook_fn=lambda *_: at_draw.append(len(calls)))  # fmt: skip
        mcmc.run(x, y)
    finally:
        handle.remove()
    idata = convert.to_inference_data(mcmc, seed=0)
    n_evals = idata.sample_stats["n_evals"].values
    assert n_evals.shape == (1, 30) and (n_evals >= 1).all()
    np.testing.assert_array_equal(n_evals[0, 1:], np.diff(at_draw))
    assert "reference_df" not in idata.sample_stats


@pytest.mark.filterwarnings("ignore::pyro_subspace.ConvergenceWarning")  # 20 draws: unmixed
@pytest.mark.parametrize("df", [7.5, None])
def test_auto_reference_export_has_each_draws_evaluations_and_nu(df):
    """``reference="auto"``: ``n_evals`` per draw and chain averages to the kernel's
    ``evaluations per draw`` (no warm-up), ``reference_df`` is the fixed ``ν`` when one is
    given, else one of the ``ν`` fitted for the chain's group."""
    from pyro_subspace import EllipticalSliceSampler
    from pyro_subspace.infer.ess import one_process

    model, _, x, y = _toy_subspace_model()
    kernel = EllipticalSliceSampler(model, reference="auto", chains=8, seed=0, df=df)
    mcmc = one_process(MCMC(kernel, num_samples=20, warmup_steps=0, num_chains=8,
                            disable_progbar=True))  # fmt: skip
    mcmc.run(x, y)
    diag = mcmc.diagnostics()
    idata = convert.to_inference_data(mcmc, seed=0)
    n_evals = idata.sample_stats["n_evals"].values
    nu = idata.sample_stats["reference_df"].values
    assert n_evals.shape == nu.shape == (8, 20) and (n_evals >= 1).all()
    for c in range(8):
        assert n_evals[c].mean() == pytest.approx(diag["evaluations per draw"][f"chain {c}"])
        if df is None:
            assert set(nu[c]) <= set(diag["reference df"][f"chain {c}"])
        else:
            assert (nu[c] == df).all()
