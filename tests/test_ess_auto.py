"""EllipticalSliceSampler(reference="auto"): Nishihara et al.'s two-group population scheme.

The kernel leaves a banana-shaped target invariant (chains started at exact draws stay exact;
chains started at the prior reach its moments), each within 4 Monte Carlo standard errors from
ArviZ's effective sample sizes, against moments by one-dimensional quadrature; its arguments
are refused with messages that name them, Pyro's worker processes are refused with the way out
(`one_process`), and the caller's global random state is untouched.
"""

import math
import os
import random
import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC

from pyro_subspace.infer.chain_batch import Population
from pyro_subspace.infer.ess import EllipticalSliceSampler, one_process

f64 = torch.float64
PRIOR_SD, BEND, NOISE = 3.0, 0.5, 0.1  # π(t) ∝ N(t | 0, 9 I) exp(-t0²/2 - (t1 - b t0²)²/(2 s²))


def loglik(t):
    """``(B, 2) -> (B,)``: the banana's likelihood part (the prior is the kernel's)."""
    return -0.5 * t[..., 0] ** 2 - 0.5 * (t[..., 1] - BEND * t[..., 0] ** 2) ** 2 / NOISE**2


def prior():
    return dist.Normal(torch.zeros(2, dtype=f64), PRIOR_SD).to_event(1)


def kernel(chains=16, **kwargs):
    return EllipticalSliceSampler(
        prior=prior(), log_likelihood=loglik, reference="auto", chains=chains, **kwargs
    )


# --- the target, independently: t0's marginal on a grid, t1 | t0 Gaussian -------------------

V1 = 1 / (1 / PRIOR_SD**2 + 1 / NOISE**2)  # var(t1 | t0)
SHRINK = V1 / NOISE**2  # E[t1 | t0] = SHRINK · b t0²
GRID = np.linspace(-8, 8, 200_001)


def t0_density():
    """t0's marginal density on `GRID`: N(t0 | 0, 9) N(t0 | 0, 1) N(b t0² | 0, 9 + s²)."""
    log = -0.5 * GRID**2 / PRIOR_SD**2 - 0.5 * GRID**2
    log = log - 0.5 * (BEND * GRID**2) ** 2 / (PRIOR_SD**2 + NOISE**2)
    p = np.exp(log - log.max())
    return p / np.trapezoid(p, GRID)


def exact_moments():
    """``E[t0], E[t1], E[t0²], E[t1²]`` by quadrature over t0 (the t1 part in closed form)."""
    p = t0_density()
    m = lambda f: np.trapezoid(f * p, GRID)
    e2, e4 = m(GRID**2), m(GRID**4)
    return np.array([0.0, SHRINK * BEND * e2, e2, V1 + (SHRINK * BEND) ** 2 * e4])


def exact_draws(n, seed):
    """``(n, 2)`` independent draws of π: t0 by inverse CDF on `GRID`, t1 | t0 Gaussian."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(t0_density())
    t0 = np.interp(rng.random(n), cdf / cdf[-1], GRID)
    t1 = SHRINK * BEND * t0**2 + math.sqrt(V1) * rng.standard_normal(n)
    return np.stack([t0, t1], 1)


def assert_moments(by_chain):
    """The four moments within 4 Monte Carlo standard errors (ArviZ's MCSE of the mean of each
    transformed draw, from its effective sample size)."""
    t = by_chain.numpy()
    funcs = {"t0": t[..., 0], "t1": t[..., 1], "t0²": t[..., 0] ** 2, "t1²": t[..., 1] ** 2}
    idata = az.from_dict(posterior=funcs)
    mcse = az.mcse(idata, method="mean")
    for (name, draws), expected in zip(funcs.items(), exact_moments()):
        err = float(mcse[name])
        assert abs(draws.mean() - expected) <= 4 * err, (name, draws.mean(), expected, err)
        assert err < 0.05 * draws.std(), (name, err)  # informative: an effective size > 400


def test_the_quadrature_moments_are_those_of_exact_draws():
    """The test's own target, checked once: 10⁶ exact draws agree with the quadrature."""
    x = exact_draws(1_000_000, seed=0)
    sample = np.array(
        [x[:, 0].mean(), x[:, 1].mean(), (x[:, 0] ** 2).mean(), (x[:, 1] ** 2).mean()]
    )
    sd = np.array([x[:, 0].std(), x[:, 1].std(), (x[:, 0] ** 2).std(), (x[:, 1] ** 2).std()])
    assert (np.abs(sample - exact_moments()) <= 4 * sd / 1000).all()


