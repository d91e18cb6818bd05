"""Scale: 1 → 2 processes, a BatchNorm CNN through the whole pipeline, streaming vs in memory.

1. Strong scaling: the full-data tempered log-likelihood and gradient (`Evaluator.nll_and_grad`)
   of an MLP on N = 10⁶ rows, one process (rank 0 alone, inside `distributed.local()`) vs two
   gloo processes on 127.0.0.1 each holding half (one ``all_reduce``), timed A B A B in the same
   two processes, best of the rounds; torch pinned to one thread per process.
2. The CNN pipeline: a ResNet-style CNN (BatchNorm, in-place ReLU; 3×32×32 synthetic inputs)
   through SWA + PCA + ESS with the BatchNorm refresh, diag-Laplace subnetwork selection +
   full-covariance Laplace, top-20 GGN eigenpairs (Lanczos), the top-20 K-FAC eigenbasis
   (`subspaces.kfac_eigen`) + ESS in it, last-layer MoLA and ECMP patches:
   time and peak memory (RSS increase over the step, sampled every 5 ms) per step, vs N and D.
   ``--resnet18``: the same pipeline on ResNet-18 (11.2M weights; `resnet18_pipeline`), each
   step's time in training epochs, at N = 250 and 1,000 (memory flat in N).
3. Streaming: the same evaluations from a ``DataLoader`` vs in-memory tensors: numbers and
   peak memory.

``--ggn-memory``: only ``benchmarks/ggn_operator_memory.py`` (the GGN operator's cache budget,
peak RSS and time per product at N = 1024 on `resnet4` and `resnet_plain`, a second CNN without
in-place ops).

Modes: ``--quick`` (N = 10⁵ MLP 8-32-1; CNN of 10,226 weights at N = 64, 128) and ``--full``
(the issue's sizes: N = 10⁶ on an MLP 10-200-1; a four-stage ResNet of 308,826 weights at
N = 256, 512, 1024 and one of 78,002 weights at N = 512, every pipeline step; each CNN
configuration in a fresh process, chunked so that memory is bounded by the chunk, not by N).
Peak memory is reported twice per step: the RSS increase over the step (sampled every 5 ms;
0 when the step reuses memory malloc already holds) and the step's absolute peak RSS (the
kernel's ``VmHWM``, reset at the step's start by writing 5 to ``/proc/self/clear_refs``:
independent of what any allocator caches, it includes the process's baseline).

    python benchmarks/scale.py --quick --rounds 3
    python benchmarks/scale.py --full --rounds 3          # about 15 min on 2 idle cores
    python benchmarks/scale.py --full --rows 100000 --cnn-rows 32,64   # a smoke run
    python benchmarks/scale.py --ggn-memory                # about 6 min
    python benchmarks/scale.py --resnet18                  # ResNet-18 rows at N = 250, 1000: ~45 min
    python benchmarks/scale.py --resnet18 --checkpoint DIR --cnn-rows 1000   # resumable, per step
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


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter ``VmHWM`` (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak RSS increase (MB) inside the block, sampled by a thread every 5 ms, and the
    block's absolute peak RSS ``hwm_mb`` (``VmHWM`` reset at entry; NaN where it cannot be)."""

    def __enter__(self):
        self._hwm_ok = _reset_hwm()
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
        self.hwm_mb = _hwm() / 2**20 if self._hwm_ok else float("nan")


# ---------------------------------------------------------------------------- 1. scaling


def _mlp_problem(rows: int, inputs: int = 8, hidden: int = 32):
    from pyro_subspace import SubspaceNet, likelihoods, subspaces

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inputs, generator=gen)
    y = x[:, :3].sum(1).sin() + 0.1 * torch.randn(rows, generator=gen)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    model = SubspaceNet(net, subspaces.random(net, 10, seed=0), likelihoods.Gaussian(0.3))
    return model, x, y


def _scaling_worker(rank: int, port: int, rows: int, rounds: int, out, shape=(8, 32)):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pyro_subspace import distributed

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(300))
    try:
        model, x, y = _mlp_problem(rows, *shape)
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


