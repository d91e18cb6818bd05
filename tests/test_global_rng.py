"""No library call re-seeds the caller's global random state.

Every public entry point that takes a seed or draws random numbers runs after the caller seeds
torch, NumPy and Python's ``random`` with ``a`` and again with ``b``. Nothing may re-seed: the
states after the call differ between ``a`` and ``b`` (as they did before it), generator by
generator, and CUDA's (its devices' states, or, before CUDA starts, the seed torch holds for it)
is the caller's. Calls given an explicit seed (``pure``) leave every global state exactly as it
was before them.
"""

import random

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from torch import nn

from pyro_subspace import (
    EllipticalSliceSampler,
    PatchedNet,
    convert,
    datasets,
    fit_map,
    likelihoods,
    rng,
    subspaces,
)
from pyro_subspace.infer import (
    SWAG,
    Laplace,
    run_chains,
    train_ensemble,
)

CALLER_SEEDS = (11, 12)


def _seed_caller(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _cuda_state():
    """CUDA's part of the global state: the devices' states once CUDA is initialised, else the
    seed callbacks torch holds until it starts (compared by identity)."""
    if torch.cuda.is_initialized():
        return tuple(bytes(s.numpy()) for s in torch.cuda.get_rng_state_all())
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    if tracker is None:
        return None
    return tuple(
        None if c is None else id(c) for c in (tracker.manual_seed_all_cb, tracker.manual_seed_cb)
    )


def _snapshot():
    """``{generator: comparable state}``; ``"_alive"`` keeps CUDA's pending callbacks alive so
    that their ids stay unique while compared."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    return {
        "torch": bytes(torch.get_rng_state().numpy()),
        "numpy": (name, keys.tobytes(), pos, has_gauss, cached),
        "random": random.getstate(),
        "cuda": _cuda_state(),
        "_alive": None if tracker is None else (tracker.manual_seed_all_cb, tracker.manual_seed_cb),
    }


GENERATORS = ("torch", "numpy", "random", "cuda")


# ---------------------------------------------------------------------------------- problems


def _data(n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=gen)
    return x, (torch.arange(n) % 3)


def _net():
    with rng.seeded(0, numpy=False, python=False):
        return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3))


def _collector(net, x, y):
    col = subspaces.SWACollector(net)
    with rng.seeded(0):
        fit_map(net, likelihoods.Categorical(), x, y, epochs=0, collector=col, swa_epochs=3,
                swa_lr=0.05, seed=0, progress=False)  # fmt: skip
    return col


def _pyro_model(x, y=None):
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    with pyro.plate("n", x.shape[0]):
        pyro.sample("obs", dist.Normal(a * x[:, 0], 1.0), obs=y)


def _setup_train_ensemble():
    x, y = _data()

    def make_net():
        return nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3))

    return lambda: train_ensemble(
        make_net, likelihoods.Categorical(), x, y, seeds=[3, 4], progress=False,
        collector=True, swa_epochs=2, epochs=2, batch_size=6,
    )  # fmt: skip


def _setup_to_inference_data(seed):
    x, y = _data()
    samples = {"a": torch.linspace(-1, 1, 6)}
    return lambda: convert.to_inference_data(
        samples=samples, model=_pyro_model, args=(x, y[:].float()), seed=seed
    )


def _setup_subnetwork(seed):
    net = _net()
    return lambda: subspaces.subnetwork(net, 5, strategy="random", seed=seed)


def _setup_random_subspace(seed):
    net = _net()
    return lambda: subspaces.random(net, 2, seed=seed)


def _setup_run_chains():
    def chain(i):
        return torch.randn(2), np.random.rand(), random.random()

    return lambda: run_chains(chain, 2, seed=5, processes=0)


def _setup_laplace(with_generator):
    x, y = _data()
    with rng.seeded(0):
        la = Laplace(_net(), likelihoods.Categorical(), "last_layer", hessian_structure="full").fit(x, y)
    if with_generator:
        return lambda: la.sample(4, torch.Generator().manual_seed(0))
    return lambda: la.sample(4)


def _setup_swag(seed):
    x, y = _data()
    swag = SWAG(_collector(_net(), x, y), likelihoods.Categorical(), seed=seed, num_samples=3)
    return lambda: swag.sample_weights()


def _setup_swag_predict():
    x, y = _data()
    swag = SWAG(_collector(_net(), x, y), likelihoods.Categorical(), seed=2, num_samples=3)
    return lambda: swag.predict(x[:3]).probs


def _conjugate():
    prior = dist.Normal(torch.zeros(2, dtype=torch.float64), 1.0).to_event(1)

    def loglik(t):
        return -0.5 * ((t - 0.5) ** 2).sum(-1)

    return prior, loglik


def _setup_ess():
    prior, loglik = _conjugate()

    return lambda: _two_steps(
        EllipticalSliceSampler(None, prior=prior, log_likelihood=lambda t: float(loglik(t)))
    )


def _two_steps(kernel):
    """Set up an MCMC kernel and take two transitions."""
    kernel.setup(0)
    params = kernel.initial_params
    for _ in range(2):
        params = kernel.sample(params)
    return params


def _setup_gess(seed):
    prior, loglik = _conjugate()

    return lambda: _two_steps(
        EllipticalSliceSampler(
            prior=prior, log_likelihood=loglik, reference="prior", seed=seed, rng="chains"
        )
    )


def _setup_fit_map(seed):
    x, y = _data()
    net = _net()
    return lambda: fit_map(net, likelihoods.Categorical(), x, y, epochs=2, batch_size=5,
                           seed=seed, progress=False)  # fmt: skip


def _setup_pca():
    x, y = _data()
    col = _collector(_net(), x, y)
    return lambda: subspaces.pca(col, 2, seed=0)


def _setup_patched_net():
    net = _net()
    return lambda: PatchedNet(net, likelihoods.Categorical(), n_components=2, seed=4)


def _setup_linearized_mc():
    x, y = _data()
    with rng.seeded(0):
        la = Laplace(_net(), likelihoods.Categorical(), "last_layer", hessian_structure="full").fit(x, y)
    from pyro_subspace.infer import linearized_predictive

    return lambda: linearized_predictive(la.guide, x, link_approx="mc", num_samples=20, seed=3)


def _setup_mola_sample():
    from pyro_subspace.infer import MixtureOfLaplace

    x, y = _data()
    with rng.seeded(0):
        mola = MixtureOfLaplace([_net(), _net()], likelihoods.Categorical()).fit(x, y)
    return lambda: mola.predict(x, method="sample", num_samples=5, seed=2)


def _setup_patched_fit():
    x, y = _data()
    return lambda: PatchedNet(_net(), likelihoods.Categorical(), n_components=2, seed=4).fit(
        x, y, epochs=1, batch_size=6, seed=5
    )


def _setup_ggn_eigen():
    x, _ = _data()
    net = _net()
    return lambda: subspaces.ggn_eigen(net, likelihoods.Categorical(), x, 2, seed=1)


def _setup_kfac_eigen():
    x, _ = _data()
    net = _net()
    return lambda: subspaces.kfac_eigen(net, likelihoods.Categorical(), x, 2, fisher="mc")


def _setup_fit_curve():
    x, y = _data()
    net = _net()
    w0 = nn.utils.parameters_to_vector(net.parameters()).detach()
    return lambda: subspaces.fit_curve(
        net, likelihoods.Categorical(), x, y, w0, w0 + 0.1, epochs=2, seed=3, progress=False
    )


def _setup_dataset(name):
    if name == "toy_regression":
        return lambda: datasets.toy_regression(n=20, n_test=10, n_grid=10, seed=1)
    if name == "in_between":
        return lambda: datasets.in_between(n=20, n_test=10, n_grid=10, seed=1)
    x = np.arange(40.0).reshape(20, 2)
    return lambda: datasets.from_arrays(x, x[:, 0], seed=1)


#: (id, setup returning the call, pure: given an explicit seed, it leaves the global state as is)
CASES = [
    ("train_ensemble", _setup_train_ensemble, True),
    ("to_inference_data(seed=0)", lambda: _setup_to_inference_data(0), True),
    ("to_inference_data(seed=None)", lambda: _setup_to_inference_data(None), False),
    ("subnetwork(random, seed=0)", lambda: _setup_subnetwork(0), True),
    ("subnetwork(random, seed=None)", lambda: _setup_subnetwork(None), False),
    ("subspaces.random(seed=0)", lambda: _setup_random_subspace(0), True),
    ("subspaces.random(seed=None)", lambda: _setup_random_subspace(None), False),
    ("run_chains(processes=0)", _setup_run_chains, True),
    ("Laplace.sample(generator)", lambda: _setup_laplace(True), True),
    ("Laplace.sample()", lambda: _setup_laplace(False), False),
    ("SWAG.sample_weights(seed=1)", lambda: _setup_swag(1), True),
    ("SWAG.sample_weights(seed=None)", lambda: _setup_swag(None), False),
    ("SWAG.predict(seed=2)", _setup_swag_predict, True),
    ("EllipticalSliceSampler", _setup_ess, False),
    ("EllipticalSliceSampler(rng='chains', seed=0)", lambda: _setup_gess(0), True),
    ("EllipticalSliceSampler(rng='chains', seed=None)", lambda: _setup_gess(None), False),
    ("fit_map(seed=0)", lambda: _setup_fit_map(0), True),
    ("fit_map(seed=None)", lambda: _setup_fit_map(None), False),
    ("pca(seed=0)", _setup_pca, True),
    ("PatchedNet(seed=4)", _setup_patched_net, True),
    ("linearized_predictive(mc, seed=3)", _setup_linearized_mc, True),
    ("MixtureOfLaplace.predict(sample, seed=2)", _setup_mola_sample, True),
    ("ggn_eigen(seed=1)", _setup_ggn_eigen, True),
    ("kfac_eigen(fisher='mc')", _setup_kfac_eigen, True),
    ("PatchedNet.fit(seed=5): draws from the caller's stream", _setup_patched_fit, False),
    ("fit_curve(seed=3)", _setup_fit_curve, True),
    ("datasets.toy_regression", lambda: _setup_dataset("toy_regression"), True),
    ("datasets.in_between", lambda: _setup_dataset("in_between"), True),
    ("datasets.from_arrays", lambda: _setup_dataset("from_arrays"), True),
]


@pytest.mark.parametrize(("setup", "pure"), [pytest.param(s, p, id=i) for i, s, p in CASES])
def test_entry_point_does_not_reseed_the_callers_global_generators(setup, pure):
    with rng.preserved():  # this test leaves the session's random state as it found it
        call = setup()
        before, after = {}, {}
        for a in CALLER_SEEDS:
            _seed_caller(a)
            before[a] = _snapshot()
            call()
            after[a] = _snapshot()
    a, b = CALLER_SEEDS
    for g in GENERATORS:
        assert before[a][g] != before[b][g], g  # the caller's seeds did reach every generator
        assert after[a][g] != after[b][g], f"{g}: re-seeded (same state after caller seeds a, b)"
        if pure:
            assert after[a][g] == before[a][g], f"{g}: changed by a call with an explicit seed"


# ---------------------------------------------------------------------------------- rng helper


def test_seeded_draws_are_those_after_manual_seed_and_the_state_is_restored():
    with rng.preserved():
        _seed_caller(1)
        start = _snapshot()
        with rng.seeded(7):
            inside = torch.randn(3), np.random.rand(2), random.random()
        end = _snapshot()
        pyro.set_rng_seed(7)
        assert torch.equal(inside[0], torch.randn(3))
        assert np.array_equal(inside[1], np.random.rand(2)) and inside[2] == random.random()
    assert all(start[g] == end[g] for g in GENERATORS)


def test_seeded_without_numpy_and_python_leaves_them_to_the_block():
    with rng.preserved():
        _seed_caller(1)
        expected_np, expected_py = np.random.rand(), random.random()
        _seed_caller(1)
        start = _snapshot()
        with rng.seeded(7, numpy=False, python=False):
            got_np, got_py = np.random.rand(), random.random()
        end = _snapshot()
    assert (got_np, got_py) == (expected_np, expected_py)  # not seeded: the caller's streams
    assert start["torch"] == end["torch"] and start["cuda"] == end["cuda"]
    assert start["numpy"] != end["numpy"] and start["random"] != end["random"]  # advanced


def test_seeded_none_neither_seeds_nor_restores():
    with rng.preserved():
        _seed_caller(1)
        expected = torch.randn(2)
        _seed_caller(1)
        with rng.seeded(None):
            got = torch.randn(2)
        assert torch.equal(got, expected) and not torch.equal(torch.randn(2), expected)


def test_preserved_restores_when_the_block_raises():
    with rng.preserved():
        _seed_caller(3)
        start = _snapshot()
        with pytest.raises(RuntimeError), rng.seeded(9):
            torch.randn(4)
            raise RuntimeError("boom")
        assert all(_snapshot()[g] == start[g] for g in GENERATORS)


def test_seeded_and_transaction_name_bad_arguments_before_any_work():
    from pyro_subspace.transaction import transaction

    before = rng.get_state()
    for bad, exc in (("a", TypeError), (2.5, TypeError), (-1, ValueError), (2**32, ValueError)):
        with pytest.raises(exc, match="seed: expected an int in \\[0, 4294967295\\]"):
            with rng.seeded(bad):
                pass
    with rng.seeded(2**40, numpy=False, python=False):  # torch alone takes 64-bit seeds
        pass
    after = rng.get_state()
    assert torch.equal(before["torch"], after["torch"])
    with pytest.raises(ValueError, match="budget: expected an int >= 0"):
        with transaction(nn.Linear(2, 1), budget=-1):
            pass
    with pytest.raises(TypeError, match="on_overflow: expected a callable"):
        with transaction(nn.Linear(2, 1), on_overflow="unfit"):
            pass
