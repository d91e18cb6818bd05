"""Data-parallel evaluation over torch.distributed equals the single process.

Two processes (torch.multiprocessing, gloo, 127.0.0.1) each hold a shard of the data;
every full-data quantity is all-reduced. The reference is the same computation in this
process on all the data; sums differ only in their order, so the agreement is to rounding
(float64: tolerance 1e-10 relative), and the elliptical slice chain is identical.
"""

import datetime
import faulthandler
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

WORLD = 2
N = 48
TOL = 1e-10
WORKER_TIMEOUT = 240  # seconds; the machine may be shared


def problem(sigma=0.3):
    """A small float64 regression MLP, its data, and a 6-weight subnetwork model."""
    from pyro_subspace import SubspaceNet, likelihoods, subspaces

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen, dtype=torch.float64)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(N, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    sub = subspaces.subnetwork(
        net, strategy="indices", indices=torch.tensor([0, 5, 11, 20, 33, 40])
    )
    model = SubspaceNet(net, sub, likelihoods.Gaussian(sigma), prior_scale=1.5)
    return net, model, x, y


def compute(x, y, loader):
    """Every distributed quantity, from tensors ``(x, y)`` and from ``loader`` (the same
    rows); returns a dict of tensors."""
    import pyro
    from pyro.infer import MCMC

    from pyro_subspace import EllipticalSliceSampler, likelihoods, subspaces
    from pyro_subspace.curvature import ggn_diagonal, ggn_in_subspace
    from pyro_subspace.infer import AutoSubspaceLaplace

    net, model, _, _ = problem()
    lik = likelihoods.Gaussian(0.3)
    t = torch.linspace(-0.5, 0.5, model.rank, dtype=torch.float64)
    out = {}
    for name, data in (("tensor", (x, y)), ("loader", (loader, None))):
        ev = model.evaluator(*data, chunk_size=7)
        out[f"{name}_loglik"] = torch.tensor(ev.log_likelihood(t))
        nll, grad = ev.nll_and_grad(t)
        out[f"{name}_nll"], out[f"{name}_grad"] = torch.tensor(nll), grad
        out[f"{name}_ptgp"] = ev.ggn(t)
        out[f"{name}_ptgp_diag"] = ev.ggn(t, diagonal=True)
        out[f"{name}_stats"] = torch.tensor(ev.map_statistics(t), dtype=torch.float64)
    out["ggn_diag"] = ggn_diagonal(net, lik, x, chunk_size=5)
    out["ggn_sub"] = ggn_in_subspace(net, lik, x, model.subspace, chunk_size=5)
    eig = subspaces.ggn_eigen(net, lik, x, 4, num_iter=12, chunk_size=5)
    out["eigenvalues"], out["eigenvectors"] = eig.eigenvalues, eig.basis
    guide = AutoSubspaceLaplace(model, chunk_size=5).fit(x, y)
    out["laplace_loc"], out["laplace_cov"] = guide.loc, guide.covariance
    out["evidence"] = guide.log_marginal_likelihood().detach()
    guide.optimize_prior_precision("marglik", optimize_sigma=True)
    out["tuned"] = torch.stack([guide.prior_precision.reshape(()), guide.likelihood.sigma.double()])
    out["tuned_evidence"] = guide.log_marginal_likelihood().detach()
    # a fresh model (the λ tuning above agrees only to rounding); a flatter likelihood keeps
    # the slice sampler at a few evaluations (one all_reduce each) per draw
    _, model, _, _ = problem(sigma=1.0)
    pyro.set_rng_seed(1)
    mcmc = MCMC(
        EllipticalSliceSampler(model, chunk_size=16), num_samples=150, warmup_steps=50,
        disable_progbar=True,
    )  # fmt: skip
    mcmc.run(x, y)
    out["ess_chain"] = mcmc.get_samples()["t"]
    from pyro_subspace.infer import EllipticalSliceSampler

    for name, data in (("gess_chain", (x, y)), ("gess_loader_chain", (loader,))):
        kernel = EllipticalSliceSampler(model, reference="prior", seed=0, chunk_size=16)
        mcmc = MCMC(kernel, num_samples=60, warmup_steps=20, disable_progbar=True)
        mcmc.run(*data)  # the sharded likelihood is all-reduced: the full-data chain
        out[name] = mcmc.get_samples()["t"]
    return out


def _job(rank):
    """Rank ``rank``'s share of `compute`: its shard as tensors and as a DataLoader."""
    from pyro_subspace.distributed import shard

    _, _, x, y = problem()
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=False)  # N divisible by WORLD: no padding
    loader = DataLoader(data, batch_size=5, sampler=sampler)
    return compute(shard(x), shard(y), loader)


def _worker(rank, port, path, job):
    """Join the gloo process group on 127.0.0.1 and run ``job(rank)`` (a dict of tensors),
    saved by rank 0 at ``path`` (``path.format(rank=rank)`` when ``path`` holds ``{rank}``:
    every rank saves)."""
    faulthandler.dump_traceback_later(WORKER_TIMEOUT, exit=True)  # never hang: stop with a trace
    start = time.perf_counter()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    try:
        result = job(rank)
        result["seconds"] = torch.tensor(time.perf_counter() - start)
        if rank == 0 or "{rank}" in path:
            torch.save(result, path.format(rank=rank))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_distributed(path, job=_job):
    """Start `WORLD` processes running ``job`` (a module-level function) in `_worker`."""
    # fork where available: the workers skip re-importing torch and pyro (seconds on a busy
    # machine); they touch no threads of this process and start their own process group.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    return mp.start_processes(
        _worker, args=(_free_port(), str(path), job), nprocs=WORLD, join=False, start_method=method
    )


def join_distributed(ctx, timeout=WORKER_TIMEOUT + 30.0):
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"distributed workers did not finish within {timeout} s")


def test_two_ranks_equal_one_process(tmp_path):
    path = tmp_path / "rank0.pt"
    ctx = start_distributed(path)
    try:  # the single-process reference runs while the workers do
        _, _, x, y = problem()
        want = compute(x, y, DataLoader(TensorDataset(x, y), batch_size=5))
    finally:
        join_distributed(ctx)
    got = torch.load(path, weights_only=True)
    print(f"rank 0 took {float(got.pop('seconds')):.1f} s")
    assert set(got) == set(want)
    for key, value in want.items():
        if key.endswith("_chain"):
            assert torch.equal(got[key], value), key
            continue
        err = (got[key] - value).abs().max() / value.abs().max().clamp_min(1e-300)
        assert err < TOL, (key, float(err))
    # the tensor and the DataLoader paths agree too
    for key in ("loglik", "grad", "ptgp", "ptgp_diag", "stats"):
        torch.testing.assert_close(want[f"tensor_{key}"], want[f"loader_{key}"], rtol=TOL, atol=0)
    torch.testing.assert_close(want["gess_chain"], want["gess_loader_chain"], rtol=1e-10, atol=0)


def test_shard_and_padding_checks():
    from pyro_subspace.data import DataSource
    from pyro_subspace.distributed import active, shard

    x = torch.arange(5.0)
    assert torch.equal(shard(x), x) and not active()  # no process group: unchanged
    data = TensorDataset(torch.randn(5, 2), torch.randn(5))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    with pytest.raises(ValueError, match="DistributedSampler pads"):
        DataSource(DataLoader(data, sampler=sampler))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False, drop_last=True)
    assert DataSource(DataLoader(data, sampler=sampler)).local_num_data == 2
