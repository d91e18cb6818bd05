"""Top-20 GGN eigenpairs: our Lanczos solvers vs ARPACK (``scipy.sparse.linalg.eigsh``).

Table 1, the target's comparison: every solver gets the SAME product, a fresh
`curvature.GGNOperator` per run (the network's graphs built once, two backward passes per
product; its build time is inside every timing), as a ``scipy.sparse.linalg.LinearOperator``
whose ``matvec``/``matmat`` are ``GGNOperator.matvec``/``matmat``, float64, the same start
vector ``v0`` for the tolerance-driven solvers, the same stopping test (every one of the top-20
Ritz residuals ``‖G y − θ y‖ <= TOL · |θ|``), and products counted inside the operator (a block
of ``b`` counts ``b``):

- ``eigsh(op, k=20, which="LA", tol=TOL, v0=v0)`` (implicitly restarted Lanczos, ncv = 41);
- `thick_restart_lanczos_eigh` (tests convergence after every product, every second one
  while far from converged);
- `block_lanczos_eigh` for ``--blocks`` (batched products), and `lanczos_eigh` (fixed 3k = 60
  products, no stopping test) for reference.

Columns: wall time (best of ``--repeats`` rounds, interleaved, one thread), products, the part
of the time spent inside the operator and the rest (the solver's own work), the speed-up over
eigsh, and the largest relative difference of the top-20 eigenvalues to eigsh at
``tol = 1e-12`` and, where the GGN fits in memory, to dense ``torch.linalg.eigvalsh``.

Table 2, the library as called: `subspaces.ggn_eigen(rank=20, tol=TOL)` (GGNOperator +
thick-restart Lanczos) against eigsh handed the stateless `ggn_vector_product` (one
dual-number forward + one backward per product, since 2026-11-24) and the product as it was
before (``jvp``, then ``vjp``). This measures mostly the product, which eigsh could also be
given (table 1).

Problems: diabetes, MLP 10-50-50-1 (Tanh, Gaussian, D = 3151, N = 397) and digits, MLP
64-100-30-10 (Tanh, Categorical, D = 9840, N = 1437), each trained by `fit_map`.

    python benchmarks/lanczos_vs_arpack.py [--quick] [--repeats 5] [--tol 1e-6] [--blocks 2,4,10]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator, eigsh
from torch import nn

from pyro_subspace import datasets, fit_map, likelihoods, subspaces
from pyro_subspace.curvature import (
    GGNOperator,
    block_lanczos_eigh,
    full_jacobians,
    ggn_vector_product,
    lanczos_eigh,
    thick_restart_lanczos_eigh,
)
from pyro_subspace.curvature import ggn as ggn_module
from pyro_subspace.curvature.output_hessian import hessian_factor


def mlp(n_in: int, n_out: int, hidden: tuple[int, ...]) -> nn.Sequential:
    layers, width = [], n_in
    for h in hidden:
        layers += [nn.Linear(width, h), nn.Tanh()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, n_out))


def problem(name: str, quick: bool):
    """(label, net (float64, eval), likelihood, x float64, dense-able)."""
    torch.manual_seed(0)
    if name == "diabetes":
        data, hidden, lik = datasets.diabetes(), (50, 50), likelihoods.Gaussian(sigma_init=1.0)
        n_out = 1
    else:
        data, hidden, lik = datasets.digits(), (100, 30), likelihoods.Categorical()
        n_out = 10
    x, y = data.x_train, data.y_train
    if quick:
        x, y = x[:200], y[:200]
        hidden = tuple(h // 2 for h in hidden)
    net = mlp(x.shape[1], n_out, hidden)
    fit_map(
        net,
        lik,
        x,
        y,
        epochs=50 if quick else 300,
        lr=1e-2,
        weight_decay=1.0 / x.shape[0],
        seed=0,
        progress=False,
    )
    if name == "diabetes":  # fix σ at the MAP's value (a Gaussian with fixed noise)
        lik = likelihoods.Gaussian(sigma=float(lik.sigma.detach()))
    d = sum(p.numel() for p in net.parameters())
    label = f"{name} MLP {x.shape[1]}-{'-'.join(map(str, hidden))}-{n_out}, D = {d}, N = {len(x)}"
    return label, net.double().eval(), lik, x.double(), d <= 4000


def dense_top(net, lik, x, k: int) -> np.ndarray:
    d = sum(p.numel() for p in net.parameters())
    rows = [
        torch.einsum("noc,nod->ncd", hessian_factor(lik, out), jac).reshape(-1, d)
        for out, jac in full_jacobians(net, x)
    ]
    a = torch.cat(rows)
    return torch.linalg.eigvalsh(a.T @ a).flip(0)[:k].numpy()


class Timed:
    """The operator's products, counted and timed."""

    def __init__(self, op: GGNOperator) -> None:
        self.op, self.products, self.seconds = op, 0, 0.0

    def matvec(self, v):
        t0 = time.perf_counter()
        out = self.op.matvec(torch.from_numpy(np.ascontiguousarray(v).reshape(-1))).numpy()
        self.seconds += time.perf_counter() - t0
        self.products += 1
        return out

    def matmat(self, v):
        t0 = time.perf_counter()
        out = self.op.matmat(torch.from_numpy(np.ascontiguousarray(v))).numpy()
        self.seconds += time.perf_counter() - t0
        self.products += v.shape[1]
        return out

    def torch_matvec(self, v: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.matvec(v.numpy()))

    def torch_matmat(self, v: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.matmat(v.numpy()))