def strong_scaling(rows: int, rounds: int, shape: tuple[int, int] = (8, 32)) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = mp.start_processes(
        _scaling_worker, args=(port, rows, rounds, out, shape), nprocs=2, join=False,
        start_method="spawn",
    )  # fmt: skip
    one, two, values = out.get(timeout=1800)
    procs.join()
    agree = max(abs(v - values[0]) / abs(values[0]) for v in values)
    mlp = f"MLP {shape[0]}-{shape[1]}-1"
    print(f"\n## Strong scaling: nll_and_grad on N = {rows:,} ({mlp}, K = 10, chunks 65536)")
    print("| processes | best time (s) | speed-up |")
    print("|---|---|---|")
    print(f"| 1 | {one:.3f} | 1.00 |")
    print(f"| 2 | {two:.3f} | {one / two:.2f} (target >= 1.6) |")
    print(f"values agree to {agree:.1e} relative (float32 network, float64 sums)")


# ---------------------------------------------------------------------------- 2. CNN pipeline


class Block(nn.Module):
    """A basic residual block; ``inplace=False``: no in-place op (a new tensor per ReLU)."""

    def __init__(self, c_in: int, c_out: int, stride: int, inplace: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=inplace)
        self.skip = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(h)) + self.skip(x))


def resnet(width: int = 32, classes: int = 10) -> nn.Module:
    """A small ResNet for 3×32×32 inputs, three stages (w, 2w, 2w channels at 32, 16, 8 pixels);
    width 8 gives 10,226 weights (10 classes): the quick mode's net."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 2 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, classes),
    )  # fmt: skip


def resnet4(width: int = 16, classes: int = 10) -> nn.Module:
    """A CIFAR ResNet with four stages (w, 2w, 4w, 8w channels at 32, 16, 8, 4 pixels; most
    weights where the images are small, as in ResNet-18): width 16 gives 308,826 weights,
    width 8 gives 78,002 (10 classes). The full mode's net."""
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        Block(w, w, 1), Block(w, 2 * w, 2), Block(2 * w, 4 * w, 2), Block(4 * w, 8 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * w, classes),
    )  # fmt: skip


def resnet_plain(widths: tuple[int, int, int] = (32, 64, 80), classes: int = 10) -> nn.Module:
    """A ResNet-style BatchNorm CNN for 3×32×32 inputs WITHOUT in-place ops (every ReLU makes a
    new tensor, as in most user code): three stages of ``widths`` channels at 32, 16, 8 pixels;
    the default gives 187,306 weights (10 classes). Beside `resnet4` (in-place ReLU) it is the
    second CNN of ``benchmarks/ggn_operator_memory.py`` (``--ggn-memory``): 32 channels at full
    resolution, so its cached GGN graphs hold 2.4 MiB per row (`resnet4` width 16: 1.4 MiB) and
    a double backward costs more than the stateless product's forward."""
    a, b, c = widths
    return nn.Sequential(
        nn.Conv2d(3, a, 3, 1, 1, bias=False), nn.BatchNorm2d(a), nn.ReLU(),
        Block(a, a, 1, False), Block(a, b, 2, False), Block(b, c, 2, False),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes),
    )  # fmt: skip


#: The two CNNs of the GGN-operator memory check: name -> (builder, description).
CNNS = {
    "resnet4 (in-place ReLU)": (lambda: resnet4(16), "4 stages 16-32-64-128, in-place ReLU"),
    "resnet_plain (no in-place)": (resnet_plain, "3 stages 32-64-80, no in-place op"),
}


def synthetic(n: int, classes: int = 10, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=gen)
    y = (x[:, 0, :8, :8].mean((1, 2)) * 40).long().clamp(-5, 4) + 5
    return x, y % classes


