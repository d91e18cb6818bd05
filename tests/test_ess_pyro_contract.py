"""EllipticalSliceSampler under Pyro's MCMC drivers, as Pyro documents a kernel's contract.

Written from the documentation of ``pyro.infer.mcmc`` (``MCMCKernel``, ``MCMC``,
``StreamingMCMC``, ``Predictive``), not copied from Pyro's tests: ``setup``/``sample``/
``cleanup``, ``initial_params``, ``hook_fn``, ``save_params``, ``transforms``,
``disable_validation``, ``get_samples(group_by_chain=...)``, ``summary()``, ``diagnostics()``,
sequential chains and Pyro's multiprocessing driver (``spawn`` and ``fork``). Every feature is
run for the plain kernel (a Pyro model, and the model-free ``prior`` + ``log_likelihood`` form)
and for the generalised configuration (a reference refitted from the warm-up draws, chains
advanced together, seeded). Where a feature touches the draws they are checked against the
closed-form posterior of a conjugate Gaussian regression, with tolerances of 4 Monte Carlo
standard errors from Pyro's own ESS estimator (`assert_posterior`), or for bit-for-bit
equality with the same run made another way.

Pyro's multiprocessing driver runs chains in worker processes only when
``num_chains <= cpu_count - 1``: on a 2-core machine ``num_chains=2`` is drawn sequentially, so
the tests that need workers report more cores to the driver (``api.mp.cpu_count``). Not tested
here, a behaviour of Pyro 1.9's driver with any kernel (NUTS too): with workers, per-chain
``MCMC(initial_params=...)`` reach every worker as the last chain's (``_Worker.__init__`` sets
them on the one kernel object before any worker starts), and stay on the main process's kernel.
"""

import copy
import functools
import os
import pickle
import re

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from conftest import conjugate_posterior
from pyro import poutine
from pyro.infer import MCMC, Predictive
from pyro.infer.mcmc.api import StreamingMCMC
from pyro.infer.mcmc import api
from pyro.ops.stats import effective_sample_size

from pyro_subspace import EllipticalSliceSampler
from pyro_subspace.exceptions import SubsamplingError, UnsupportedModelError
from pyro_subspace.infer.ess import SliceState, elliptical_slice_step

f64 = torch.float64
K, N, SIGMA, PRIOR = 2, 8, 1.0, 1.0
_gen = torch.Generator().manual_seed(0)
X = torch.randn(N, K, generator=_gen, dtype=f64)
Y = X @ torch.tensor([1.0, -0.5], dtype=f64) + SIGMA * torch.randn(N, generator=_gen, dtype=f64)
MEAN, COV = conjugate_posterior(X, Y, SIGMA, PRIOR)  # the posterior of t, closed form
WARMUP, DRAWS = 100, 400

# 2 cores: Pyro's driver warns that it draws num_chains=2 one after another (the tests that
# mean that check the driver's sampler class)
pytestmark = pytest.mark.filterwarnings("ignore:num_chains=.*Chains will be drawn sequentially")


# --- the problem: module-level functions, so that the kernels pickle (spawn) -----------------


def model(x, y=None):
    """``t ~ N(0, PRIOR² I)``, ``y ~ N(x t, SIGMA²)``: its posterior is (MEAN, COV)."""
    t = pyro.sample("t", dist.Normal(torch.zeros(K, dtype=f64), PRIOR).to_event(1))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ t, SIGMA), obs=y)


def log_likelihood(t):
    """``log p(Y | t)`` up to a constant: ``(K,) -> ()`` or a batch ``(B, K) -> (B,)``."""
    return -0.5 * ((t @ X.T - Y) ** 2).sum(-1) / SIGMA**2


def prior():
    return dist.Normal(torch.zeros(K, dtype=f64), PRIOR).to_event(1)


def plain_model():
    return EllipticalSliceSampler(model), (X, Y)


def plain_free():
    return EllipticalSliceSampler(prior=prior(), log_likelihood=log_likelihood), ()


