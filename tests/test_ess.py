"""EllipticalSliceSampler against closed-form Gaussian posteriors and Pyro's MCMC contract."""

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from conftest import conjugate_posterior
from pyro.infer import MCMC
from torch import nn

from pyro_subspace import EllipticalSliceSampler, SubspaceNet, convert, likelihoods, subspaces
from pyro_subspace.subspaces import Subspace

SIGMA, PRIOR = 0.5, 1.5


def linear_model(n=30, temperature=1.0, chunk_rows=None):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    y = y + SIGMA * torch.randn(n, generator=gen, dtype=torch.float64)
    net = nn.Linear(3, 1, bias=False).double()
    sub = Subspace(torch.zeros(3, dtype=torch.float64), torch.eye(3, dtype=torch.float64))
    model = SubspaceNet(
        net, sub, likelihoods.Gaussian(SIGMA), prior_scale=PRIOR, temperature=temperature
    )
    return model, x, y


def assert_matches_gaussian(samples, mean, cov, ess):
    """Mean and covariance within 4.5 Monte Carlo standard errors (ESS-based)."""
    emp_mean, emp_cov = samples.mean(0), torch.cov(samples.T)
    assert ((emp_mean - mean).abs() <= 4.5 * (cov.diagonal() / ess).sqrt()).all(), (emp_mean, mean)
    var = cov.diagonal()
    se = ((var[:, None] * var[None, :] + cov**2) / ess).sqrt()
    assert ((emp_cov - cov).abs() <= 4.5 * se).all(), (emp_cov, cov)


def run(kernel, *args, num_samples=1000, warmup=200, chains=1, **kwargs):
    mcmc = MCMC(
        kernel,
        num_samples=num_samples,
        warmup_steps=warmup,
        num_chains=chains,
        disable_progbar=True,
        **kwargs,
    )
    mcmc.run(*args)
    return mcmc


def test_conjugate_posterior_with_four_chains_and_rhat():
    model, x, y = linear_model(temperature=2.0)
    mcmc = run(EllipticalSliceSampler(model), x, y, num_samples=1200, chains=4)
    idata = convert.to_inference_data(mcmc)
    rhat = az.rhat(idata)["t"].values
    ess = float(az.ess(idata)["t"].values.min())
    assert (rhat < 1.01).all(), rhat
    mean, cov = conjugate_posterior(x, y, SIGMA, PRIOR, temperature=2.0)
    assert_matches_gaussian(mcmc.get_samples()["t"], mean, cov, ess)
    assert 1.0 <= mcmc.diagnostics()["evaluations per draw"]["chain 0"] < 20


def test_without_observations_it_samples_the_prior():
    model, x, _ = linear_model()
    kernel = EllipticalSliceSampler(model)
    mcmc = run(kernel, x, None, num_samples=3000, warmup=0)
    t = mcmc.get_samples()["t"]
    ess = float(
        az.ess(convert.to_inference_data(samples={"t": t}, model=model, args=(x,)))["t"].min()
    )
    assert_matches_gaussian(
        t, torch.zeros(3, dtype=torch.float64), PRIOR**2 * torch.eye(3, dtype=torch.float64), ess
    )
    assert kernel.evaluations_per_draw == 1.0  # every first proposal is accepted


def two_site_model(x, y=None):
    a = pyro.sample("a", dist.Normal(torch.tensor(0.5, dtype=torch.float64), 2.0))
    cov = torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=torch.float64)
    b = pyro.sample("b", dist.MultivariateNormal(torch.zeros(2, dtype=torch.float64), cov))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Normal(a + x @ b, SIGMA), obs=y)