def cnn_pipeline(
    n: int, width: int, subnet: int, draws: int, swa_epochs: int, full: bool = False
) -> list[tuple]:
    """Every pipeline step on ``n`` synthetic images; rows (step, N, D, K, s, MB, peak MB).

    ``full``: the four-stage `resnet4` and chunks of at most 128 rows in every data pass (GGN
    products, BatchNorm refresh and ESS likelihood, Laplace Jacobian blocks), so memory is
    bounded by the chunk; else the quick three-stage `resnet` with the quick mode's chunks.
    """
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

    make = resnet4 if full else resnet
    chunk = 128 if full else 256
    torch.manual_seed(0)
    net, lik = make(width), likelihoods.Categorical()
    x, y = synthetic(n)
    d = sum(p.numel() for p in net.parameters())
    rows = []

    def step(name, k, fn):
        with PeakMemory() as mem:
            start = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - start
        rows.append((name, n, d, k, seconds, mem.mb, mem.hwm_mb))
        return result

    collector = subspaces.SWACollector(net, max_snapshots=10)

    def swa():
        fit_map(net, lik, x, y, epochs=1, batch_size=64, lr=1e-3, progress=False,
                optimizer="sgd", collector=collector, swa_epochs=swa_epochs, swa_lr=1e-3)  # fmt: skip
        return subspaces.pca(collector, min(5, swa_epochs))

    pca = step(f"SWA ({swa_epochs} epochs) + PCA", min(5, swa_epochs), swa)

    def ess():
        model = SubspaceNet(net, pca, lik, temperature="auto")
        kernel = EllipticalSliceSampler(model, chunk_size=chunk, recompute_bn=True)
        MCMC(kernel, draws, 0, disable_progbar=True).run(x, y)

    step(f"ESS ({draws} draws, BN refresh)", pca.rank, ess)
    sel = step("diag-Laplace selection", subnet, lambda: subspaces.subnetwork(
        net, subnet, strategy="diag_laplace", likelihood=lik, x=x,
        chunk_size=None if full else 64))  # fmt: skip

    def laplace():
        guide = AutoSubspaceLaplace(SubspaceNet(net, sel, lik), prior_precision=1.0, chunk_size=64)
        return guide.fit(x, y, find_map=False)

    step("full-cov subnetwork Laplace", subnet, laplace)
    step("top-20 GGN eigenpairs (60 G v)", 20,
         lambda: subspaces.ggn_eigen(net, lik, x, 20, chunk_size=chunk))  # fmt: skip
    keig = step("kfac_eigen rank 20 (one K-FAC pass)", 20,
                lambda: subspaces.kfac_eigen(net, lik, x, 20, chunk_size=chunk))  # fmt: skip

    def ess_kfac():
        model = SubspaceNet(net, keig, lik, temperature="auto")
        kernel = EllipticalSliceSampler(model, chunk_size=chunk, recompute_bn=True)
        MCMC(kernel, draws, 0, disable_progbar=True).run(x, y)

    step(f"ESS ({draws} draws, BN refresh) in kfac_eigen", keig.rank, ess_kfac)
    head = net[-1].in_features
    step("last-layer MoLA (2 members)", (head + 1) * 10,
         lambda: MixtureOfLaplace([net, make(width)], lik, chunk_size=chunk).fit(x, y))  # fmt: skip

    def ecmp():
        model = PatchedNet(net, lik, mode="ecmp", n_components=5, init="copy")
        model.fit(x, y, epochs=1, batch_size=64)

    step("ECMP patches (1 epoch)", 5, ecmp)
    return rows