def generalised(chains=2, seed=3):
    kernel = EllipticalSliceSampler(
        prior=prior(), log_likelihood=log_likelihood, reference="warmup", chains=chains, seed=seed
    )
    return kernel, ()


CONFIGS = {"plain model": plain_model, "plain prior+loglik": plain_free, "generalised": generalised}


def assert_posterior(by_chain, mean=MEAN, var=None):
    """Draws ``(C, n, K)``: every coordinate's mean within ``4 sd / √ESS`` of ``mean``, and its
    variance (the mean of ``(t − mean)²``) within ``4 √2 var / √ESS`` of ``var`` (a Gaussian's
    ``sd((t − μ)²) = √2 σ²``), each ESS Pyro's estimator over the chains of that statistic."""
    var = COV.diagonal() if var is None else var
    draws = by_chain.double()
    ess = effective_sample_size(draws, chain_dim=0, sample_dim=1)
    got = draws.mean((0, 1))
    assert ((got - mean).abs() <= 4 * (var / ess).sqrt()).all(), (got, mean, ess)
    sq = (draws - mean) ** 2
    ess_sq = effective_sample_size(sq, chain_dim=0, sample_dim=1)
    got_var = sq.mean((0, 1))
    assert ((got_var - var).abs() <= 4 * 2**0.5 * var / ess_sq.sqrt()).all(), (got_var, var)


def record(records, kernel, params, stage, i):
    records.append((stage, i, kernel, {k: v.clone() for k, v in params.items()}))


@functools.lru_cache(maxsize=None)
def reference_run(config, num_chains):
    """One seeded ``MCMC`` run per configuration and number of chains (sequential), with a
    hook that records every transition; shared by the tests that only read it."""
    kernel, args = CONFIGS[config]()
    records = []
    pyro.set_rng_seed(11)
    mcmc = MCMC(
        kernel,
        num_samples=DRAWS,
        warmup_steps=WARMUP,
        num_chains=num_chains,
        hook_fn=functools.partial(record, records),
        disable_progbar=True,
    )
    assert isinstance(mcmc.sampler, api._UnarySampler)  # chains one after another
    mcmc.run(*args)
    return mcmc, kernel, records


@pytest.fixture
def workers(monkeypatch):
    """Pyro's driver then runs 2 chains in worker processes (it keeps one core for itself)."""
    monkeypatch.setattr(api.mp, "cpu_count", lambda: 3)


# --- draws, chains, hook_fn, diagnostics(), summary(), Predictive -----------------------------


