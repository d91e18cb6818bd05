"""Data-parallel training (`fit_map`, its SWA phase, `PatchedNet.fit`) equals one process.

Two processes (the spawn helpers of test_distributed: gloo, 127.0.0.1) each train on a shard;
the gradients are all-reduced per step, so a step on the two ranks is the step of one process
on the union of their minibatches. The single-process reference is that run: the full data in
full batch, or a ``DataLoader`` whose batch sampler yields exactly those unions. Only the order
of the sums differs, so the weights agree to rounding (float64: 1e-10 relative).
"""

import pyro
import pytest
import torch
from test_distributed import WORLD, join_distributed, start_distributed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from pyro_subspace import PatchedNet, fit_map, likelihoods, subspaces
from pyro_subspace.distributed import shard

N = 48
BATCH = 6  # per rank: the union is 12 rows
SEED = 3
TOL = 1e-10


def regression(n=N):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    return x, torch.sin(x.sum(1)) + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)


def mlp(seed, batchnorm=False):
    torch.manual_seed(seed)
    norm = [nn.BatchNorm1d(8)] if batchnorm else []
    return nn.Sequential(nn.Linear(3, 8), *norm, nn.Tanh(), nn.Linear(8, 1)).double()


class UnionBatches:
    """A batch sampler yielding, per epoch, the unions over ranks of the ranks' consecutive
    minibatches of `BATCH`; ``orders(epoch)`` gives each rank's row order (global indices)."""

    def __init__(self, orders):
        self.orders, self.epoch = orders, 0

    def __iter__(self):
        per_rank = [order.split(BATCH) for order in self.orders(self.epoch)]
        self.epoch += 1
        for parts in zip(*per_rank, strict=True):
            yield torch.cat(parts).tolist()

    def __len__(self):
        return N // WORLD // BATCH


def sampler_orders(epoch):
    """`DistributedSampler(shuffle=True, seed=SEED)` after ``set_epoch(epoch)``."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
    return [order[r::WORLD] for r in range(WORLD)]


def shard_orders():
    """`fit_map(seed=SEED)` on every rank's shard ``x[r::WORLD]``: the same permutation of the
    local rows on each rank, one per epoch from one generator."""
    gen = torch.Generator().manual_seed(SEED)

    def orders(epoch):
        local = torch.randperm(N // WORLD, generator=gen)
        return [r + WORLD * local for r in range(WORLD)]

    return orders


def train(data):
    """Every training run; ``data(kind)`` gives what this process passes for ``kind``."""
    out = {}
    settings = {"lr": 2e-2, "weight_decay": 1e-3, "progress": False}
    # full batch with a learned noise scale, then the SWA phase with a collector
    net, lik = mlp(0), likelihoods.Gaussian(sigma_init=0.5).double()
    collector = subspaces.SWACollector(net, max_snapshots=5)
    hist = fit_map(
        net, lik, *data("full"), epochs=8, batch_size=None, seed=SEED, collector=collector,
        swa_epochs=3, swa_lr=1e-2, **settings,
    )  # fmt: skip
    out["full_weights"] = nn.utils.parameters_to_vector(net.parameters()).detach()
    out["full_sigma"] = lik.sigma.detach().reshape(1)
    out["full_swa"], out["full_history"] = collector.mean.detach(), torch.tensor(hist)
    # minibatches: tensor shards, and a DataLoader with a DistributedSampler (SGD, momentum)
    for kind in ("tensor", "loader"):
        net = mlp(1)
        hist = fit_map(
            net, likelihoods.Gaussian(0.3), *data(kind), epochs=3, batch_size=BATCH, seed=SEED,
            optimizer="sgd", **settings,
        )  # fmt: skip
        out[f"{kind}_weights"] = nn.utils.parameters_to_vector(net.parameters()).detach()
        out[f"{kind}_history"] = torch.tensor(hist)
    # PatchedNet.fit, full batch: one shared draw of the assignment and the noise per step
    pyro.clear_param_store()
    model = PatchedNet(mlp(2), likelihoods.Gaussian(0.3), mode="emp", n_components=3, seed=0)
    torch.manual_seed(11)
    x, y = data("full")
    hist = model.fit(x, y, epochs=5, lr=1e-2, batch_size=N)
    out["patched_means"] = torch.cat([m.detach().reshape(-1) for m in model.means().values()])
    out["patched_history"] = torch.tensor(hist)
    return out


def _job(rank):
    x, y = regression()

    def data(kind):
        if kind == "loader":
            sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=SEED)
            return DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler), None
        return shard(x), shard(y)

    out = train(data)
    # BatchNorm: each rank normalises its own minibatch; the ranks end with the same network
    net = mlp(3, batchnorm=True)
    loader = DataLoader(
        TensorDataset(x, y), batch_size=BATCH, sampler=DistributedSampler(TensorDataset(x, y))
    )
    fit_map(net, likelihoods.Gaussian(0.3), loader, epochs=2, progress=False)
    out["bn_state"] = torch.cat([v.double().reshape(-1) for v in net.state_dict().values()])
    # shards of 25 and 24 rows give 3 and 2 minibatches of 12: every rank refuses alike
    x49, y49 = regression(49)
    with pytest.raises(ValueError, match=r"batch_size: .* \[3, 2\] minibatches") as err:
        fit_map(mlp(4), likelihoods.Gaussian(0.3), shard(x49), shard(y49), batch_size=12)
    out["lockstep_error"] = torch.tensor(len(str(err.value)))
    return out


def test_data_parallel_training_equals_one_process(tmp_path):
    path = str(tmp_path / "rank{rank}.pt")
    # the first torch optimiser imports torch._dynamo (seconds): here, so the forked workers
    # inherit it instead of importing it twice more
    torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    ctx = start_distributed(path, _job)
    try:  # the single-process reference runs while the workers do
        x, y = regression()
        dataset = TensorDataset(x, y)
        orders = {"tensor": shard_orders(), "loader": sampler_orders}

        def data(kind):
            if kind == "full":
                return x, y
            return DataLoader(dataset, batch_sampler=UnionBatches(orders[kind])), None

        want = train(data)
    finally:
        join_distributed(ctx)
    ranks = [torch.load(path.format(rank=r), weights_only=True) for r in range(WORLD)]
    print(f"rank 0 took {float(ranks[0].pop('seconds')):.1f} s")
    ranks[1].pop("seconds")
    for key, value in want.items():
        got = ranks[0][key]
        err = (got - value).abs().max() / value.abs().max()
        print(f"{key}: {float(err):.1e}")
        assert err < TOL, (key, float(err))
        assert torch.equal(ranks[1][key], got), key  # every rank holds the same result
    assert torch.equal(ranks[0]["bn_state"], ranks[1]["bn_state"])
    assert ranks[0]["lockstep_error"] == ranks[1]["lockstep_error"] > 0
    # the runs moved: training is not trivially the identity
    assert want["full_history"][-1] < 0.75 * want["full_history"][0]
    assert not torch.equal(want["tensor_weights"], want["loader_weights"])
