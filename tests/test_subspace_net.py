"""SubspaceNet under Pyro's own inference, against the closed-form conjugate posterior.

With a linear network ``f(x) = x t``, ``Subspace(shift=0, basis=I)``, a Gaussian likelihood with
known σ and the prior ``t ~ N(0, s² I)``, the tempered posterior is Gaussian with precision
``XᵀX/(Tσ²) + I/s²`` (computed with dense linear algebra in ``conftest.conjugate_posterior``).
"""

import math

import pyro
import pytest
import torch
from conftest import conjugate_posterior
from pyro.infer import HMC, MCMC, NUTS, SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoIAFNormal, AutoMultivariateNormal, AutoNormal
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods, subspaces
from pyro_subspace.subspaces import Subspace

SIGMA, PRIOR = 0.5, 1.5


def conjugate_problem(n=30, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)[:k] + SIGMA * torch.randn(
        n, generator=gen, dtype=torch.float64
    )
    net = nn.Linear(k, 1, bias=False).double()
    sub = Subspace(torch.zeros(k, dtype=torch.float64), torch.eye(k, dtype=torch.float64))
    return x, y, net, sub


def assert_matches_gaussian(samples, mean, cov, ess):
    """Sample mean and covariance within ~4.5 Monte Carlo standard errors of the truth."""
    emp_mean = samples.mean(0)
    emp_cov = torch.cov(samples.T)
    se_mean = (cov.diagonal() / ess).sqrt()
    assert ((emp_mean - mean).abs() <= 4.5 * se_mean).all(), (emp_mean, mean, se_mean)
    var = cov.diagonal()
    se_cov = ((var[:, None] * var[None, :] + cov**2) / ess).sqrt()
    assert ((emp_cov - cov).abs() <= 4.5 * se_cov).all(), (emp_cov, cov, se_cov)


@pytest.mark.parametrize(
    "kernel, temperature",
    [(lambda m: NUTS(m), 1.0), (lambda m: HMC(m, step_size=0.1, num_steps=8), 3.0)],
    ids=["nuts-T1", "hmc-T3"],
)
def test_mcmc_reproduces_the_conjugate_posterior(kernel, temperature):
    x, y, net, sub = conjugate_problem()
    model = SubspaceNet(
        net, sub, likelihoods.Gaussian(SIGMA), prior_scale=PRIOR, temperature=temperature
    )
    mcmc = MCMC(kernel(model), num_samples=800, warmup_steps=300, disable_progbar=True)
    mcmc.run(x, y)
    t = mcmc.get_samples()["t"]
    ess = float(mcmc.diagnostics()["t"]["n_eff"].min())
    assert ess > 50
    mean, cov = conjugate_posterior(x, y, SIGMA, PRIOR, temperature)
    assert_matches_gaussian(t, mean, cov, ess)


def fit_svi(model, guide, x, y, steps, lr=0.05):
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.01 ** (1 / steps)})
    svi = SVI(
        model,
        guide,
        optim,
        Trace_ELBO(num_particles=16, vectorize_particles=True, max_plate_nesting=1),
    )
    for _ in range(steps):
        svi.step(x, y)
    return svi


def test_svi_multivariate_normal_matches_the_posterior_and_mean_field_its_closed_form():
    x, y, net, sub = conjugate_problem()
    model = SubspaceNet(net, sub, likelihoods.Gaussian(SIGMA), prior_scale=PRIOR)
    mean, cov = conjugate_posterior(x, y, SIGMA, PRIOR)
    sd = cov.diagonal().sqrt()
    guide = AutoMultivariateNormal(model)
    fit_svi(model, guide, x, y, steps=600)
    q_mean, q_cov = (
        guide.get_posterior().mean.detach(),
        guide.get_posterior().covariance_matrix.detach(),
    )
    assert ((q_mean - mean).abs() < 0.15 * sd).all()
    assert ((q_cov - cov).abs() < 0.15 * (sd[:, None] * sd[None, :])).all()
    # Mean-field VI on a Gaussian has the exact mean and the variances 1 / diag(precision).
    pyro.clear_param_store()
    mf = AutoNormal(model)
    fit_svi(model, mf, x, y, steps=600)
    loc, scale = mf.locs.t.detach(), mf.scales.t.detach()
    mf_sd = torch.linalg.inv(cov).diagonal().rsqrt()
    assert ((loc - mean).abs() < 0.15 * sd).all()
    assert ((scale - mf_sd).abs() < 0.1 * mf_sd).all()