def resnet18_pipeline(n: int, n_test: int, rank: int, draws: int, members: int, epochs: int,
                      chunk: int = 128, checkpoint: str | None = None) -> list[tuple]:  # fmt: skip
    """The pipeline at ResNet scale (issue 37): ResNet-18 with the CIFAR stem
    (`subnetwork_resnet18.resnet18`, 11.2M weights, BatchNorm) on ``n`` synthetic CIFAR-shaped
    images, every data pass chunked to ``chunk`` rows; rows (step, N, D, K, s, epochs, MB, peak
    MB, test scores or None).

    ``epochs`` SGD epochs (batch 128), the last of them timed alone as the unit of time; SWA at a
    constant rate collecting ``rank`` snapshots (one an epoch) → PCA rank ``rank`` → ``draws``
    elliptical-slice draws with the BatchNorm refresh (Subspace Inference's ``T = N/K``) → their
    Bayesian model average on ``n_test`` images (BatchNorm refreshed for each draw);
    `subspaces.kfac_eigen` rank ``rank`` (one K-FAC pass) → the same draws and average;
    last-layer K-FAC Laplace over ``members`` networks (the first, and ``members − 1`` trained
    the same way from other seeds, their training not timed) → MoLA's probit predictive.

    ``checkpoint``: a folder; after each step its rows, results and networks are saved to
    ``resnet18_n{n}.pt`` there, and a rerun takes every finished step from it (on 2 idle cores
    the pipeline takes about 10 minutes at N = 250 and 35 at N = 1,000, the SWA epochs and the
    draws' BatchNorm refreshes most of it; a checkpoint also lets one step be rerun alone).
    """
    from subnetwork_resnet18 import resnet18
    from kfac_eigen import _bma

    from pyro_subspace import FlatNet, fit_map, likelihoods, metrics, subspaces
    from pyro_subspace.flat import eval_mode
    from pyro_subspace.infer import MixtureOfLaplace

    torch.manual_seed(0)
    net, lik = resnet18(), likelihoods.Categorical()
    x, y = synthetic(n, seed=0)
    x_test, y_test = synthetic(n_test, seed=1)
    d = sum(p.numel() for p in net.parameters())
    path = None if checkpoint is None else os.path.join(checkpoint, f"resnet18_n{n}.pt")
    state = {"rows": [], "results": {}, "net": None, "members": []}
    if path is not None and os.path.exists(path):
        state = torch.load(path, weights_only=False)
        print(f"# resumed from {path}: {list(state['results'])}", flush=True)
    rows = state["rows"]

    def save():
        if path is None:
            return
        os.makedirs(checkpoint, exist_ok=True)
        state["net"] = net.state_dict()
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # a kill while saving keeps the previous checkpoint

    def step(name, k, fn):
        if name in state["results"]:
            print(f"# {name}: from the checkpoint", flush=True)
            return state["results"][name]
        with PeakMemory() as mem:
            start = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - start
        scores = result if isinstance(result, dict) else None
        rows.append((name, n, d, k, seconds, seconds / rows[0][4], mem.mb, mem.hwm_mb, scores))
        print(f"# {name}: {seconds:.1f} s, peak RSS {mem.hwm_mb:.0f} MB", flush=True)
        state["results"][name] = result
        save()
        return result

    def train(model, seed, count):
        fit_map(model, lik, x, y, epochs=count, batch_size=128, lr=0.05, optimizer="sgd",
                seed=seed, progress=False)  # fmt: skip

    def test_scores(model):
        flat = FlatNet(model)
        with torch.no_grad(), eval_mode(model):
            probs = torch.softmax(flat.chunked(flat.vector(), x_test, chunk), -1)
        return metrics.classification_scores(probs.double(), y_test)

    if state["net"] is None:
        if epochs > 1:
            train(net, 0, epochs - 1)
        with PeakMemory() as mem:
            start = time.perf_counter()
            train(net, 100, 1)
            epoch = time.perf_counter() - start
        rows.append((f"one training epoch (SGD, batch 128; {epochs} in all)", n, d, 0, epoch, 1.0,
                     mem.mb, mem.hwm_mb, None))  # fmt: skip
        state["results"]["map"] = test_scores(net)
        save()
    else:
        net.load_state_dict(state["net"])  # the network after the last finished step
    map_scores = state["results"]["map"]

    def swa():
        collector = subspaces.SWACollector(net, max_snapshots=rank)
        fit_map(net, lik, x, y, epochs=0, batch_size=128, lr=0.05, optimizer="sgd", seed=1,
                progress=False, collector=collector, swa_epochs=rank, swa_lr=0.01)  # fmt: skip
        return subspaces.pca(collector, rank)

    pca = step(f"SWA ({rank} epochs) + PCA rank {rank}", rank, swa)
    step(f"{draws} ESS draws (BN refresh) + BMA, PCA", rank,
         lambda: _bma(net, lik, pca, x, y, x_test, y_test, draws, 0, chunk, seed=0))  # fmt: skip
    keig = step(f"kfac_eigen rank {rank} (one K-FAC pass)", rank,
                lambda: subspaces.kfac_eigen(net, lik, x, rank, chunk_size=chunk))  # fmt: skip
    step(f"{draws} ESS draws (BN refresh) + BMA, kfac_eigen", rank,
         lambda: _bma(net, lik, keig, x, y, x_test, y_test, draws, 0, chunk, seed=0))  # fmt: skip
    nets = [net]
    for seed in range(1, members):
        torch.manual_seed(seed)
        other = resnet18()
        if len(state["members"]) >= seed:
            other.load_state_dict(state["members"][seed - 1])
        else:
            train(other, seed, epochs)
            state["members"].append(other.state_dict())
            save()
        nets.append(other.eval())

    def mola():
        mixture = MixtureOfLaplace(nets, lik, hessian_structure="kron", chunk_size=chunk)
        mixture.fit(x, y)
        probs = mixture.predict(x_test, method="probit").probs
        return metrics.classification_scores(probs.double(), y_test)

    head = net[-1].in_features
    step(f"last-layer K-FAC MoLA ({members} members)", (head + 1) * 10, mola)
    return rows + [("MAP network (after SWA's start)", n, d, 0, 0.0, 0.0, 0.0, 0.0, map_scores)]