def test_two_gaussian_sites_in_a_plain_pyro_model():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(25, 2, generator=gen, dtype=torch.float64)
    y = 1.0 + x @ torch.tensor([0.5, -1.0], dtype=torch.float64)
    y = y + SIGMA * torch.randn(25, generator=gen, dtype=torch.float64)
    mcmc = run(EllipticalSliceSampler(two_site_model), x, y, num_samples=2500)
    s = mcmc.get_samples()
    theta = torch.cat([s["a"][:, None], s["b"]], dim=1)
    # θ = (a, b) ~ N(m0, S0), y = [1, x] θ + ε: a linear-Gaussian posterior in closed form.
    m0 = torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)
    s0 = torch.zeros(3, 3, dtype=torch.float64)
    s0[0, 0] = 4.0
    s0[1:, 1:] = torch.tensor([[1.0, 0.3], [0.3, 0.5]], dtype=torch.float64)
    design = torch.cat([torch.ones(25, 1, dtype=torch.float64), x], dim=1)
    prec = torch.linalg.inv(s0) + design.T @ design / SIGMA**2
    cov = torch.linalg.inv(prec)
    mean = cov @ (torch.linalg.solve(s0, m0) + design.T @ y / SIGMA**2)
    ess = float(min(mcmc.diagnostics()[k]["n_eff"].min() for k in ("a", "b")))
    assert_matches_gaussian(theta, mean, cov, ess)


def non_gaussian_model(y):
    scale = pyro.sample("noise", dist.HalfNormal(1.0))
    pyro.sample("y", dist.Normal(0.0, scale), obs=y)


def dependent_model(y):
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(a, 1.0))
    pyro.sample("y", dist.Normal(b, 1.0), obs=y)


def wrapped_laplace_model(y):
    b = pyro.sample("b", dist.Laplace(torch.zeros(2), 1.0).to_event(1))
    pyro.sample("y", dist.Normal(b.sum(), 1.0), obs=y)


@pytest.mark.parametrize(
    "model, site, what",
    [
        (non_gaussian_model, "noise", "got HalfNormal$"),
        (dependent_model, "b", "depend on other latent sites"),
        (wrapped_laplace_model, "b", r"got Independent\(Laplace\)"),
    ],
)
def test_non_gaussian_or_dependent_priors_raise_type_error_naming_the_site(model, site, what):
    kernel = EllipticalSliceSampler(model)
    with pytest.raises(TypeError, match=f"site '{site}'.*{what}"):
        kernel.setup(0, torch.tensor(0.3))


def test_subsampling_plain_models_are_refused():
    def subsampled(y):
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        with pyro.plate("data", 10, subsample_size=3) as idx:
            pyro.sample("y", dist.Normal(a, 1.0), obs=y[idx])

    with pytest.raises(ValueError, match="plate 'data' subsamples 3 of 10"):
        EllipticalSliceSampler(subsampled).setup(0, torch.zeros(10))


def test_chunked_likelihood_equals_unchunked_and_a_direct_computation(device):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    model = SubspaceNet(
        net,
        subspaces.random(net, 4, seed=0),
        likelihoods.Gaussian(0.3),
        temperature=3.0,
        subsample_size=5,
    ).to(device)
    x, y = torch.randn(103, 2).to(device), torch.randn(103).to(device)
    t = {"t": 0.5 * torch.randn(4).to(device)}
    values = []
    for chunk in (7, 50, 10_000):
        kernel = EllipticalSliceSampler(model, chunk_size=chunk)
        kernel.setup(0, x, y)
        values.append(kernel.log_likelihood(t))
    direct = likelihoods.Gaussian(0.3).log_prob(model.outputs(t["t"], x), y).sum().item() / 3.0
    np.testing.assert_allclose(values, direct, rtol=1e-5)