def test_normalizing_flow_guide_reaches_the_log_evidence():
    x, y, net, sub = conjugate_problem()
    model = SubspaceNet(net, sub, likelihoods.Gaussian(SIGMA), prior_scale=PRIOR)
    guide = AutoIAFNormal(model, hidden_dim=[16])
    fit_svi(model, guide, x, y, steps=800, lr=0.02)
    # log p(y) = log N(y | 0, s² X Xᵀ + σ² I), the exact evidence of the conjugate model.
    marginal = torch.distributions.MultivariateNormal(
        torch.zeros(len(y), dtype=torch.float64),
        PRIOR**2 * x @ x.T + SIGMA**2 * torch.eye(len(y), dtype=torch.float64),
    )
    log_z = marginal.log_prob(y).item()
    elbo = Trace_ELBO(num_particles=2000, vectorize_particles=True, max_plate_nesting=1)
    estimates = torch.tensor([-elbo.loss(model, guide, x, y) for _ in range(5)])
    mc_se = estimates.std().item() / math.sqrt(5) + 1e-3
    assert estimates.mean() <= log_z + 4 * mc_se  # the ELBO is a lower bound ...
    assert estimates.mean() >= log_z - 0.3  # ... and the flow makes it tight


def test_predictive_parallel_equals_sequential_and_outputs_are_the_network_at_the_weights(device):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
    sub = subspaces.random(net, 4, seed=0)
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.2)).to(device)
    x = torch.randn(25, 2).to(device)
    samples = {"t": torch.randn(10, 4).to(device)}
    seq = Predictive(model, posterior_samples=samples)(x)
    par = Predictive(model, posterior_samples=samples, parallel=True)(x)
    assert seq["f"].shape == par["f"].shape == (10, 25, 1)
    assert torch.allclose(seq["f"], par["f"], atol=1e-5)
    flat_w = sub.weights(samples["t"][3])
    nn.utils.vector_to_parameters(flat_w, net.parameters())
    assert torch.allclose(par["f"][3], net(x), atol=1e-5)
    assert par["obs"].shape == (10, 25)


def test_model_input_checks():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
    other = nn.Linear(3, 1)
    lik = likelihoods.Gaussian(0.1)
    with pytest.raises(ValueError, match="subspace: has D=4 weights but the network has 17"):
        SubspaceNet(net, subspaces.random(other, 2), lik)
    with pytest.raises(TypeError, match="likelihood"):
        SubspaceNet(net, subspaces.random(net, 2), torch.distributions.Normal)
    with pytest.raises(ValueError, match="temperature"):
        SubspaceNet(net, subspaces.random(net, 2), lik, temperature=0.0)
    with pytest.raises(ValueError, match="prior_scale"):
        SubspaceNet(net, subspaces.random(net, 2), lik, prior_scale=torch.ones(3))
    model = SubspaceNet(net, subspaces.random(net, 2), lik)
    x = torch.randn(6, 2)
    with pytest.raises(ValueError, match="x: contains NaN"):
        model(torch.full((6, 2), float("inf")), torch.zeros(6))
    with pytest.raises(ValueError, match="y: expected 6 targets"):
        model(x, torch.zeros(5))
    with pytest.raises(ValueError, match=r"y: expected shape \(6,\) or \(6, 1\)"):
        model(x, torch.zeros(6, 6))
    with pytest.raises(ValueError, match="subsample_size: 10 exceeds"):
        model(x, torch.zeros(6), subsample_size=10)


def test_a_dataset_or_dataloader_gives_the_trace_of_the_tensors():
    from pyro import poutine
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    model = SubspaceNet(net, subspaces.random(net, 3, seed=0), likelihoods.Gaussian(0.3))
    x, y = torch.randn(23, 2, dtype=torch.float64), torch.randn(23, dtype=torch.float64)
    t = {"t": torch.randn(3, dtype=torch.float64)}

    def obs_log_prob(*args):
        trace = poutine.trace(poutine.condition(model, t)).get_trace(*args)
        trace.compute_log_prob()
        return trace.nodes["obs"]["log_prob_sum"]

    expected = obs_log_prob(x, y)
    for data in (TensorDataset(x, y), DataLoader(TensorDataset(x, y), batch_size=5)):
        assert torch.equal(obs_log_prob(data), expected)


def test_a_subspace_of_another_dtype_than_the_net_is_named():
    net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
    sub = subspaces.random(net, 3, seed=0)
    net.double()  # converted after the subspace was built
    with pytest.raises(TypeError, match=r"subspace: is torch.float32 .* subspace.to\("):
        SubspaceNet(net, sub, likelihoods.Gaussian(0.3))
    model = SubspaceNet(net, sub.to(torch.float64), likelihoods.Gaussian(0.3))
    assert model.outputs(torch.zeros(3, dtype=torch.float64), torch.ones(1, 2).double()).dtype == (
        torch.float64
    )


def test_temperature_strings_other_than_auto_are_named():
    net = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="temperature: expected a number > 0 or 'auto'"):
        SubspaceNet(
            net, subspaces.random(net, 2, seed=0), likelihoods.Gaussian(0.3), temperature="AUTO"
        )