@pytest.mark.parametrize("num_chains", [1, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_draws_are_the_conjugate_posterior_in_every_shape_the_driver_returns(config, num_chains):
    mcmc, kernel, _ = reference_run(config, num_chains)
    by_chain = mcmc.get_samples(group_by_chain=True)["t"]
    assert by_chain.shape == (num_chains, DRAWS, K) and by_chain.dtype == f64
    flat = mcmc.get_samples()["t"]
    assert torch.equal(flat, by_chain.reshape(-1, K))
    some = mcmc.get_samples(num_samples=50)["t"]  # drawn from the pooled draws
    assert some.shape == (50, K) and all((row == flat).all(1).any() for row in some)
    if num_chains > 1:
        assert not torch.equal(by_chain[0], by_chain[1])
    assert_posterior(by_chain)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_hook_fn_sees_every_transition_in_order_with_the_recorded_draws(config):
    mcmc, kernel, records = reference_run(config, 2)
    by_chain = mcmc.get_samples(group_by_chain=True)["t"]
    expected = [
        (f"{stage} [{c}]", i)
        for c in range(2)
        for stage, n in (("Warmup", WARMUP), ("Sample", DRAWS))
        for i in range(n)
    ]
    assert [(stage, i) for stage, i, _, _ in records] == expected
    assert all(k is kernel for _, _, k, _ in records)
    hooked = [p["t"] for stage, _, _, p in records if stage.startswith("Sample")]
    assert torch.equal(torch.stack(hooked).reshape(2, DRAWS, K), by_chain)
    one, _, one_records = reference_run(config, 1)  # one chain: stages without a chain index
    assert {stage for stage, *_ in one_records} == {"Warmup", "Sample"}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_diagnostics_hold_pyros_statistics_and_the_kernels_per_chain(config):
    mcmc, kernel, _ = reference_run(config, 2)
    diag = mcmc.diagnostics()
    by_chain = mcmc.get_samples(group_by_chain=True)["t"]
    torch.testing.assert_close(
        diag["t"]["n_eff"], effective_sample_size(by_chain, chain_dim=0, sample_dim=1)
    )
    assert diag["t"]["r_hat"].shape == (K,) and (diag["t"]["r_hat"] < 1.1).all()
    chains = ["chain 0", "chain 1"]
    assert diag["divergences"] == {c: [] for c in chains}  # every transition moves
    assert diag["acceptance rate"] == {c: 1.0 for c in chains}
    assert set(diag["evaluations per draw"]) == set(chains)
    assert all(v >= 1.0 for v in diag["evaluations per draw"].values())
    if kernel.rng == "chains":
        assert all(v >= 1.0 for v in diag["passes per draw"].values())


@pytest.mark.parametrize("config", list(CONFIGS))
def test_summary_prints_the_posterior_and_no_divergences(config, capsys):
    mcmc, _, _ = reference_run(config, 2)
    mcmc.summary(prob=0.9)
    out = capsys.readouterr().out
    assert "Number of divergences: 0" in out
    rows = {
        m.group(1): [float(v) for v in m.group(2).split()]
        for m in re.finditer(r"^\s*(t\[\d\])((?:\s+-?\d+\.\d+){7})\s*$", out, re.M)
    }
    assert set(rows) == {"t[0]", "t[1]"}
    by_chain = mcmc.get_samples(group_by_chain=True)["t"]
    ess = effective_sample_size(by_chain, chain_dim=0, sample_dim=1)
    sd = COV.diagonal().sqrt()
    for j in range(K):
        mean, std = rows[f"t[{j}]"][:2]
        # printed to 2 decimals: a rounding error of 0.005 beside the Monte Carlo error
        assert abs(mean - MEAN[j]) <= 4 * sd[j] / ess[j].sqrt() + 0.005
        assert abs(mean - by_chain[..., j].mean()) <= 0.005


@pytest.mark.parametrize("config", list(CONFIGS))
def test_predictive_from_the_draws_is_the_posterior_predictive(config):
    """``Predictive(model, posterior_samples)``: at new inputs ``x*`` the draws of ``obs`` have
    mean ``x* μ`` and variance ``x* Σ x*ᵀ + σ²`` (the conjugate posterior predictive)."""
    mcmc, _, _ = reference_run(config, 2)
    samples = mcmc.get_samples()
    x_new = torch.tensor([[1.0, 0.0], [0.5, -1.0]], dtype=f64)
    pyro.set_rng_seed(2)
    pred = Predictive(model, posterior_samples=samples, return_sites=["obs", "t"])(x_new)
    assert pred["obs"].shape == (2 * DRAWS, 2)
    # the given draws, not new ones (Predictive adds a batch dimension of 1 to a latent)
    assert torch.equal(pred["t"].reshape(samples["t"].shape), samples["t"])
    mean = x_new @ MEAN
    f_var = (x_new @ COV * x_new).sum(-1)
    ess = effective_sample_size(mcmc.get_samples(group_by_chain=True)["t"] @ x_new.T, 0, 1)
    # the noise draws are independent; the draws of x* t have ESS ess
    se = (f_var / ess + SIGMA**2 / (2 * DRAWS)).sqrt()
    assert ((pred["obs"].mean(0) - mean).abs() <= 4 * se).all()
    resid = pred["obs"] - mean
    var = f_var + SIGMA**2
    se_var = 2**0.5 * var / ess.sqrt()  # bounded by the less independent part
    assert ((resid.pow(2).mean(0) - var).abs() <= 4 * se_var).all()


# --- StreamingMCMC -------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_streaming_mcmc_streams_the_same_draws_as_mcmc(config):
    """StreamingMCMC (sequential chains, statistics only): with the same seed its per-chain
    means and variances are those of MCMC's draws (checked against the posterior above), and
    its diagnostics carry the kernel's per-chain entries."""
    mcmc, _, _ = reference_run(config, 2)
    by_chain = mcmc.get_samples(group_by_chain=True)["t"]
    kernel, args = CONFIGS[config]()
    pyro.set_rng_seed(11)
    streaming = StreamingMCMC(
        kernel, num_samples=DRAWS, warmup_steps=WARMUP, num_chains=2, disable_progbar=True
    )
    streaming.run(*args)
    stats = streaming.get_statistics(group_by_chain=True)
    for c in range(2):
        torch.testing.assert_close(stats[(c, "t")]["mean"], by_chain[c].mean(0))
        torch.testing.assert_close(stats[(c, "t")]["variance"], by_chain[c].var(0))
    merged = streaming.get_statistics(group_by_chain=False)["t"]
    torch.testing.assert_close(merged["mean"], by_chain.reshape(-1, K).mean(0))
    diag = streaming.diagnostics()
    assert diag["t"]["r_hat"].shape == (K,) and (diag["t"]["r_hat"] < 1.1).all()
    assert diag["divergences"] == {"chain 0": [], "chain 1": []}


# --- transforms, disable_validation, save_params --------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_transforms_map_the_draws_back(config):
    """``MCMC(transforms={site: T})`` returns ``T⁻¹`` of the kernel's draws (the kernel's own
    ``transforms`` is empty: a Gaussian latent is already unconstrained)."""
    mcmc, _, _ = reference_run(config, 1)
    draws = mcmc.get_samples()["t"][:50]
    kernel, args = CONFIGS[config]()
    assert kernel.transforms == {}
    T = dist.transforms.AffineTransform(1.0, 2.0)
    pyro.set_rng_seed(11)
    run = MCMC(kernel, 50, WARMUP, transforms={"t": T}, disable_progbar=True)
    run.run(*args)
    torch.testing.assert_close(run.get_samples()["t"], (draws - 1.0) / 2.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("setting", [True, False, None])
def test_disable_validation_is_applied_during_the_run_and_leaves_the_draws(config, setting):
    mcmc, _, _ = reference_run(config, 1)
    draws = mcmc.get_samples()["t"][:20]
    seen = []

    def hook(kernel, params, stage, i):
        seen.append(poutine.util.is_validation_enabled())

    kernel, args = CONFIGS[config]()
    pyro.set_rng_seed(11)
    pyro.enable_validation(True)  # the global setting (None keeps it)
    run = MCMC(
        kernel, 20, WARMUP, hook_fn=hook, disable_validation=setting, disable_progbar=True
    )
    run.run(*args)
    want = True if setting is None else not setting
    assert set(seen) == {want} and poutine.util.is_validation_enabled()
    torch.testing.assert_close(run.get_samples()["t"], draws, rtol=0, atol=1e-12)


def two_latents():
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    pyro.sample("obs", dist.Normal(a + b, 1.0), obs=torch.tensor(3.0))


@pytest.mark.parametrize("save_params", [["a"], ["b"], ["a", "b"]])
def test_save_params_keeps_the_named_sites_with_their_posterior(save_params):
    """``a, b ~ N(0, 1)``, ``3 ~ N(a + b, 1)``: each has posterior N(1, 2/3)."""
    kernel = EllipticalSliceSampler(two_latents)
    mcmc = MCMC(kernel, 600, 100, save_params=save_params, disable_progbar=True)
    mcmc.run()
    samples = mcmc.get_samples(group_by_chain=True)
    assert set(samples) == set(save_params)
    assert {"a", "b"} & set(mcmc.diagnostics()) == set(save_params)
    for site in save_params:
        assert_posterior(samples[site][..., None], torch.ones(1), torch.tensor([2 / 3]))


# --- initial_params, cleanup, reuse, chains without leftovers -------------------------------


def _manual_chain(kernel, args, start, steps, seed):
    """The chain Pyro's driver makes, written out: setup at ``start``, ``steps`` transitions."""
    pyro.set_rng_seed(seed)
    kernel.initial_params = start
    kernel.setup(0, *args)
    params, out = kernel.initial_params, []
    for _ in range(steps):
        params = kernel.sample(params)
        out.append(params["t"])
    kernel.cleanup()
    return torch.stack(out)


@pytest.mark.parametrize(
    "config",
    ["plain model", "plain prior+loglik", "generalised (chains=None)"],
)
def test_initial_params_start_the_run_and_do_not_outlive_it(config):
    """MCMC's ``initial_params`` start the chain (the run equals the chain written out from
    there), and ``cleanup`` forgets them: the kernel reused in a new ``MCMC`` draws what a new
    kernel draws (as HMC/NUTS, which clear them in ``cleanup``)."""
    if "generalised" in config:
        make = functools.partial(generalised, chains=None)
    else:
        make = CONFIGS[config]
    start = {"t": torch.tensor([3.0, -3.0], dtype=f64)}  # num_chains=1: no chain dimension
    kernel, args = make()
    starts = []

    def hook(kernel, params, stage, i):
        if i == 0:
            starts.append(kernel.initial_params["t"].clone())

    pyro.set_rng_seed(5)
    mcmc = MCMC(kernel, 10, 0, initial_params=start, hook_fn=hook, disable_progbar=True)
    mcmc.run(*args)
    assert torch.equal(starts[0], start["t"])  # the chain started there
    fresh, _ = make()
    want = _manual_chain(fresh, args, {"t": start["t"]}, 10, seed=5)
    torch.testing.assert_close(mcmc.get_samples()["t"], want, rtol=0, atol=1e-12)
    # cleanup forgot them: the same kernel in a new MCMC starts where a fresh one starts
    assert kernel.initial_params is None
    again = MCMC(kernel, 10, 0, disable_progbar=True)
    twin, _ = make()
    if kernel.rng == "chains":  # a seeded kernel numbers its chains: the twin's second one
        pyro.set_rng_seed(0)
        MCMC(twin, 10, 0, disable_progbar=True).run(*args)
    pyro.set_rng_seed(6)
    again.run(*args)
    pyro.set_rng_seed(6)
    other = MCMC(twin, 10, 0, disable_progbar=True)
    other.run(*args)
    assert torch.equal(again.get_samples()["t"], other.get_samples()["t"])
    assert not (again.get_samples()["t"] == start["t"]).all(1).any()


@pytest.mark.parametrize("config", ["plain model", "generalised (seed=None, chains=None)"])
def test_sequential_chains_carry_nothing_from_the_chain_before(config, monkeypatch):
    """Each chain re-seeded in its ``setup``: swapping the seeds swaps the chains exactly."""

    def make():
        if config == "plain model":
            return plain_model()
        return generalised(chains=None, seed=None)

    runs = []
    for seeds in ([0, 1], [1, 0]):
        kernel, args = make()
        setup = kernel.setup
        order = list(seeds)

        def reseeded(warmup_steps, *a, _setup=setup, _order=order, **kw):
            pyro.set_rng_seed(_order.pop(0))
            _setup(warmup_steps, *a, **kw)

        monkeypatch.setattr(kernel, "setup", reseeded)
        mcmc = MCMC(kernel, 30, 30, num_chains=2, disable_progbar=True)
        mcmc.run(*args)
        runs.append(mcmc.get_samples(group_by_chain=True)["t"])
    assert torch.equal(runs[0][0], runs[1][1]) and torch.equal(runs[0][1], runs[1][0])


@pytest.mark.parametrize("config", ["plain model", "plain prior+loglik", "generalised"])
def test_sample_from_a_position_a_direct_caller_gives(config):
    """``sample(params)`` with params other than the kernel's last state is the transition
    from those params: it equals a chain started there (plain), or the step function from
    there with the chain's own random stream (batched chains)."""
    other = {"t": torch.tensor([4.0, 4.0], dtype=f64)}  # deep in the tail: L(other) is tiny
    if config == "generalised":
        kernel, args = generalised(chains=None, seed=1)
        kernel.setup(0, *args)
        batch = kernel._batch
        ref = copy.deepcopy(batch.reference)  # the chain's generator, before the transition
        x = other["t"].numpy()[None]
        want, _ = elliptical_slice_step(SliceState(x, batch._log_target(x)), ref, batch._log_target)
        got = kernel.sample(other)["t"]
        np.testing.assert_array_equal(got.numpy(), want.position[0])
        # a chain of a batch that has gone past its step cannot be moved
        kernel, args = generalised(chains=2, seed=1)
        kernel.setup(0, *args)
        kernel.sample(kernel.initial_params)
        kernel.cleanup()
        kernel.setup(0, *args)  # chain 1: its step 1 is computed already
        with pytest.raises(ValueError, match="params: chain 1 of 2 chains"):
            kernel.sample(other)
        return
    kernel, args = CONFIGS[config]()
    kernel.setup(0, *args)
    kernel.sample(kernel.initial_params)
    pyro.set_rng_seed(8)
    got = kernel.sample(other)["t"]
    twin, _ = CONFIGS[config]()
    twin.initial_params = other
    twin.setup(0, *args)
    pyro.set_rng_seed(8)
    want = twin.sample(twin.initial_params)["t"]
    assert torch.equal(got, want)
    # a state changed in place (say by a hook_fn) is a new position too
    state = twin.sample(twin.initial_params)
    state["t"].copy_(other["t"])
    pyro.set_rng_seed(8)
    assert torch.equal(twin.sample(state)["t"], want)


# --- models: masked latents, subsampling, invalid models, no latent sites ------------------


def masked_latent(y):
    with poutine.mask(mask=False):
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(x, 1.0), obs=y)


def partly_masked_latent(y):
    with poutine.mask(mask=torch.tensor([True, False])):
        x = pyro.sample("x", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    pyro.sample("y", dist.Normal(x.sum(), 1.0), obs=y)


def scaled_latent(y):
    with poutine.scale(scale=0.5):
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(x, 1.0), obs=y)


def obs_masked(y):
    with pyro.plate("data", 3):
        pyro.sample("y", dist.Normal(0.0, 1.0), obs=y, obs_mask=torch.tensor([True, False, True]))


@pytest.mark.parametrize(
    "bad, site, what",
    [
        (masked_latent, "x", r"poutine.mask \(mask=False\)"),
        (partly_masked_latent, "x", r"poutine.mask \(a partial mask\)"),
        (scaled_latent, "x", r"poutine.scale \(scale 0.5\)"),
        (obs_masked, "y_unobserved", r"poutine.mask \(a partial mask\)"),
    ],
)
def test_a_latent_whose_density_a_handler_changes_is_refused(bad, site, what):
    """The issue's case: ``x ~ N(0, 1)`` under ``poutine.mask(mask=False)`` with one observation
    3.0 has the posterior N(3, 1) (no prior density), not the N(1.5, 1/2) that sampling under
    the Gaussian prior gives: the kernel refuses such a latent before sampling."""
    mcmc = MCMC(EllipticalSliceSampler(bad), 10, 10, disable_progbar=True)
    with pytest.raises(UnsupportedModelError, match=f"site '{site}': .*{what}") as info:
        mcmc.run(torch.tensor([3.0, 0.0, 1.0]) if bad is obs_masked else torch.tensor(3.0))
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


def masked_observations(y):
    x = pyro.sample("x", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 2), poutine.mask(mask=torch.tensor([True, False])):
        pyro.sample("y", dist.Normal(x, 1.0), obs=y)


def unmasked_latent(y):
    with poutine.mask(mask=True):
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(x, 1.0), obs=y)


@pytest.mark.parametrize(
    "good, y, mean, var",
    [
        (masked_observations, [3.0, -10.0], 1.5, 0.5),  # only y₁ = 3 counts
        (unmasked_latent, 3.0, 1.5, 0.5),  # an all-true mask changes nothing
    ],
)
def test_masks_that_keep_the_gaussian_prior_are_honoured(good, y, mean, var):
    mcmc = MCMC(EllipticalSliceSampler(good), 600, 100, num_chains=1, disable_progbar=True)
    mcmc.run(torch.tensor(y))
    draws = mcmc.get_samples(group_by_chain=True)["x"][..., None]
    assert_posterior(draws, torch.tensor([mean]), torch.tensor([var]))


def subsampled_plate():
    with pyro.plate("J", 10, subsample_size=5):
        pyro.sample("x", dist.Normal(0.0, 1.0))


def subsampled_by_indices(y):
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    with pyro.plate("data", 10, subsample=torch.arange(3)) as idx:
        pyro.sample("y", dist.Normal(a, 1.0), obs=y[idx])


@pytest.mark.parametrize(
    "bad, args, kwargs, what",
    [
        (subsampled_plate, (), {}, "plate 'J' subsamples 5 of 10"),
        (subsampled_by_indices, (torch.zeros(10),), {}, "plate 'data' subsamples 3 of 10"),
        (model, (X, Y), {"subsample_size": 4}, "subsample_size: "),
    ],
)
def test_subsampled_models_are_refused_as_pyro_refuses_them(bad, args, kwargs, what):
    """Pyro's kernels raise a ``RuntimeError`` naming subsampling; ours is also the
    ``ValueError`` it was (`SubsamplingError`)."""
    for error in (NotImplementedError, RuntimeError, ValueError):
        mcmc = MCMC(EllipticalSliceSampler(bad), 10, 10, disable_progbar=True)
        with pytest.raises(error, match=what) as info:
            mcmc.run(*args, **kwargs)
        assert isinstance(info.value, SubsamplingError) and "subsample" in str(info.value)


def lognormal_prior():
    pyro.sample("x", dist.LogNormal(0.0, 1.0))


def dependent_prior():
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    pyro.sample("b", dist.Normal(a, 1.0))


@pytest.mark.parametrize("bad", [lognormal_prior, dependent_prior])
def test_invalid_models_raise_value_error_as_pyros_kernels_do(bad):
    mcmc = MCMC(EllipticalSliceSampler(bad), 10, 10, disable_progbar=True)
    with pytest.raises(ValueError, match="site '(x|b)'") as info:
        mcmc.run()
    assert isinstance(info.value, TypeError)  # what the kernel raised before


def no_latents():
    pyro.sample("obs", dist.Normal(0.0, 1.0), obs=torch.tensor(0.5))
    return torch.tensor(1.0)


@pytest.mark.parametrize("driver", [MCMC, StreamingMCMC])
@pytest.mark.parametrize("num_chains", [1, 2])
def test_a_model_without_latent_sites_gives_empty_draws_and_calls_the_hook(driver, num_chains):
    stages = []

    def hook(kernel, params, stage, i):
        assert params == {}
        stages.append((stage, i))

    mcmc = driver(
        EllipticalSliceSampler(no_latents), 5, 4, num_chains=num_chains, hook_fn=hook,
        disable_progbar=True,
    )  # fmt: skip
    mcmc.run()
    if driver is MCMC:
        assert mcmc.get_samples() == {}
    else:
        assert mcmc.get_statistics() == {}
    label = [""] if num_chains == 1 else [f" [{c}]" for c in range(num_chains)]
    assert stages == [
        (f"{stage}{c}", i) for c in label for stage, n in (("Warmup", 4), ("Sample", 5))
        for i in range(n)
    ]  # fmt: skip


# --- pickling and Pyro's multiprocessing driver ---------------------------------------------


def _pickled_forms():
    from torch import nn

    from pyro_subspace import SubspaceNet, likelihoods
    from pyro_subspace.infer import GeneralizedEllipticalSliceSampler
    from pyro_subspace.subspaces import Subspace

    net = nn.Linear(K, 1, bias=False).double()
    sub = Subspace(torch.zeros(K, dtype=f64), torch.eye(K, dtype=f64))
    net_model = SubspaceNet(net, sub, likelihoods.Gaussian(SIGMA), prior_scale=PRIOR)
    free = {"prior": prior(), "log_likelihood": log_likelihood}
    with pytest.warns(DeprecationWarning):
        alias = GeneralizedEllipticalSliceSampler(**free, seed=0)
    return {
        "Pyro model": (EllipticalSliceSampler(model), (X, Y)),
        "prior+loglik": (EllipticalSliceSampler(**free), ()),
        "prior+loglik, rng='chains'": (EllipticalSliceSampler(**free, rng="chains", seed=0), ()),
        "warmup reference, df, chains": (
            EllipticalSliceSampler(**free, reference="warmup", df=4, chains=2, seed=0), ()
        ),
        "(μ, Σ) reference": (EllipticalSliceSampler(**free, reference=(MEAN, COV), seed=0), ()),
        "Gaussian reference": (
            EllipticalSliceSampler(**free, reference=dist.MultivariateNormal(MEAN, COV), seed=0),
            (),
        ),
        "SubspaceNet": (EllipticalSliceSampler(net_model), (X, Y)),
        "SubspaceNet, laplace": (EllipticalSliceSampler(net_model, reference="laplace"), None),
        "deprecated alias": (alias, ()),
    }


def _draws(kernel, args):
    pyro.set_rng_seed(4)
    num_chains = kernel.chains or 1
    mcmc = MCMC(kernel, 5, 3, num_chains=num_chains, disable_progbar=True)
    mcmc.run(*args)
    return mcmc.get_samples()["t"]


def test_every_constructor_form_pickles_before_and_after_a_run():
    """A pickled kernel (what Pyro's driver sends to a ``spawn`` worker) draws what the
    original draws; pickled after a run (whose state does not travel), what the original's
    next run draws."""
    for name, (kernel, args) in _pickled_forms().items():
        copy = pickle.loads(pickle.dumps(kernel))
        if args is None:  # the Laplace fit: pickling only (tests/test_gess.py samples it)
            continue
        assert torch.equal(_draws(copy, args), _draws(kernel, args)), name
        after = pickle.loads(pickle.dumps(kernel))
        assert torch.equal(_draws(after, args), _draws(kernel, args)), name


def _hook_to_file(path, kernel, params, stage, i):
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {stage} {i}\n")


@pytest.mark.parametrize(
    "context, config",
    [
        ("spawn", "plain prior+loglik"),
        ("spawn", "generalised"),
        ("fork", "plain model"),
        ("fork", "plain prior+loglik"),
        ("fork", "generalised"),
    ],
)
def test_pyros_multiprocessing_driver(context, config, workers, tmp_path):
    """Two chains in two worker processes (``mp_context``; with ``spawn`` the kernel, the
    model and ``log_likelihood`` are pickled): the draws are the posterior, the chains
    differ, each worker called the hook (a module-level function, it pickles too) for all of
    its transitions, and the driver collected the kernel's diagnostics from both."""
    warmup, draws = 50, 300
    kernel, args = CONFIGS[config]()
    log = tmp_path / "hook.txt"
    mcmc = MCMC(
        kernel,
        draws,
        warmup,
        num_chains=2,
        mp_context=context,
        hook_fn=functools.partial(_hook_to_file, str(log)),
        disable_progbar=True,
    )
    assert isinstance(mcmc.sampler, api._MultiSampler)
    mcmc.run(*args)
    by_chain = mcmc.get_samples(group_by_chain=True)["t"]
    assert by_chain.shape == (2, draws, K) and not torch.equal(by_chain[0], by_chain[1])
    assert_posterior(by_chain)
    calls = {}  # per worker process: its hook calls, in order (a worker labels no chain)
    for line in log.read_text().splitlines():
        pid, stage, i = line.split()
        calls.setdefault(pid, []).append((stage, int(i)))
    expected = [("Warmup", i) for i in range(warmup)] + [("Sample", i) for i in range(draws)]
    assert len(calls) == 2 and str(os.getpid()) not in calls
    assert all(c == expected for c in calls.values())
    diag = mcmc.diagnostics()
    assert diag["divergences"] == {"chain 0": [], "chain 1": []}
    assert kernel.initial_params is None  # the main process's kernel is untouched