def test_chains_started_at_exact_draws_stay_exact():
    """Invariance: 32 chains started at independent draws of π, no warm-up; every later state
    is a draw of π whatever the mixing."""
    kern = kernel(chains=32, seed=1)
    kern.initial_params = {"t": torch.from_numpy(exact_draws(32, seed=2))}
    mcmc = MCMC(kern, num_samples=300, warmup_steps=0, num_chains=32, disable_progbar=True)
    mcmc.run()
    assert_moments(mcmc.get_samples(group_by_chain=True)["t"])


@pytest.mark.slow
def test_chains_from_the_prior_reach_the_banana():
    kern = kernel(chains=16, seed=3)
    mcmc = MCMC(kern, num_samples=800, warmup_steps=200, num_chains=16, disable_progbar=True)
    mcmc.run()
    assert_moments(mcmc.get_samples(group_by_chain=True)["t"])
    diag = mcmc.diagnostics()
    assert set(diag["reference df"]) == {f"chain {c}" for c in range(16)}
    nus = np.concatenate(list(diag["reference df"].values()))
    assert np.isfinite(nus).all() and (nus > 0).all()  # ν under its Gamma prior: finite


@pytest.mark.parametrize("df", [5, 7.5, math.inf])
def test_a_fixed_df_is_used_in_every_fit(df):
    kern = kernel(chains=8, seed=4, df=df)
    mcmc = MCMC(kern, num_samples=20, warmup_steps=5, num_chains=8, disable_progbar=True)
    mcmc.run()
    refs = kern._batch.refs
    assert all(d == df for ref in refs for d in ref.df)
    assert all(f[3] == df for f in kern._batch.fits)


def test_two_populations_of_two_groups_each_fitted_to_the_other():
    """The layout (population-major, group 0 the first half) and the fit: a group's reference
    is the t fitted to the other group of its own population, at their states after the sweep's
    first half."""
    from pyro_subspace.infer.chain_batch import DF_PRIOR, FIT_MAX_ITER, FIT_STATES, FIT_TOL
    from pyro_subspace.infer.student_t import fit_multivariate_t

    kern = kernel(chains=8, seed=5)
    kern.setup(0)
    batch = kern._batch
    assert isinstance(batch, Population)
    assert batch.population == [0, 0, 0, 0, 1, 1, 1, 1]
    assert batch.groups == [[0, 1, 4, 5], [2, 3, 6, 7]]
    before = batch.x.copy()
    batch.advance()
    # the prior's covariance (its Cholesky factor carries a jitter of 1e-12 of the diagonal)
    np.testing.assert_allclose(batch.fallback, np.diag([PRIOR_SD**2] * 2), rtol=1e-11)
    assert batch.fallback_loc is None  # model=None: no location to shrink towards
    fallback = batch.fallback
    for group, rows in enumerate(batch.groups):
        for p in (0, 1):
            other = [c for c in batch.groups[1 - group] if batch.population[c] == p]
            states = before[other] if group == 0 else batch.x[other]
            fit = fit_multivariate_t(
                states, fallback=fallback, fallback_loc=batch.fallback_loc,
                min_states=FIT_STATES * 4, df_prior=DF_PRIOR,
                tol=FIT_TOL, max_iter=FIT_MAX_ITER,
            )  # fmt: skip
            mine = [i for i, c in enumerate(rows) if batch.population[c] == p]
            ref = batch.refs[group]
            np.testing.assert_allclose(ref.mu[mine], np.broadcast_to(fit.loc, (2, 2)))
            np.testing.assert_allclose(ref.tril[mine[0]] @ ref.tril[mine[0]].T, fit.scale)
            assert ref.df[mine[0]] == fit.df
    kern.cleanup()


