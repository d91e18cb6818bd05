"""Top-20 GGN eigenpairs: our block Lanczos vs ARPACK (``scipy.sparse.linalg.eigsh``).

Both run on the SAME GGN operator of a network at its MAP (float64): a
``scipy.sparse.linalg.LinearOperator`` whose ``matvec`` is `ggn_vector_product` and whose
``matmat`` is `ggn_matrix_product` (one batched ``jvp``/``vjp`` pass for a block of vectors).
``eigsh(op, k=20, which="LA", tol=TOL, v0=fixed)`` (implicitly restarted Lanczos; ARPACK asks
for one vector at a time) against `block_lanczos_eigh(matmat, k=20, block_size=b, tol=TOL)`
(the same stopping test: every Ritz residual ``‖G y − θ y‖ <= TOL · |θ|``). Reported: wall
time (best of ``--repeats``, interleaved A B A B, one thread), the number of GGN-vector
products (a block of ``b`` counts ``b``), and the largest relative difference of the top-20
eigenvalues to ``eigsh`` at ``tol = 1e-12`` and, where the GGN fits in memory, to dense
``torch.linalg.eigvalsh``. Our single-vector `lanczos_eigh` (fixed ``3k`` products) is a third
row.

Problems: diabetes, MLP 10-50-50-1 (Tanh, Gaussian, D = 3151, N = 397) and digits, MLP
64-100-30-10 (Tanh, Categorical, D = 9930, N = 1437), each trained by `fit_map`.

    python benchmarks/lanczos_vs_arpack.py [--quick] [--repeats 3] [--tol 1e-6]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator, eigsh
from torch import nn

from pyro_subspace import datasets, fit_map, likelihoods
from pyro_subspace.curvature import (
    block_lanczos_eigh,
    full_jacobians,
    ggn_matrix_product,
    ggn_vector_product,
    lanczos_eigh,
)
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
    fit_map(net, lik, x, y, epochs=50 if quick else 300, lr=1e-2,
            weight_decay=1.0 / x.shape[0], seed=0, progress=False)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tol", type=float, default=1e-6)
    p.add_argument("-k", type=int, default=20)
    p.add_argument("--blocks", default="10,20", help="block sizes to try, comma-separated")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    k, tol = args.k, args.tol
    blocks = [int(b) for b in args.blocks.split(",")]
    print(f"Top-{k} GGN eigenpairs, float64, tol = {tol:g}, 1 torch thread, best of "
          f"{args.repeats} interleaved rounds")
    for name in ("diabetes", "digits"):
        label, net, lik, x, small = problem(name, args.quick)
        d = sum(p.numel() for p in net.parameters())
        count = [0]

        def mv(v):
            count[0] += 1
            out = ggn_vector_product(net, lik, x, torch.from_numpy(np.ascontiguousarray(v)))
            return out.numpy()

        def mm(v):
            v = np.ascontiguousarray(v)
            count[0] += v.shape[1]
            return ggn_matrix_product(net, lik, x, torch.from_numpy(v)).numpy()

        op = LinearOperator((d, d), matvec=mv, matmat=mm, dtype=np.float64)
        v0 = np.random.default_rng(0).standard_normal(d)

        def run_eigsh(t=tol):
            vals = eigsh(op, k=k, which="LA", tol=t, v0=v0, return_eigenvectors=True)[0]
            return np.sort(vals)[::-1]

        def run_block(b):
            def matmat(v: torch.Tensor) -> torch.Tensor:  # the operator's matmat, in torch
                return torch.from_numpy(op.matmat(v.numpy()))

            return block_lanczos_eigh(matmat, d, k, block_size=b, num_iter=d, tol=tol,
                                      seed=0)[0].numpy()

        def run_single():
            return lanczos_eigh(lambda v: torch.from_numpy(op.matvec(v.numpy())), d, k,
                                seed=0)[0].numpy()

        runs = {"eigsh (ARPACK)": run_eigsh, "lanczos_eigh (1 vector)": run_single}
        runs.update({f"block_lanczos_eigh b={b}": (lambda b=b: run_block(b)) for b in blocks})
        best, products, values = {}, {}, {}
        for r in range(args.repeats + 1):  # round 0: warm-up, not timed
            for key, run in runs.items():
                count[0] = 0
                t0 = time.perf_counter()
                values[key] = run()
                dt = time.perf_counter() - t0
                products[key] = count[0]
                if r > 0:
                    best[key] = min(best.get(key, float("inf")), dt)
        reference = run_eigsh(1e-12)
        dense = dense_top(net, lik, x, k) if small else None
        print(f"\n{label}")
        print(f"{'method':<28}{'time s':>9}{'products':>10}{'vs ARPACK':>11}"
              f"{'rel.err eigsh1e-12':>20}{'rel.err dense':>15}")
        base = best["eigsh (ARPACK)"]
        for key in runs:
            err = np.abs(values[key] - reference).max() / abs(reference[0])
            err_d = (np.abs(values[key] - dense).max() / abs(dense[0])) if small else float("nan")
            print(f"{key:<28}{best[key]:>9.3f}{products[key]:>10d}{base / best[key]:>10.2f}x"
                  f"{err:>20.1e}{err_d:>15.1e}")


if __name__ == "__main__":
    main()
