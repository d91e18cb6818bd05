import arviz as az
import numpy as np
import pytest
import torch
from pyro.infer import MCMC, NUTS
from torch import nn

from pyro_subspace import SubspaceNet, convert, likelihoods, subspaces


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


def test_pointwise_log_likelihood_is_untempered_and_matches_a_direct_computation(fitted):
    model, mcmc, x, y = fitted
    idata = convert.to_inference_data(mcmc, draws_per_chunk=7)  # chunks that split chains
    t = mcmc.get_samples(group_by_chain=True)["t"]  # (2, 60, 3)
    direct = likelihoods.Gaussian(0.3).log_prob(model.outputs(t, x), y)  # (2, 60, 40)
    np.testing.assert_allclose(
        idata.log_likelihood["obs"].values, direct.detach().numpy(), atol=1e-4
    )
    # lp is the joint the sampler targets: log prior + tempered log-likelihood (T = 2).
    prior = model.prior().log_prob(t)
    np.testing.assert_allclose(
        idata.sample_stats["lp"].values, (prior + direct.sum(-1) / 2.0).detach().numpy(), rtol=1e-4
    )


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
