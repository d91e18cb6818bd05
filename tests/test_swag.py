"""SWAG and MultiSWAG against the closed form of Maddox et al. (2019), computed from the snapshots."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from pyro_subspace import FlatNet, likelihoods, subspaces
from pyro_subspace.infer.swag import SWAG, MultiSWAG

SPREAD = torch.tensor([1.0, 0.5, 2.0, 0.1, 1.0, 0.3], dtype=torch.float64)


def _filled_collector(n=7, max_snapshots=5, seed=0, **kwargs):
    """A float64 SWACollector on a 2→2 linear net (``D = 6``) fed ``n`` known weight vectors."""
    net = nn.Linear(2, 2).double()
    col = subspaces.SWACollector(net, max_snapshots=max_snapshots, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    snaps = torch.randn(n, 6, generator=gen, dtype=torch.float64) * SPREAD
    flat = FlatNet(net)
    for w in snaps:
        flat.load_vector(w)
        col.collect()
    return col, snaps.numpy()


def _swag_parts(snaps, k):
    """``θ_SWA``, ``diag(Σ_diag)`` and ``D̂`` (the last ``k`` deviations ``θ_i − θ̄_i`` from the
    running mean, as rows ``(k, D)``) of Maddox et al. (2019), straight from the snapshots."""
    mean = snaps.mean(0)
    diag = (snaps**2).mean(0) - mean**2
    running = np.cumsum(snaps, 0) / np.arange(1, len(snaps) + 1)[:, None]
    return mean, diag, (snaps - running)[-k:]


@pytest.mark.parametrize(
    "low_rank, scale, kwargs",
    [
        (True, 1.0, {}),  # 7 snapshots, the last K = 5 deviations kept
        (True, 0.5, {}),
        (False, 1.0, {}),
        # a sketch with ℓ >= n is exact: D̂ = all 7 deviations, K − 1 = 6
        (True, 1.0, {"method": "frequent_directions", "rank": 8}),
    ],
)
def test_swag_draws_have_the_papers_covariance(low_rank, scale, kwargs):
    col, snaps = _filled_collector(**kwargs)
    k = len(snaps) if kwargs else 5
    mean, diag, dev = _swag_parts(snaps, k)
    # Maddox et al. 2019: Σ = ½ (Σ_diag + D̂ D̂ᵀ/(K − 1)); SWAG-diagonal: Σ_diag; ``scale`` multiplies
    lowrank = dev.T @ dev / (k - 1)
    target = scale * (0.5 * (np.diag(diag) + lowrank) if low_rank else np.diag(diag))
    n = 100_000
    w = SWAG(col, likelihoods.Categorical(), scale=scale, low_rank=low_rank).sample_weights(n)
    w = w.numpy()
    # Monte Carlo tolerance from n: the sample mean has standard error sqrt(Σ_ii/n), a sample
    # covariance entry sqrt((Σ_ij² + Σ_ii Σ_jj)/(n − 1)) (Gaussian draws). At 5 standard errors
    # a correct sampler fails an entry with probability 5.7e-7, any of the 27 checked here with
    # at most 2e-5 (union bound); the draws are seeded, so the outcome is fixed anyway.
    se_mean = np.sqrt(np.diag(target) / n)
    se_cov = np.sqrt((np.outer(np.diag(target), np.diag(target)) + target**2) / (n - 1))
    assert np.all(np.abs(w.mean(0) - mean) <= 5 * se_mean)
    emp = np.cov(w, rowvar=False)
    assert np.all(np.abs(emp - target) <= 5 * se_cov), np.abs(emp - target).max()
    # ... and tight enough to see a wrong convention: 5 se is under 3% of every variance, so a
    # factor 2 (the paper's ½ applied twice, or not at all) or a diagonal scaled by Σ_diag
    # instead of Σ_diag^{1/2} (spreads 0.1 to 2) fails.
    assert np.all(5 * np.diag(se_cov) < 0.03 * np.diag(target))


def test_unseeded_draws_come_from_the_global_generator_by_the_sampling_identity():
    col, snaps = _filled_collector()
    swag = SWAG(col, likelihoods.Categorical(), seed=None)
    torch.manual_seed(7)
    w = swag.sample_weights(3).numpy()
    after = torch.randn(2)
    torch.manual_seed(7)
    z1 = torch.randn(3, 6, dtype=torch.float64).numpy()
    z2 = torch.randn(3, 5, dtype=torch.float64).numpy()
    assert torch.equal(torch.randn(2), after)  # advanced by exactly z₁, z₂; never re-seeded
    mean, diag, dev = _swag_parts(snaps, 5)
    # θ̃ = θ_SWA + (1/√2) Σ_diag^{1/2} z₁ + (1/√(2(K − 1))) D̂ z₂  (D̂ has the deviations as columns)
    expected = mean + np.sqrt(diag) * z1 / math.sqrt(2) + z2 @ dev / math.sqrt(2 * (5 - 1))
    np.testing.assert_allclose(w, expected, rtol=0, atol=1e-12)
    torch.manual_seed(7)
    assert np.array_equal(swag.sample_weights(3).numpy(), w)


def test_seeded_draws_repeat_and_leave_the_global_generator_alone():
    col, _ = _filled_collector()
    swag = SWAG(col, likelihoods.Categorical(), num_samples=4, seed=3)
    state = torch.get_rng_state()
    a = swag.sample_weights()
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(swag.sample_weights(seed=3), a) and torch.equal(swag.sample_weights(), a)
    assert not torch.equal(swag.sample_weights(seed=4), a)
    assert swag.sample_weights(9).shape == (9, 6)


def test_swag_predictive_averages_softmax_over_draws_and_multiswag_pools_members():
    col, _ = _filled_collector()
    col2, _ = _filled_collector(seed=1)
    lik = likelihoods.Categorical()
    x = torch.randn(7, 2, dtype=torch.float64)
    swag = SWAG(col, lik, num_samples=11, seed=4)
    w = swag.sample_weights()
    direct = FlatNet(col.flat.net)(w, x).softmax(-1).mean(0)
    assert torch.allclose(swag.predict(x).probs, direct, atol=1e-12)
    weights, comp = swag.components(x, num_samples=3)
    assert comp.shape == (3, 7, 2) and torch.allclose(weights, torch.full((3,), 1 / 3).double())
    multi = MultiSWAG([col, col2], lik, num_samples=11, seed=4)
    both = (direct + SWAG(col2, lik, num_samples=11, seed=5).predict(x).probs) / 2
    assert torch.allclose(multi.predict(x).probs, both, atol=1e-12)
    assert multi.components(x)[0].shape == (22,)


def test_validation():
    col, _ = _filled_collector()
    lik = likelihoods.Categorical()
    with pytest.raises(ValueError, match="scale"):
        SWAG(col, lik, scale=0.0)
    with pytest.raises(TypeError, match="collector"):
        SWAG(None, lik)
    with pytest.raises(TypeError, match="seed"):
        SWAG(col, lik, seed=1.5)
    with pytest.raises(ValueError, match="num_samples"):
        SWAG(col, lik, num_samples=0)
    with pytest.raises(TypeError, match="collectors"):
        MultiSWAG([], lik)
    one, _ = _filled_collector(n=1)
    empty = SWAG(subspaces.SWACollector(nn.Linear(2, 2)), lik)  # accepted: load_state_dict next
    for swag in (SWAG(one, lik), empty):
        with pytest.raises(ValueError, match="at least 2 snapshots"):
            swag.sample_weights()
    assert not hasattr(col, "sample")  # the collector only collects


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (2.5, TypeError)])
def test_num_samples_and_seed_of_a_prediction_are_named_before_any_forward_pass(bad, error):
    """``predict``/``log_prob``/``components``/``outputs``/``sample_weights`` with a bad
    ``num_samples`` name it (``S`` before), and MultiSWAG's ``seed`` is checked once, before its
    first member runs (``"a" + 0`` raised Python's own error before)."""
    col, _ = _filled_collector()
    col2, _ = _filled_collector(seed=1)
    lik = likelihoods.Categorical()
    x, y = torch.randn(7, 2, dtype=torch.float64), torch.randint(0, 2, (7,))
    passes = []
    for c in (col, col2):
        c.flat.net.register_forward_hook(lambda *a: passes.append(1))
    swag, multi = SWAG(col, lik, num_samples=3), MultiSWAG([col, col2], lik, num_samples=3)
    calls = [
        lambda n: swag.predict(x, num_samples=n),
        lambda n: swag.log_prob(x, y, num_samples=n),
        lambda n: swag.components(x, num_samples=n),
        lambda n: swag.outputs(x, num_samples=n),
        lambda n: swag.sample_weights(num_samples=n),
        lambda n: multi.predict(x, num_samples=n),
        lambda n: multi.log_prob(x, y, num_samples=n),
    ]
    for call in calls:
        with pytest.raises(error, match="^num_samples: expected an int >= 1"):
            call(bad)
    for seed in ("a", -1, 1.5):
        with pytest.raises((TypeError, ValueError), match="^seed: "):
            multi.predict(x, seed=seed)
    assert passes == []
    assert swag.predict(x, num_samples=2).probs.shape == (7, 2) and passes  # the hooks see one
