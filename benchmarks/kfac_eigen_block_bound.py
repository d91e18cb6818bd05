"""The ceiling of any within-layer curvature subspace on `benchmarks/kfac_eigen.py`'s CNN.

`subspaces.kfac_eigen` picks directions that each lie inside one layer's block (a module's
weight and bias). For orthonormal directions supported on single blocks, ``tr(QᵀGQ)`` is a sum
of Rayleigh quotients of the exact GGN's diagonal blocks ``G_ll``, so no such subspace of ``K``
columns captures more than the sum of the ``K`` largest eigenvalues of all the blocks together
(the union of their spectra). This script computes that ceiling, each block's top eigenvalue
(to compare with K-FAC's, which ``kfac_eigen.py`` prints) and the GGN's own top-``K`` sum.

The GGN ``G = BᵀB`` with ``B`` the rows ``H_n^{1/2} J_n`` (``(N·C, D)``, float32: 3.2 GB for the
width-8 network at N = 1024; torch.func ``vmap(jacrev)`` in eval mode, the softmax Hessian's
square root per point in float64); top eigenvalues by ARPACK (``eigsh``, tol 1e-4) on
``v ↦ B_lᵀ(B_l v)``, or dense ``eigvalsh`` for blocks of at most 600 weights. The same seeded
network and data as ``kfac_eigen.py`` (resnet4 width 8, 10 SGD epochs, seed 0).

    python benchmarks/kfac_eigen_block_bound.py          # about 2 minutes, 4 GB; width 8 only
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import resnet4, synthetic  # noqa: E402


def ggn_rows(net: torch.nn.Module, x: torch.Tensor, classes: int = 10, chunk: int = 16) -> torch.Tensor:
    """``B`` ``(N·C, D)`` float32 with ``BᵀB`` the GGN of the categorical likelihood."""
    from torch.func import functional_call, jacrev, vmap

    names = [n for n, _ in net.named_parameters()]
    params = {n: p.detach() for n, p in net.named_parameters()}
    d = sum(p.numel() for p in params.values())

    def f(p, xi):
        return functional_call(net, p, (xi[None],))[0]

    rows = torch.empty(x.shape[0] * classes, d)
    for s in range(0, x.shape[0], chunk):
        xb = x[s : s + chunk]
        jac = vmap(jacrev(f), in_dims=(None, 0))(params, xb)
        j = torch.cat([jac[n].reshape(len(xb), classes, -1) for n in names], -1).double()
        with torch.no_grad():
            prob = torch.softmax(functional_call(net, params, (xb,)), -1).double()
        e, u = torch.linalg.eigh(torch.diag_embed(prob) - prob[:, :, None] * prob[:, None, :])
        root = u @ torch.diag_embed(e.clamp_min(0).sqrt()) @ u.mT
        rows[s * classes : (s + len(xb)) * classes] = (root @ j).reshape(-1, d).float()
    return rows


def top_eigenvalues(b: torch.Tensor, k: int) -> np.ndarray:
    """The ``k`` largest eigenvalues of ``bᵀb`` (descending)."""
    from scipy.sparse.linalg import LinearOperator, eigsh

    d = b.shape[1]
    if d <= 600:
        return torch.linalg.eigvalsh(b.double().T @ b.double()).flip(0)[:k].numpy()

    def matvec(v):
        v = torch.from_numpy(np.asarray(v, dtype=np.float32).ravel())
        return (b.T @ (b @ v)).double().numpy()

    op = LinearOperator((d, d), matvec=matvec, dtype=np.float64)
    return np.sort(eigsh(op, k=min(k, d - 1), which="LA", tol=1e-4)[0])[::-1]


def main() -> None:
    from pyro_subspace import fit_map, likelihoods

    torch.set_num_threads(1)
    load = os.getloadavg()
    print(f"# benchmarks/kfac_eigen_block_bound.py  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch "
          f"threads 1, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)  # fmt: skip
    k = 20
    torch.manual_seed(0)
    net = resnet4(8)
    x, y = synthetic(1024, seed=0)
    fit_map(net, likelihoods.Categorical(), x, y, epochs=10, batch_size=64, lr=0.05,
            optimizer="sgd", seed=0, progress=False)  # fmt: skip
    net.eval()
    b = ggn_rows(net, x)
    full = top_eigenvalues(b, k)
    print(f"GGN top-{k}: {full[0]:.1f} ... {full[-1]:.1f}, sum {full.sum():.1f}")
    blocks: dict[str, list[int]] = {}
    start = 0
    for name, p in net.named_parameters():
        blocks.setdefault(name.rsplit(".", 1)[0], []).extend(range(start, start + p.numel()))
        start += p.numel()
    print(f"\n| block | weights | top eigenvalue | sum of its top {k} |\n|---|---|---|---|")
    union = []
    for name, index in blocks.items():
        ev = top_eigenvalues(b[:, index].contiguous(), k)
        union.extend(ev)
        print(f"| {name} | {len(index):,} | {ev[0]:.1f} | {ev[:k].sum():.1f} |", flush=True)
    bound = float(np.sort(np.array(union))[::-1][:k].sum())
    print(f"\nwithin-layer ceiling: the top {k} of the blocks' spectra sum to {bound:.1f}, "
          f"{100 * bound / full.sum():.1f}% of the GGN's top-{k} sum")


if __name__ == "__main__":
    main()