def _resnet18_worker(args: tuple, out) -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    out.put(resnet18_pipeline(*args))


def print_resnet18(rows: list[tuple]) -> None:
    """The ResNet-18 rows: time in training epochs and peak RSS per step and N, test scores."""
    ns = sorted({r[1] for r in rows})
    steps = list(dict.fromkeys(r[0] for r in rows if r[4] > 0))
    at = {(r[0], r[1]): r for r in rows}
    print(f"\n## ResNet-18 pipeline (CIFAR stem, D = {rows[0][2]:,}, BatchNorm, 3x32x32 synthetic):"
          " time (s) / training epochs / peak RSS (MB)")  # fmt: skip
    print("| step | K | " + " | ".join(f"N = {n}" for n in ns) + " |")
    print("|---|---|" + "---|" * len(ns))
    for name in steps:
        cells = [at.get((name, n)) for n in ns]
        k = next(c[3] for c in cells if c)
        print(f"| {name} | {k} | " + " | ".join(
            f"{c[4]:.1f} / {c[5]:.2f} / {c[7]:.0f}" if c else "" for c in cells) + " |")  # fmt: skip
    print("\n| test scores (N = {}) | accuracy | NLL | ECE |".format(ns[-1]))
    print("|---|---|---|---|")
    for r in rows:
        if r[1] == ns[-1] and r[8] is not None:
            sc = r[8]
            print(f"| {r[0]} | {sc['acc']:.3f} | {sc['nll']:.3f} | {sc['ece']:.3f} |")


def _pipeline_worker(args: tuple, out) -> None:
    torch.set_num_threads(1)
    out.put(cnn_pipeline(*args))


def _fresh(worker, args: tuple, timeout: float) -> list[tuple]:
    """``worker(args, queue)`` in a fresh spawned process (no memory held over from other
    configurations); its rows, or a ``RuntimeError`` as soon as it dies without them."""
    import queue

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=worker, args=(args, out))
    proc.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            rows = out.get(timeout=10)
            break
        except queue.Empty:
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{worker.__name__}{args}: died (exit code {proc.exitcode})")
    proc.join()
    return rows


def cnn_pipeline_fresh(*args) -> list[tuple]:
    """`cnn_pipeline` in a fresh spawned process."""
    return _fresh(_pipeline_worker, args, 7200)


def resnet18_fresh(*args) -> list[tuple]:
    """`resnet18_pipeline` in a fresh spawned process."""
    return _fresh(_resnet18_worker, args, 4 * 3600)


def print_pipeline(rows: list[tuple]) -> None:
    print("\n## CNN pipeline (ResNet-style, BatchNorm, 3x32x32 synthetic)")
    print("| step | N | D | K (MoLA: per member) | time (s) | RSS increase (MB) | peak RSS (MB) |")
    print("|---|---|---|---|---|---|---|")
    for name, n, d, k, s, mb, hwm in rows:
        print(f"| {name} | {n} | {d:,} | {k} | {s:.2f} | {mb:.0f} | {hwm:.0f} |")