def test_initial_params_are_respected_and_chains_start_from_their_own_prior_draws(device):
    model, x, y = linear_model()
    model, x, y = model.to(device), x.to(device), y.to(device)
    kernel = EllipticalSliceSampler(model)
    start = {"t": torch.tensor([3.0, -3.0, 3.0], dtype=torch.float64, device=device)}
    kernel.initial_params = start
    kernel.setup(0, x, y)
    assert torch.equal(kernel.initial_params["t"], start["t"])
    with pytest.raises(ValueError, match=r"initial_params\['t'\]: expected shape \(3,\)"):
        kernel.initial_params = {"t": torch.zeros(2, dtype=torch.float64, device=device)}
        kernel.setup(0, x, y)
    fresh = EllipticalSliceSampler(model)
    fresh.setup(0, x, y)
    first = fresh.initial_params["t"].clone()
    fresh.cleanup()
    fresh.setup(0, x, y)
    assert not torch.equal(first, fresh.initial_params["t"])
    # through the driver: a chain started at `start` moves along ellipses through it, on the
    # data's device, and the same seed gives the same chain
    chains = []
    for _ in range(2):
        pyro.set_rng_seed(4)
        mcmc = MCMC(
            EllipticalSliceSampler(model),
            num_samples=4,
            warmup_steps=0,
            initial_params=start,
            disable_progbar=True,
        )
        mcmc.run(x, y)
        chains.append(mcmc.get_samples()["t"])
    assert chains[0].shape == (4, 3) and chains[0].device == device
    assert torch.equal(chains[0], chains[1]) and not torch.equal(chains[0][0], start["t"])


def test_worker_processes_sample_and_arviz_from_pyro_works(monkeypatch):
    from pyro.infer.mcmc import api

    monkeypatch.setattr(api.mp, "cpu_count", lambda: 4)  # this machine has 2 cores: force workers
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    model = SubspaceNet(net, subspaces.random(net, 2, seed=0), likelihoods.Gaussian(0.2))
    x = torch.linspace(-1, 1, 20)[:, None]
    y = torch.sin(3 * x[:, 0])
    mcmc = MCMC(
        EllipticalSliceSampler(model),
        num_samples=30,
        warmup_steps=5,
        num_chains=2,
        mp_context="spawn",
        disable_progbar=True,
    )
    mcmc.run(x, y)
    t = mcmc.get_samples(group_by_chain=True)["t"]
    assert t.shape == (2, 30, 2) and not torch.equal(t[0], t[1])
    idata = az.from_pyro(mcmc)
    assert idata.posterior["t"].shape == (2, 30, 2)
    assert idata.sample_stats["diverging"].values.sum() == 0


def test_recompute_batchnorm_uses_the_statistics_at_the_proposal_and_restores_the_user_buffers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
    net.train()
    for _ in range(5):
        net(torch.randn(64, 2))
    saved = [b.clone() for b in net.buffers()]
    model = SubspaceNet(net, subspaces.random(net, 3, seed=0), likelihoods.Gaussian(0.5))
    x, y = torch.randn(90, 2), torch.randn(90)
    kernel = EllipticalSliceSampler(model, chunk_size=40, recompute_bn=True)
    kernel.setup(0, x, y)
    t = torch.randn(3)
    used = []  # the statistics BatchNorm normalises with in the likelihood's (eval) passes
    hook = net[1].register_forward_pre_hook(
        lambda m, inputs: (
            used.append((m.running_mean.clone(), m.running_var.clone())) if not m.training else None
        )
    )
    kernel.log_likelihood({"t": t})
    hook.remove()
    w = model.flat.unflatten(model.subspace.weights(t))
    pre = x @ w["0.weight"].T + w["0.bias"]  # the BatchNorm input at the proposed weights
    # running_var: the size-weighted mean of each chunk's unbiased variance (torch's convention)
    var = sum(c.shape[0] / 90 * c.var(0) for c in pre.split(40))  # chunks of 40, 40, 10
    assert len(used) == 3  # one eval pass per chunk
    for mean_used, var_used in used:
        assert torch.allclose(mean_used, pre.mean(0), atol=1e-5)
        assert torch.allclose(var_used, var, atol=1e-5)
    # the user's buffers are back right after the evaluation (issue 12), and after cleanup
    assert all(torch.equal(a, b) for a, b in zip(saved, net.buffers()))
    kernel.cleanup()
    assert all(torch.equal(a, b) for a, b in zip(saved, net.buffers()))


def test_bad_arguments():
    with pytest.raises(ValueError, match="chunk_size"):
        EllipticalSliceSampler(lambda: None, chunk_size=0)
    with pytest.raises(TypeError, match="model"):
        EllipticalSliceSampler("model")
    with pytest.raises(RuntimeError, match="setup"):
        EllipticalSliceSampler(lambda: None).sample({})
