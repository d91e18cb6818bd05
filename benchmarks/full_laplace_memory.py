"""Peak memory and time of the full-covariance Laplace structure at large ``K``, today's code
against the code before issue 37 (``git show <commit>:pyro_subspace/infer/laplace/posteriors/full.py``
imported beside it), each configuration in a fresh spawned process.

The work, with ``N·C ≥ K`` GGN rows (the GGN is formed; no Woodbury shortcut):

1. fit: ``PᵀGP`` from ``r`` random Jacobian rows (seeded) through the library's accumulation
   (`gram.gram_from_blocks`, as `Evaluator.ggn` calls it) and ``Σ`` for one ``λ`` (`set_prior`);
2. evidence: ``log|PᵀGP/T + λI|`` at that ``λ`` (`log_det`);
3. GLM predictive: ``J Σ Jᵀ`` for ``m`` rows of ``J`` (`functional_covariance`, in blocks of
   ``10⁶`` numbers, the library's `jacobians.INDEX_JACOBIAN_NUMBERS`, at least 8 points);
4. evidence for ``"marglik"`` (``--marglik``): ``log_det`` at another ``λ`` (the GGN's
   eigenvalues, both codes).

Memory: the process's peak RSS over its baseline after the Jacobian rows are drawn (``VmHWM``
reset at the start, minus the RSS then), in bytes and in ``K × K`` matrices of the buffers'
dtype. ``--paper``: today's code alone at the paper's ``K = 42,438`` in float32 from a GGN
built as ``B Bᵀ`` of a ``(K, 512)`` ``B`` (the accumulation of 45,000 rows would add half an
hour and nothing to the structure's memory).

    python benchmarks/full_laplace_memory.py --k 5000,8000 --old f8cb388~1
    flock /tmp/pyro_subspace_heavy.lock nice python benchmarks/full_laplace_memory.py --paper
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = "pyro_subspace/infer/laplace/posteriors/full.py"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def load_full(commit: str | None):
    """The `FullPosterior` class of today's code (``None``) or of ``commit``."""
    if commit is None:
        from pyro_subspace.infer.laplace.posteriors.full import FullPosterior

        return FullPosterior
    import pyro_subspace.infer.laplace.posteriors  # noqa: F401 - the package of its imports

    source = subprocess.run(
        ["git", "show", f"{commit}:{PATH}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = os.path.join(tempfile.mkdtemp(), "full_old.py")
    with open(path, "w") as f:
        f.write(source)
    name = "pyro_subspace.infer.laplace.posteriors.full_old"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.FullPosterior


class RowsEvaluator:
    """What `FullPosterior.fit_curvature` asks of an `Evaluator`: ``ggn(t, dtype, rows)`` as
    `Evaluator.ggn` computes it (`gram.gram_from_blocks` over blocks of rows, the rows first
    offered to `RootRows`), from ``r`` seeded random rows; or ``B Bᵀ`` (``lowrank``)."""

    temperature = 1.0

    def __init__(self, k: int, r: int, dtype, lowrank: int = 0) -> None:
        from types import SimpleNamespace

        gen = torch.Generator().manual_seed(0)
        # in-memory data of r points (one row each), as `Evaluator.data` says
        self.data = SimpleNamespace(loader=None, sharded=False, local_num_data=r)
        self.k, self.dtype, self.lowrank = k, dtype, lowrank
        if lowrank:
            self.b = torch.randn(k, lowrank, generator=gen, dtype=dtype) / lowrank**0.5
        else:
            self.blocks = [
                torch.randn(min(500, r - s), 1, k, generator=gen, dtype=dtype).div_(10.0)
                for s in range(0, r, 500)
            ]

    def ggn(self, t, diagonal=False, dtype=torch.float64, rows=None, **kwargs):
        from pyro_subspace.curvature.gram import gram_from_blocks

        if self.lowrank:
            out = torch.empty(self.k, self.k, dtype=dtype)
            for s in range(0, self.k, 2048):
                torch.mm(self.b[s : s + 2048], self.b.T, out=out[s : s + 2048])
            out.diagonal().add_(1.0)
            return out
        blocks = ((None, a) for a in self.blocks)
        if rows is not None:
            blocks = rows.tap(blocks)
        return gram_from_blocks(blocks, dtype=dtype)


def run_one(commit, k, r, m, dtype_name, marglik, lowrank, out) -> None:
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    from pyro_subspace.infer.laplace.posteriors.base import PriorPrecision
    from pyro_subspace.linalg import blas_threads

    dtype = getattr(torch, dtype_name)
    cls = load_full(commit)
    ev = RowsEvaluator(k, r, dtype, lowrank)
    gen = torch.Generator().manual_seed(1)
    # J in the library's blocks (`jacobians.INDEX_JACOBIAN_NUMBERS` numbers, 10^6 / (10 K) points,
    # but at least `jacobians.MIN_INDEX_POINTS`: 8 points, which changes only K > 12,500)
    from pyro_subspace.curvature.jacobians import INDEX_JACOBIAN_NUMBERS, MIN_INDEX_POINTS

    n = max(MIN_INDEX_POINTS, INDEX_JACOBIAN_NUMBERS // (10 * k))
    jac = [torch.randn(min(n, m // 10 - s), 10, k, generator=gen, dtype=dtype) for s in range(0, m // 10, n)]
    with blas_threads():
        pass  # threadpoolctl's first use allocates: before the baseline
    t = torch.zeros(k, dtype=torch.float64)
    prior = PriorPrecision(torch.tensor(50.0, dtype=torch.float64), None, k)
    other = PriorPrecision(torch.tensor(80.0, dtype=torch.float64), None, k)
    times = {}
    _reset_hwm()
    base = _rss()
    out.put(("base", base))
    post = cls(k, dtype=dtype)
    start = time.perf_counter()
    post.fit_curvature(ev, t)
    times["ggn"] = time.perf_counter() - start
    out.put(("step", f"GGN formed in {times['ggn']:.0f} s; factorising"))
    start = time.perf_counter()
    post.set_prior(prior)
    times["factor"] = time.perf_counter() - start
    out.put(("step", f"factor formed in {times['factor']:.0f} s"))
    start = time.perf_counter()
    logdet = float(post.log_det(prior))
    times["evidence"] = time.perf_counter() - start
    start = time.perf_counter()
    f_var = 0.0
    for j in jac:
        f_var += float(post.functional_covariance(j).diagonal(dim1=-2, dim2=-1).double().sum())
    times["predictive"] = time.perf_counter() - start
    peak = _hwm() - base
    if marglik:
        start = time.perf_counter()
        float(post.log_det(other))
        times["marglik"] = time.perf_counter() - start
    peak_all = _hwm() - base
    out.put(("done", (times, peak, peak_all, logdet, f_var)))


def fresh(*args, limit: float | None = None):
    """`run_one` in a fresh spawned process; with ``limit`` (seconds) the worker's peak RSS
    (``VmHWM`` read from ``/proc``) is followed from outside and the worker stopped at the
    limit: returns ``(None, peak over its baseline, steps reached)`` then."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=run_one, args=(*args, out))
    proc.start()
    kind, base = out.get(timeout=3600)
    start, steps, peak = time.perf_counter(), [], 0
    while True:
        try:
            kind, value = out.get(timeout=1.0)
        except Exception:  # queue.Empty: the worker still runs
            kind = None
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
            peak = max(peak, hwm - base)
        except (OSError, StopIteration):
            pass
        if kind == "step":
            steps.append(f"{value} ({time.perf_counter() - start:.0f} s)")
        elif kind == "done":
            proc.join()
            return value
        if limit is not None and time.perf_counter() - start > limit:
            proc.terminate()
            proc.join()
            return None, peak, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", default="5000,8000")
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--old", default=None, help="commit of the code to compare with")
    parser.add_argument("--rows-over-k", type=float, default=1.125, help="r = this x K rows")
    parser.add_argument("--m", type=int, default=2000, help="rows of J (predictive)")
    parser.add_argument("--marglik", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, old and today interleaved")
    parser.add_argument("--paper", action="store_true", help="K = 42,438 float32, today's code")
    parser.add_argument("--limit", type=float, default=None,
                        help="stop each worker after this many seconds, reporting its peak so far")  # fmt: skip
    args = parser.parse_args()
    threads = int(os.environ.get("BENCH_THREADS", "2"))
    print(f"# benchmarks/full_laplace_memory.py {' '.join(sys.argv[1:])}")
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch "
          f"{torch.__version__}, torch.get_num_threads() = {threads} per process, load "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} (uptime) at the start")  # fmt: skip
    from pyro_subspace import linalg

    print(f"# in-place Cholesky factor and inverse: blocked on torch's BLAS (blocks of "
          f"{linalg.FACTOR_BLOCK}) above {linalg.BLOCKED_ROW_BYTES:,} bytes per row "
          "(float32 K > 16,384), SciPy's LAPACK below")  # fmt: skip
    configs = []
    if args.paper:
        configs.append((None, 42438, 0, 10000, "float32", False, 8))
    else:
        for k in (int(v) for v in args.k.split(",")):
            r = int(args.rows_over_k * k)
            for commit in ([args.old] if args.old else []) + [None]:
                configs.append((commit, k, r, args.m, args.dtype, args.marglik, 0))
    print(f"{'code':<10} {'K':>6} {'rows':>6} {'dtype':>7} {'GGN s':>7} {'factor s':>8} "
          f"{'evid. s':>7} {'pred. s':>7} {'total s':>8} {'peak GB':>8} {'K x K':>6} "
          f"{'marglik s':>9} {'peak GB':>8} {'K x K':>6}", flush=True)  # fmt: skip
    results = {}
    for cfg in [c for _ in range(args.rounds) for c in configs]:  # A B A B: rounds interleaved
        commit, k, r, m, dtype, marglik, lowrank = cfg
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size() * k * k
        result = fresh(*cfg, limit=args.limit)
        if result[0] is None:  # stopped at --limit
            _, peak, steps = result
            print(f"{commit or 'today':<10} {k:6d} {r if r else 'BBᵀ':>6} {dtype:>7} stopped after "
                  f"{args.limit:.0f} s; peak so far {peak / 1e9:.2f} GB = {peak / size:.2f} K x K; "
                  f"reached: {'; '.join(steps) or 'the GGN'}", flush=True)  # fmt: skip
            continue
        times, peak, peak_all, logdet, f_var = result
        total = times["ggn"] + times["factor"] + times["evidence"] + times["predictive"]
        best = results.get((commit, k), (float("inf"),))[0]
        results[(commit, k)] = (min(total, best), logdet, f_var)
        extra = (
            f"{times['marglik']:9.1f} {peak_all / 1e9:8.2f} {peak_all / size:6.2f}"
            if "marglik" in times else ""
        )  # fmt: skip
        print(f"{commit or 'today':<10} {k:6d} {r if r else 'BBᵀ':>6} {dtype:>7} "
              f"{times['ggn']:7.1f} {times['factor']:8.1f} {times['evidence']:7.1f} "
              f"{times['predictive']:7.1f} {total:8.1f} {peak / 1e9:8.2f} {peak / size:6.2f} "
              + extra, flush=True)  # fmt: skip
    if args.old:
        print(f"\ntoday / old, fit + evidence + predictive (best of {args.rounds} rounds' totals; "
              "|Δ log det| / |log det|, |Δ Σ var| / Σ var: the same numbers)")
        for k in (int(v) for v in args.k.split(",")):
            (t_old, ld_old, fv_old), (t_new, ld_new, fv_new) = results[(args.old, k)], results[(None, k)]
            print(f"K = {k}: {t_new / t_old:.2f}x time; {abs(ld_new - ld_old) / abs(ld_old):.1e}; "
                  f"{abs(fv_new - fv_old) / abs(fv_old):.1e}")  # fmt: skip
    print(f"# load at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