def print_growth(rows: list[tuple]) -> None:
    """Per step: time and peak RSS at each N (largest D), the time ratio to the smallest N
    against the ratio of N (linear cost), and each step at both D for the middle N."""
    d_max = max(r[2] for r in rows)
    big = [r for r in rows if r[2] == d_max]
    ns = sorted({r[1] for r in big})
    steps = list(dict.fromkeys(r[0] for r in big))
    at = {(r[0], r[1], r[2]): r for r in rows}
    print(f"\n## Growth in N at D = {d_max:,}: time (s) / peak RSS (MB); time ratio vs N ratio")
    print("| step | " + " | ".join(f"N = {n}" for n in ns) + f" | t({ns[-1]}) / t({ns[0]}) |")
    print("|---|" + "---|" * (len(ns) + 1))
    for name in steps:
        cells = [at[name, n, d_max] for n in ns]
        ratio = cells[-1][4] / cells[0][4]
        print(f"| {name} | " + " | ".join(f"{c[4]:.1f} / {c[6]:.0f}" for c in cells)
              + f" | {ratio:.2f} (N: {ns[-1] / ns[0]:.0f}x) |")  # fmt: skip
    small = sorted({r[2] for r in rows if r[2] != d_max})
    if not small:
        return
    for d in small:
        n = next(r[1] for r in rows if r[2] == d)
        print(f"\n## Growth in D at N = {n}: time (s) / peak RSS (MB)")
        print(f"| step | D = {d:,} | D = {d_max:,} | time ratio (D: {d_max / d:.1f}x) |")
        print("|---|---|---|---|")
        for name in steps:
            a, b = at.get((name, n, d)), at.get((name, n, d_max))
            if a and b:
                print(f"| {name} | {a[4]:.1f} / {a[6]:.0f} | {b[4]:.1f} / {b[6]:.0f} "
                      f"| {b[4] / a[4]:.2f} |")  # fmt: skip


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
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small N everywhere")
    mode.add_argument("--full", action="store_true",
                      help="the issue's sizes: N = 10^6 scaling, a 309k-weight CNN")  # fmt: skip
    parser.add_argument("--rows", type=int, default=None, help="strong-scaling N")
    parser.add_argument("--scaling-only", action="store_true",
                        help="only the strong-scaling table (needs a quiet machine)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ggn-memory", action="store_true",
                        help="only the GGNOperator memory/time check on both CNNs "
                        "(benchmarks/ggn_operator_memory.py, its defaults)")  # fmt: skip
    parser.add_argument("--resnet18", action="store_true",
                        help="only the ResNet-18 pipeline rows (~45 min; --quick: a smoke run)")  # fmt: skip
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="--resnet18: save each finished step in DIR and resume from it")  # fmt: skip
    parser.add_argument(
        "--cnn-rows",
        default=None,
        help="full mode: comma-separated N for the CNN (default 256,512,1024)",
    )
    args = parser.parse_args()
    if args.ggn_memory:
        import ggn_operator_memory

        ggn_operator_memory.main([])
        return
    torch.set_num_threads(1)
    load = os.getloadavg()
    threads = os.environ.get("BENCH_THREADS", "2") if args.resnet18 else "1"  # (its worker's)
    print(f"# benchmarks/scale.py  {datetime.date.today()}  torch threads {threads} per process, "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")  # fmt: skip
    if args.resnet18:
        table = []
        if args.quick:  # a smoke run: every step on 32 images, rank 2, 2 draws, 2 members
            table += resnet18_fresh(32, 32, 2, 2, 2, 1, 16, args.checkpoint)
        else:
            for n in [int(v) for v in (args.cnn_rows or "250,1000").split(",")]:
                table += resnet18_fresh(n, 1000, 20, 10, 3, 2, 128, args.checkpoint)
        print_resnet18(table)
    elif args.scaling_only:
        strong_scaling(args.rows or 1_000_000, args.rounds, shape=(10, 200))
    elif args.full:
        cnn_rows = [int(v) for v in (args.cnn_rows or "256,512,1024").split(",")]
        strong_scaling(args.rows or 1_000_000, args.rounds, shape=(10, 200))
        table = []
        for n in cnn_rows:
            table += cnn_pipeline_fresh(n, 16, 5000, 10, 5, True)
        table += cnn_pipeline_fresh(cnn_rows[len(cnn_rows) // 2], 8, 5000, 10, 5, True)
        print_pipeline(table)
        print_growth(table)
        streaming(200_000)
    else:
        strong_scaling(args.rows or (100_000 if args.quick else 1_000_000), args.rounds)
        table = []
        sizes = [(64, 8), (128, 8)] if args.quick else [(256, 48), (512, 48), (512, 64)]
        for n, width in sizes:
            table += cnn_pipeline(n, width, subnet=500 if args.quick else 5000,
                                  draws=5 if args.quick else 20, swa_epochs=3 if args.quick else 5)  # fmt: skip
        print_pipeline(table)
        streaming(20_000 if args.quick else 200_000)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
