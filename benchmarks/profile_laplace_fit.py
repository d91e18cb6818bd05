"""Where the time and memory of a subnetwork Laplace fit go: ours vs laplace-torch (issue 13).

The tasks of `laplace_vs_laplace_torch` part (a) (diabetes 10-50-50-1, N = 397; digits
64-64-64-10, N = 1437; K = 1000 diag-Laplace weights, float32, one thread): interleaved best-of
fit times, then one cProfile of each fit (ours: ``AutoSubspaceLaplace.fit`` with
``find_map=False``; laplace-torch: BackPack GGN, DataLoader batch 512, with its posterior
covariance), the top entries by own time. Then the peak RSS of our fit by stage (guide
construction, GGN, posterior) on the memory task of part (b) (N = 16000, synthetic), first and
second fit in one process (the first pays one-time initialisation).

    python benchmarks/profile_laplace_fit.py [--tasks diabetes digits] [--top 14]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import subprocess
import sys
from functools import partial

import laplace_vs_laplace_torch as bench
import torch

from pyro_subspace.infer.laplace import guide as guide_module
from pyro_subspace.nn import evaluator as evaluator_module


def profile_table(fn, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
    total = next(ln for ln in lines if "function calls" in ln).split("in ")[-1]
    shorten = lambda ln: ln.replace(os.path.dirname(torch.__file__) + "/", "torch/")
    body = [shorten(ln).replace(os.getcwd() + "/", "") for ln in lines[start:]]
    return f"      total {total}\n" + "\n".join("      " + ln[:150] for ln in body)


def part_time(args, Laplace) -> None:
    for name in args.tasks:
        task = bench.make_task(name, 1000, 1.0, False)
        lik = task.likelihood(torch.float32)
        net, x, y, _ = task.cast(torch.float32)
        lt_net, lt_x, lt_y, _ = task.cast(torch.float32)
        fits = {
            "ours": partial(bench.fit_ours, task, net, x, y, lik, args.chunk_size),
            "laplace-torch": partial(
                bench.fit_theirs, Laplace, task, lt_net, lt_x, lt_y, 512, "BackPackGGN"
            ),
        }
        times, _ = bench.best_of(fits, args.repeats)
        print(f"{name} (N = {task.x.shape[0]}): best of {args.repeats} interleaved fits: " +
              ", ".join(f"{k} {v:.3f} s" for k, v in times.items()) +
              f", ratio {times['laplace-torch'] / times['ours']:.2f}x")  # fmt: skip
        for key, fn in fits.items():
            print(f"    cProfile, {key}:")
            print(profile_table(fn, args.top))
        print()


def part_memory(args) -> None:
    n, k = 16000, 1000
    torch.manual_seed(0)
    net = bench.mlp(64, 10, bench.HIDDEN["synthetic"]).eval()
    x, y = torch.randn(n, 64), torch.randint(0, 10, (n,))
    d = sum(p.numel() for p in net.parameters())
    idx = torch.randperm(d, generator=torch.Generator().manual_seed(0))[:k].sort().values
    task = bench.Task("synthetic", False, net, x, y, x[:1], None, idx, 1.0)
    state: dict = {}

    def stage(label: str) -> None:
        peak, now = bench.peak_rss(), bench._status_bytes("VmRSS")
        mb = lambda b: b / 2**20
        state["rows"].append(
            f"      {label:<18} peak {mb(peak - state['base']):6.1f} MB above the stage start, "
            f"RSS {mb(now - state['start']):6.1f} MB above the fit start"
        )
        state["base"] = bench.reset_peak_rss()

    ggn, post = evaluator_module.Evaluator.ggn, guide_module.AutoSubspaceLaplace._set_posterior

    def traced_ggn(self, *a, **kw):
        stage("construction")
        out = ggn(self, *a, **kw)
        stage("GGN")
        return out

    def traced_post(self, *a, **kw):
        stage("(statistics)")
        out = post(self, *a, **kw)
        stage("posterior")
        return out

    evaluator_module.Evaluator.ggn = traced_ggn
    guide_module.AutoSubspaceLaplace._set_posterior = traced_post
    print(f"Peak RSS by stage, digits-shaped MLP, N = {n}, K = {k}, chunk {args.chunk_size}:")
    try:
        for run in ("first", "second"):
            state["rows"] = []
            state["start"] = state["base"] = bench.reset_peak_rss()
            fitted = bench.fit_ours(task, net, x, y, task.likelihood(), args.chunk_size)
            print(f"    {run} fit in this process:")
            print("\n".join(state["rows"]))
            del fitted
    finally:
        evaluator_module.Evaluator.ggn = ggn
        guide_module.AutoSubspaceLaplace._set_posterior = post


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="*", default=["diabetes", "digits"])
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.memory_only:
        part_memory(args)
        return
    Laplace, info = bench.load_laplace()
    if Laplace is None:
        raise SystemExit(f"laplace-torch is needed here: {info}")
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"torch {torch.__version__}, 1 thread, laplace-torch {info}, load average {load}")
    print()
    part_time(args, Laplace)
    if not args.no_memory:  # a fresh process with glibc's mmap threshold fixed, as in (b)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        cmd = [sys.executable, __file__, "--memory-only", "--chunk-size", str(args.chunk_size)]
        print(subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load average at end {load}")


if __name__ == "__main__":
    main()
