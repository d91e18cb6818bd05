"""diagnostics.check: split R-hat and bulk/tail ESS per coordinate (ArviZ's estimators), a
ConvergenceWarning that names the coordinate, the numbers and what to do on runs that have
not mixed, none on runs that have; R-hat across the independent populations of
reference="auto", and the kernel's own check at the end of such a run."""

import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS
from torch import nn

from pyro_subspace import SubspaceNet, likelihoods
from pyro_subspace.diagnostics import ConvergenceReport, check, check_draws
from pyro_subspace.exceptions import ConvergenceWarning
from pyro_subspace.infer import EllipticalSliceSampler
from pyro_subspace.subspaces import Subspace

pytestmark = pytest.mark.filterwarnings("ignore:num_chains=.*Chains will be drawn sequentially")
f64 = torch.float64


def convergence_warnings(caught):
    return [w for w in caught if issubclass(w.category, ConvergenceWarning)]


def run_checked(mcmc, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(*args)
        report = check(mcmc)
    return report, convergence_warnings(caught)


def two_modes():
    """A Pyro model with modes at t = 3 and t = -1.5, sd 0.05: a barrier of ~1000 nats."""
    t = pyro.sample("t", dist.Normal(torch.zeros(1, dtype=f64), 5.0).to_event(1))
    a = -0.5 * ((t[0] - 3) / 0.05) ** 2
    b = -0.5 * ((t[0] + 1.5) / 0.05) ** 2
    pyro.factor("modes", torch.logaddexp(a, b))


def test_unmixed_chains_warn_naming_the_coordinate_numbers_and_what_to_do():
    """Two NUTS chains started one in each mode of a bimodal target never meet."""
    start = {"t": torch.tensor([[3.0], [-1.5]], dtype=f64)}
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(two_modes), num_samples=200, warmup_steps=50, num_chains=2,
                initial_params=start, disable_progbar=True)  # fmt: skip
    report, caught = run_checked(mcmc)
    samples = mcmc.get_samples(group_by_chain=True)["t"]
    assert (samples[0] > 0).all() and (samples[1] < 0).all()  # deliberately unmixed
    assert not report.ok and len(caught) == 1
    message = str(caught[0].message)
    rhat = float(az.rhat(az.from_dict(posterior={"t": samples.numpy()}))["t"][0])
    assert rhat > 1.5 and report.rhat["t"][0] == pytest.approx(rhat)  # rank-based: bounded
    assert f"t[0]: R-hat {rhat:.3f} > 1.01" in message
    assert "bulk ESS" in message and "< 200" in message  # 100 per chain × 2 chains
    assert "2 chains × 200 draws" in message
    assert "run NUTS longer" in message and "reference='auto'" in message
    assert caught[0].filename == __file__  # points at the caller of check


def test_a_mixed_run_emits_nothing_and_reports_arviz_numbers():
    """Plain ESS on a Gaussian posterior close to the prior: nearly independent draws."""
    prior = dist.Normal(torch.zeros(3, dtype=f64), 1.0).to_event(1)
    kern = EllipticalSliceSampler(
        prior=prior, log_likelihood=lambda t: float(-0.5 * ((t - 0.5) ** 2).sum() / 4)
    )
    mcmc = MCMC(kern, num_samples=1000, warmup_steps=50, num_chains=2, disable_progbar=True)
    report, caught = run_checked(mcmc)
    assert report.ok and not caught, [str(w.message) for w in caught]
    idata = az.from_dict(posterior={"t": mcmc.get_samples(group_by_chain=True)["t"].numpy()})
    np.testing.assert_allclose(report.rhat["t"], az.rhat(idata)["t"].values)
    np.testing.assert_allclose(report.ess_bulk["t"], az.ess(idata, method="bulk")["t"].values)
    np.testing.assert_allclose(report.ess_tail["t"], az.ess(idata, method="tail")["t"].values)
    assert report.max_rhat <= 1.01 and report.min_ess_tail >= 200
    assert report.rhat_populations is None and (report.chains, report.draws) == (2, 1000)


def subspace_model():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=gen, dtype=f64)
    y = x @ torch.tensor([1.0, -0.5], dtype=f64) + 0.5 * torch.randn(40, generator=gen, dtype=f64)
    net = nn.Linear(2, 1, bias=False).double()
    sub = Subspace(torch.zeros(2, dtype=f64), torch.eye(2, dtype=f64))
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.5), prior_scale=1.0, temperature=1.0)
    return model, x, y


def test_nuts_over_a_subspace_net_mixed_and_diverging():
    model, x, y = subspace_model()
    pyro.set_rng_seed(1)
    mcmc = MCMC(NUTS(model), num_samples=300, warmup_steps=100, num_chains=2,
                disable_progbar=True)  # fmt: skip
    report, caught = run_checked(mcmc, x, y)
    assert report.ok and not caught, [str(w.message) for w in caught]
    assert report.rhat["t"].shape == (2,) and report.divergences == 0
    # a step size far too large for the posterior's scale (sd ~0.08): every trajectory diverges
    pyro.set_rng_seed(2)
    nuts = NUTS(model, step_size=5.0, adapt_step_size=False)
    mcmc = MCMC(nuts, num_samples=30, warmup_steps=0, num_chains=2, disable_progbar=True)
    report, caught = run_checked(mcmc, x, y)
    divergent = sum(len(v) for v in mcmc.diagnostics()["divergences"].values())
    assert divergent > 0 and report.divergences == divergent
    message = str(caught[0].message)
    assert f"{divergent} divergent transitions after warm-up" in message
    assert "target_accept_prob" in message and "run NUTS longer" in message


