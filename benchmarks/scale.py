"""Scale: 1 → 2 processes, a BatchNorm CNN through the whole pipeline, streaming vs in memory.

1. Strong scaling: the full-data tempered log-likelihood and gradient (`Evaluator.nll_and_grad`)
   of an MLP on N = 10⁶ rows, one process (rank 0 alone, inside `distributed.local()`) vs two
   gloo processes on 127.0.0.1 each holding half (one ``all_reduce``), timed A B A B in the same
   two processes, best of the rounds; torch pinned to one thread per process.
2. The CNN pipeline: a ResNet-style CNN (BatchNorm, in-place ReLU; 3×32×32 synthetic inputs)
   through SWA + PCA + ESS with the BatchNorm refresh, diag-Laplace subnetwork selection +
   full-covariance Laplace, top-20 GGN eigenpairs (Lanczos), last-layer MoLA and ECMP patches:
   time and peak memory (RSS increase over the step, sampled every 5 ms) per step, vs N and D.
3. Streaming: the same evaluations from a ``DataLoader`` vs in-memory tensors: numbers and
   peak memory.

    python benchmarks/scale.py [--quick] [--rows 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import threading
import time

import torch
import torch.multiprocessing as mp
from torch import nn


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak RSS increase (MB) inside the block, sampled by a thread every 5 ms."""

    def __enter__(self):
        self.base, self.peak, self._stop = _rss(), _rss(), False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.mb = (self.peak - self.base) / 2**20


# ---------------------------------------------------------------------------- 1. scaling


def _mlp_problem(rows: int):
    from pyro_subspace import SubspaceNet, likelihoods, subspaces

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=gen)
    y = x[:, :3].sum(1).sin() + 0.1 * torch.randn(rows, generator=gen)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    model = SubspaceNet(net, subspaces.random(net, 10, seed=0), likelihoods.Gaussian(0.3))
    return model, x, y


def _scaling_worker(rank: int, port: int, rows: int, rounds: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pyro_subspace import distributed

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(300))
    try:
        model, x, y = _mlp_problem(rows)
        t = torch.zeros(model.rank, dtype=torch.float64)
        full = model.evaluator(x, y, chunk_size=65536)
        mine = model.evaluator(distributed.shard(x), distributed.shard(y), chunk_size=65536)
        one, two, values = [], [], []
        for _ in range(rounds):
            dist.barrier()
            if rank == 0:  # A: one process does all the work
                with distributed.local():
                    start = time.perf_counter()
                    values.append(full.nll_and_grad(t)[0])
                    one.append(time.perf_counter() - start)
            dist.barrier()
            start = time.perf_counter()  # B: both processes, half each
            value = mine.nll_and_grad(t)[0]
            two.append(time.perf_counter() - start)
            if rank == 0:
                values.append(value)
        if rank == 0:
            out.put((min(one), min(two), values))
    finally:
        dist.destroy_process_group()


def strong_scaling(rows: int, rounds: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.start_processes(
        _scaling_worker, args=(port, rows, rounds, out), nprocs=2, join=False, start_method="spawn"
    )
    one, two, values = out.get(timeout=1800)
    procs.join()
    agree = max(abs(v - values[0]) / abs(values[0]) for v in values)
    print(f"\n## Strong scaling: nll_and_grad on N = {rows:,} (MLP 8-32-1, K = 10, chunks 65536)")
    print("| processes | best time (s) | speed-up |")
    print("|---|---|---|")
    print(f"| 1 | {one:.3f} | 1.00 |")
    print(f"| 2 | {two:.3f} | {one / two:.2f} (target >= 1.6) |")
    print(f"values agree to {agree:.1e} relative (float32 network, float64 sums)")


# ---------------------------------------------------------------------------- 2. CNN pipeline


class Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.skip = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(h)) + self.skip(x))