def test_same_seed_same_draws_and_the_callers_random_state_untouched():
    def run():
        kern = kernel(chains=8, seed=6)
        mcmc = MCMC(kern, num_samples=30, warmup_steps=10, num_chains=8, disable_progbar=True)
        mcmc.run()
        return mcmc.get_samples()["t"]

    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    state = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    first = run()
    assert torch.equal(torch.get_rng_state(), state[0])
    assert np.array_equal(np.random.get_state()[1], state[1]) and random.getstate() == state[2]
    torch.manual_seed(8)  # another caller state: a seeded kernel draws the same
    assert torch.equal(run(), first)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"chains": None}, ValueError, r"chains: reference='auto' .* multiple of 4"),
        ({"chains": 6}, ValueError, r"chains: reference='auto' .* multiple of 4 .*got 6"),
        ({"adapt": True}, ValueError, "adapt: not applicable with reference='auto'"),
        ({"adapt": False}, ValueError, "adapt: not applicable with reference='auto'"),
        ({"df": 0}, ValueError, r"df: expected None \(fitted\) or a positive number"),
        ({"repeats": 0}, ValueError, "repeats"),
    ],
)
def test_arguments_are_named(kwargs, error, match):
    args = {"chains": 8, **kwargs}
    with pytest.raises(error, match=match):
        kernel(**args)


def test_repeats_only_with_auto():
    with pytest.raises(ValueError, match="repeats: .* reference='laplace' takes none"):
        EllipticalSliceSampler(prior=prior(), log_likelihood=loglik, reference="laplace", repeats=2)


def test_a_worker_process_is_refused_with_the_way_out(monkeypatch):
    kern = kernel(chains=8, seed=0)
    kern._pid = os.getpid() + 1  # as in a worker of Pyro's multiprocessing driver
    with pytest.raises(RuntimeError, match=r"worker process.*one_process\(MCMC\(kernel"):
        kern.setup(0)


def test_one_process_keeps_pyros_parallel_driver_in_this_process(monkeypatch):
    from pyro.infer.mcmc import api

    monkeypatch.setattr(api.mp, "cpu_count", lambda: 64)  # Pyro would start 8 workers
    kern = kernel(chains=8, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mcmc = MCMC(kern, num_samples=10, warmup_steps=5, num_chains=8, disable_progbar=True)
    assert isinstance(mcmc.sampler, api._MultiSampler)
    assert one_process(mcmc) is mcmc and isinstance(mcmc.sampler, api._UnarySampler)
    mcmc.run()
    assert mcmc.get_samples(group_by_chain=True)["t"].shape == (8, 10, 2)
    with pytest.raises(TypeError, match="mcmc: expected a pyro.infer.MCMC"):
        one_process(kern)


def test_a_subspace_net_starts_at_draws_of_its_laplace_fit():
    """With a SubspaceNet the population starts at draws of the Laplace fit and its fits count
    pseudo-states with the Laplace mean and covariance."""
    from torch import nn

    from pyro_subspace import SubspaceNet, likelihoods
    from pyro_subspace.infer import AutoSubspaceLaplace
    from pyro_subspace.subspaces import Subspace

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 2, generator=gen, dtype=f64)
    y = x @ torch.tensor([1.0, -0.5], dtype=f64) + 0.3 * torch.randn(30, generator=gen, dtype=f64)
    net = nn.Linear(2, 1, bias=False).double()
    model = SubspaceNet(
        net, Subspace(torch.zeros(2, dtype=f64), torch.eye(2, dtype=f64)),
        likelihoods.Gaussian(0.3), prior_scale=1.0, temperature=1.0,
    )  # fmt: skip
    guide = AutoSubspaceLaplace(model).fit(x, y)
    kern = EllipticalSliceSampler(model, reference="auto", chains=8, seed=0)
    pyro.set_rng_seed(0)
    kern.setup(0, x, y)
    batch = kern._batch
    np.testing.assert_allclose(batch.fallback, guide.covariance.double().numpy(), rtol=1e-6)
    np.testing.assert_allclose(batch.fallback_loc, guide.loc.double().numpy(), rtol=1e-6)
    kern.cleanup()