def test_rhat_across_populations_is_arviz_on_each_population_interleaved_in_time():
    rng = np.random.default_rng(0)
    draws = rng.standard_normal((8, 200, 2))
    draws[4:, :, 1] += 0.4  # population 1 sits elsewhere in coordinate 1
    populations = [0, 0, 0, 0, 1, 1, 1, 1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_draws({"t": draws}, populations=populations)
    by_hand = np.stack([draws[:4].transpose(1, 0, 2).reshape(800, 2),
                        draws[4:].transpose(1, 0, 2).reshape(800, 2)])  # fmt: skip
    expected = az.rhat(az.from_dict(posterior={"t": by_hand}))["t"].values
    np.testing.assert_allclose(report.rhat_populations["t"], expected)
    chains = az.rhat(az.from_dict(posterior={"t": draws}))["t"].values
    np.testing.assert_allclose(report.rhat["t"], np.maximum(chains, expected))
    assert report.rhat["t"][1] > 1.01 and report.rhat["t"][0] < 1.01
    message = str(convergence_warnings(caught)[0].message)
    assert "t[1]: R-hat" in message and "across independent populations" in message
    assert "t[0]" not in message


def test_chains_that_switch_modes_slowly_are_named_as_such_when_populations_agree():
    """Chains visiting two modes in turn, switching at 2% a step: each population holds both
    modes in proportion, so R-hat across populations is near 1 while the chains' is not (the
    toy T = 1, K = 20 posterior of benchmarks/ess_vs_nuts.py); the warning says which."""
    rng = np.random.default_rng(0)
    chains, length = 40, 2000
    state = rng.integers(0, 2, chains)
    draws = np.empty((chains, length, 2))
    for j in range(length):
        state = np.where(rng.random(chains) < 0.02, 1 - state, state)
        draws[:, j, 0] = np.where(state == 1, 2.0, -2.0) + 0.5 * rng.standard_normal(chains)
        draws[:, j, 1] = rng.standard_normal(chains)
    populations = [c // 20 for c in range(chains)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_draws({"t": draws}, populations=populations)
    chain_rhat = az.rhat(az.from_dict(posterior={"t": draws}))["t"].values
    assert chain_rhat[0] > 1.01 and report.rhat_populations["t"].max() <= 1.01  # the premise
    message = str(convergence_warnings(caught)[0].message)
    assert "populations agree with each other" in message and "between modes" in message
    # populations that disagree are not described so
    draws[20:, :, 1] += 0.4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_draws({"t": draws}, populations=populations)
    assert "populations agree" not in str(convergence_warnings(caught)[0].message)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: check(object()), TypeError, "mcmc: expected a pyro.infer.MCMC after run"),
        (lambda: check_draws([1]), TypeError, "draws: expected a dict"),
        (lambda: check_draws({"t": np.zeros(3)}), ValueError, r"draws\['t'\]: expected"),
        (lambda: check_draws({"t": np.zeros((2, 5))}, max_rhat=1.0), ValueError, "max_rhat"),
        (
            lambda: check_draws({"t": np.zeros((2, 5))}, populations=[0]),
            ValueError,
            "populations: expected one label per chain",
        ),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def banana_kernel(chains, seed):
    prior = dist.Normal(torch.zeros(2, dtype=f64), 3.0).to_event(1)

    def loglik(t):
        return -0.5 * t[..., 0] ** 2 - 0.5 * (t[..., 1] - 0.5 * t[..., 0] ** 2) ** 2 / 0.01

    return EllipticalSliceSampler(
        prior=prior, log_likelihood=loglik, reference="auto", chains=chains, seed=seed
    )


def test_the_auto_kernel_checks_itself_at_the_end_of_its_run():
    """Too short a run of reference='auto' warns from inside MCMC.run (the kernel's cleanup
    after the last chain), with R-hat across its populations; check(mcmc) says the same."""
    kern = banana_kernel(8, seed=0)
    mcmc = MCMC(kern, num_samples=40, warmup_steps=10, num_chains=8, disable_progbar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run()
    found = convergence_warnings(caught)
    assert len(found) == 1 and "across independent populations" in str(found[0].message)
    assert "draw more per chain" in str(found[0].message)
    report = kern.convergence
    assert isinstance(report, ConvergenceReport) and not report.ok
    assert kern.chain_populations == [0, 0, 0, 0, 1, 1, 1, 1]
    again = check(mcmc, warn=False)  # the same draws: the same numbers
    np.testing.assert_allclose(again.rhat["t"], report.rhat["t"])
    np.testing.assert_allclose(again.ess_bulk["t"], report.ess_bulk["t"])


@pytest.mark.slow
def test_a_mixed_auto_run_stays_silent():
    prior = dist.Normal(torch.zeros(2, dtype=f64), 1.0).to_event(1)
    kern = EllipticalSliceSampler(
        prior=prior,
        log_likelihood=lambda t: -0.5 * ((t - 0.3) ** 2).sum(-1) / 0.5,
        reference="auto",
        chains=8,
        seed=1,
    )
    mcmc = MCMC(kern, num_samples=1500, warmup_steps=100, num_chains=8, disable_progbar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run()
    assert not convergence_warnings(caught), [str(w.message) for w in caught]
    assert kern.convergence.ok and kern.convergence.rhat_populations is not None