def rounds(runs: dict, repeats: int) -> tuple[dict, dict]:
    """Best time and last result (values, products, seconds in products) per run, interleaved."""
    best, results = {}, {}
    for r in range(repeats + 1):  # round 0: warm-up, not timed
        for key, run in runs.items():
            t0 = time.perf_counter()
            results[key] = run()
            dt = time.perf_counter() - t0
            if r > 0 and dt < best.get(key, (float("inf"),))[0]:
                best[key] = (dt, results[key][2])
    return best, results


def compare(name: str, args: argparse.Namespace) -> None:
    """Print both tables for one problem."""
    k, tol = args.k, args.tol
    blocks = [int(b) for b in args.blocks.split(",") if b]
    label, net, lik, x, small = problem(name, args.quick)
    d = sum(p.numel() for p in net.parameters())
    v0 = np.random.default_rng(0).standard_normal(d)

    def solve(method):
        def run():
            op = Timed(GGNOperator(net, lik, x))  # built inside the timing, for every solver
            values = method(op)
            return np.asarray(values), op.products, op.seconds

        return run

    def arpack(op, t=tol):
        lin = LinearOperator((d, d), matvec=op.matvec, matmat=op.matmat, dtype=np.float64)
        return np.sort(eigsh(lin, k=k, which="LA", tol=t, v0=v0)[0])[::-1]

    runs = {
        "eigsh (ARPACK)": solve(arpack),
        "thick_restart_lanczos_eigh": solve(
            lambda op: thick_restart_lanczos_eigh(
                op.torch_matvec, d, k, tol=tol, v0=torch.from_numpy(v0)
            )[0]
        ),
    }
    for b in blocks:
        runs[f"block_lanczos_eigh b={b}"] = solve(
            lambda op, b=b: block_lanczos_eigh(
                op.torch_matmat, d, k, block_size=b, num_iter=d, tol=tol, seed=0
            )[0]
        )
    runs["lanczos_eigh (60, no test)"] = solve(
        lambda op: lanczos_eigh(op.torch_matvec, d, k, seed=0)[0]
    )
    best, results = rounds(runs, args.repeats)
    reference = solve(lambda op: arpack(op, 1e-12))()[0]
    dense = dense_top(net, lik, x, k) if small else None
    cache = GGNOperator(net, lik, x).cached_bytes / 2**20
    print(f"\n{label}; GGNOperator holds {cache:.1f} MiB of saved tensors")
    print("table 1: the same GGNOperator product for every solver")
    print(
        f"{'method':<30}{'time s':>8}{'products':>9}{'in op s':>9}{'other s':>9}"
        f"{'vs ARPACK':>11}{'err eigsh1e-12':>16}{'err dense':>11}"
    )
    base = best["eigsh (ARPACK)"][0]
    for key in runs:
        (t, inside), (values, products, _) = best[key], results[key]
        err = np.abs(values - reference).max() / abs(reference[0])
        err_d = (np.abs(values - dense).max() / abs(dense[0])) if small else float("nan")
        print(
            f"{key:<30}{t:>8.3f}{products:>9d}{inside:>9.3f}{t - inside:>9.3f}"
            f"{base / t:>10.2f}x{err:>16.1e}{err_d:>11.1e}"
        )

    count = [0]

    def stateless(v, old=False):
        count[0] += 1
        if old:
            ggn_module._NO_DUAL.add(net)  # the jvp-then-vjp product of 2026-11-23
        try:
            v = torch.from_numpy(np.ascontiguousarray(v).reshape(-1))
            return ggn_vector_product(net, lik, x, v).numpy()
        finally:
            ggn_module._NO_DUAL.discard(net)

    def counted(fn):
        def run():
            count[0] = 0
            values = fn()
            return np.asarray(values), count[0], 0.0

        return run

    matvec = GGNOperator.matvec

    def counting_matvec(self, v):
        count[0] += 1
        return matvec(self, v)

    def library():
        GGNOperator.matvec = counting_matvec
        try:
            return subspaces.ggn_eigen(net, lik, x, k, tol=tol).eigenvalues.numpy()
        finally:
            GGNOperator.matvec = matvec

    def eigsh_on(old):
        lin = LinearOperator((d, d), matvec=lambda v: stateless(v, old), dtype=np.float64)
        return np.sort(eigsh(lin, k=k, which="LA", tol=tol, v0=v0)[0])[::-1]

    runs = {
        "eigsh on ggn_vector_product": counted(lambda: eigsh_on(False)),
        "eigsh on old jvp+vjp product": counted(lambda: eigsh_on(True)),
        "ggn_eigen(tol) end to end": counted(library),
    }
    best, results = rounds(runs, args.repeats)
    print("table 2: the library as called (eigsh on the stateless product)")
    print(
        f"{'method':<30}{'time s':>8}{'products':>9}{'vs eigsh on ggn_vector_product':>32}"
        f"{'err eigsh1e-12':>16}"
    )
    base = best["eigsh on ggn_vector_product"][0]
    for key in runs:
        t, (values, products, _) = best[key][0], results[key]
        err = np.abs(values - reference).max() / abs(reference[0])
        print(f"{key:<30}{t:>8.3f}{products:>9d}{base / t:>31.2f}x{err:>16.1e}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("-k", type=int, default=20)
    p.add_argument("--blocks", default="2,4,10", help="block sizes to try, comma-separated")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    k, tol = args.k, args.tol
    print(f"# load average at start: {os.getloadavg()[0]:.2f}")
    print(
        f"Top-{k} GGN eigenpairs, float64, tol = {tol:g}, 1 torch thread, best of "
        f"{args.repeats} interleaved rounds"
    )
    for name in ("diabetes", "digits"):
        compare(name, args)
    print(f"\n# load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
