"""`run_chains`: chain i in its own process equals ``pyro.set_rng_seed(seed + i); fn(i)`` here."""

import pytest
import torch
from test_distributed import WORLD, join_distributed, start_distributed
from torch import nn

from pyro_subspace import EllipticalSliceSampler, SubspaceNet, likelihoods, subspaces
from pyro_subspace.infer import run_chains

SEED = 5
CHAINS = 3


def ess_chain(chain):
    """40 elliptical slice draws on a small regression model (its own data: no sharding)."""
    from pyro.infer import MCMC

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(1))
    with torch.random.fork_rng(devices=[]):  # the same net and subspace in every chain
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1)).double()
        sub = subspaces.random(net, rank=2)
    model = SubspaceNet(net, sub, likelihoods.Gaussian(0.3), prior_scale=1.0)
    mcmc = MCMC(
        EllipticalSliceSampler(model), num_samples=30, warmup_steps=10, disable_progbar=True
    )
    mcmc.run(x, y)
    return {"t": mcmc.get_samples()["t"], "chain": torch.tensor(chain)}


def failing(chain):
    if chain == 1:
        raise ValueError("chain one fails")
    return chain


def reference():
    import pyro

    out = []
    for i in range(CHAINS):
        pyro.set_rng_seed(SEED + i)
        out.append(ess_chain(i))
    return out


def assert_same(got, want):
    assert len(got) == len(want) == CHAINS
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g["t"], w["t"]) and torch.equal(g["chain"], w["chain"])
    assert not torch.equal(want[0]["t"], want[1]["t"])  # the seeds differ


def test_chains_in_processes_equal_the_chains_run_here():
    want = reference()
    torch.manual_seed(123)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert_same(run_chains(ess_chain, CHAINS, seed=SEED, processes=0), want)
    assert torch.equal(torch.rand(3), after)  # processes=0 restores the caller's random state
    assert_same(run_chains(ess_chain, CHAINS, seed=SEED, processes=2), want)
    with pytest.raises(RuntimeError, match="chain 1 raised:(.|\n)*chain one fails"):
        run_chains(failing, CHAINS, processes=2)
    with pytest.raises(ValueError, match="processes"):
        run_chains(ess_chain, 2, processes=-1)
    with pytest.raises(ValueError, match="num_chains"):
        run_chains(ess_chain, 0)
    with pytest.raises(TypeError, match="fn"):
        run_chains("ess", 2)


def _job(rank):
    results = run_chains(ess_chain, CHAINS, seed=SEED)  # rank r runs chains r, r + 2, ...
    return {f"{k}{i}": v for i, r in enumerate(results) for k, v in r.items()}


def test_chains_are_dealt_to_the_ranks_of_a_process_group(tmp_path):
    path = str(tmp_path / "rank{rank}.pt")
    ctx = start_distributed(path, _job)
    try:
        want = reference()
    finally:
        join_distributed(ctx)
    for rank in range(WORLD):
        got = torch.load(path.format(rank=rank), weights_only=True)
        assert_same([{"t": got[f"t{i}"], "chain": got[f"chain{i}"]} for i in range(CHAINS)], want)