def resnet(width: int = 32, classes: int = 10) -> nn.Module:
    """A small ResNet for 3×32×32 inputs; width 48 gives 349 306 weights (10 classes)."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 2 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, classes),
    )  # fmt: skip


def synthetic(n: int, classes: int = 10, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=gen)
    y = (x[:, 0, :8, :8].mean((1, 2)) * 40).long().clamp(-5, 4) + 5
    return x, y % classes


def cnn_pipeline(n: int, width: int, subnet: int, draws: int, swa_epochs: int) -> list[tuple]:
    """Every pipeline step on ``n`` synthetic images; returns rows (step, N, D, K, s, MB)."""
    from pyro.infer import MCMC

    from pyro_subspace import (
        EllipticalSliceSampler,
        PatchedNet,
        SubspaceNet,
        fit_map,
        likelihoods,
        subspaces,
    )
    from pyro_subspace.infer import AutoSubspaceLaplace, MixtureOfLaplace

    torch.manual_seed(0)
    net, lik = resnet(width), likelihoods.Categorical()
    x, y = synthetic(n)
    d = sum(p.numel() for p in net.parameters())
    rows = []

    def step(name, k, fn):
        with PeakMemory() as mem:
            start = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - start
        rows.append((name, n, d, k, seconds, mem.mb))
        return result

    collector = subspaces.SWACollector(net, max_snapshots=10)

    def swa():
        fit_map(net, lik, x, y, epochs=1, batch_size=64, lr=1e-3, progress=False,
                optimizer="sgd", collector=collector, swa_epochs=swa_epochs, swa_lr=1e-3)  # fmt: skip
        return subspaces.pca(collector, min(5, swa_epochs))

    pca = step("SWA + PCA", min(5, swa_epochs), swa)

    def ess():
        model = SubspaceNet(net, pca, lik, temperature="auto")
        kernel = EllipticalSliceSampler(model, chunk_size=256, recompute_bn=True)
        MCMC(kernel, draws, 0, disable_progbar=True).run(x, y)

    step(f"ESS ({draws} draws, BN refresh)", pca.rank, ess)
    sel = step("diag-Laplace selection", subnet, lambda: subspaces.subnetwork(
        net, subnet, strategy="diag_laplace", likelihood=lik, x=x, chunk_size=64))  # fmt: skip

    def laplace():
        guide = AutoSubspaceLaplace(SubspaceNet(net, sel, lik), prior_precision=1.0, chunk_size=64)
        return guide.fit(x, y, find_map=False)

    step("full-cov subnetwork Laplace", subnet, laplace)
    step("top-20 GGN eigenpairs", 20, lambda: subspaces.ggn_eigen(net, lik, x, 20, chunk_size=256))
    step("last-layer MoLA (2 members)", (2 * width + 1) * 10,
         lambda: MixtureOfLaplace([net, resnet(width)], lik).fit(x, y))  # fmt: skip

    def ecmp():
        model = PatchedNet(net, lik, mode="ecmp", n_components=5, init="copy")
        model.fit(x, y, epochs=1, batch_size=64)

    step("ECMP patches (1 epoch)", 5, ecmp)
    return rows


def print_pipeline(rows: list[tuple]) -> None:
    print("\n## CNN pipeline (ResNet-style, BatchNorm, 3x32x32 synthetic)")
    print("| step | N | D | K (MoLA: per member) | time (s) | peak RSS increase (MB) |")
    print("|---|---|---|---|---|---|")
    for name, n, d, k, s, mb in rows:
        print(f"| {name} | {n} | {d:,} | {k} | {s:.2f} | {mb:.0f} |")


# ---------------------------------------------------------------------------- 3. streaming


def streaming(rows: int) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from pyro_subspace.curvature import ggn_diagonal

    model, x, y = _mlp_problem(rows)
    t = torch.zeros(model.rank, dtype=torch.float64)
    net, lik = model.flat.net, model.likelihood
    print(f"\n## Streaming from a DataLoader vs in-memory tensors (N = {rows:,})")
    print("| quantity | source | value | time (s) | peak RSS increase (MB) |")
    print("|---|---|---|---|---|")
    for what, fn in (
        ("log-likelihood", lambda data: model.evaluator(*data, chunk_size=4096).log_likelihood(t)),
        ("sum diag GGN", lambda data: float(ggn_diagonal(net, lik, data[0], 4096).sum())),
    ):
        for source, data in (
            ("tensors", (x, y)),
            ("DataLoader (4096)", (DataLoader(TensorDataset(x, y), batch_size=4096), None)),
        ):
            with PeakMemory() as mem:
                start = time.perf_counter()
                value = fn(data)
                seconds = time.perf_counter() - start
            print(f"| {what} | {source} | {value:.10g} | {seconds:.2f} | {mem.mb:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N everywhere")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    print(f"# benchmarks/scale.py  {datetime.date.today()}  torch threads 1 per process, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")  # fmt: skip
    rows = 100_000 if args.quick else args.rows
    strong_scaling(rows, args.rounds)
    table = []
    sizes = [(64, 8), (128, 8)] if args.quick else [(256, 48), (512, 48), (512, 64)]
    for n, width in sizes:
        table += cnn_pipeline(n, width, subnet=500 if args.quick else 5000,
                              draws=5 if args.quick else 20, swa_epochs=3 if args.quick else 5)  # fmt: skip
    print_pipeline(table)
    streaming(20_000 if args.quick else 200_000)


if __name__ == "__main__":
    main()
