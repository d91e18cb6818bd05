"""The cost of K-FAC Laplace against training, on the ResNet-style BatchNorm CNN of `scale.py`.

Issue 22's cost targets, measured on `scale.resnet4` (four stages, BatchNorm, in-place ReLU;
width 16: 308,826 weights) with synthetic 3×32×32 inputs (`scale.synthetic`), one thread:

1. All-layer K-FAC fit (`Laplace(net, Categorical(), "all", "kron").fit`: one pass of
   `curvature.kfac` plus the per-block eigendecompositions) in units of one training epoch (a
   plain PyTorch loop: per minibatch of 128 a forward, cross-entropy, backward and SGD step),
   with the exact type-2 Fisher (``C`` = 10 backward passes per chunk) and the one-sample Monte
   Carlo Fisher (``structure_options={"fisher": "mc"}``); then λ by the evidence
   (``"marglik"``, O(D) per step) and the sampling predictive (``pred_type="nn"``).
2. Prediction time on the test set: the last-layer K-FAC probit (features from one forward
   pass) against the MAP forward pass; MoLA (K-FAC members) against the deep ensemble of the
   same networks; SWAG and MultiSWAG beside them (MoLA paper, Table 2).

Timings are the best of ``--rounds`` interleaved rounds (A B A B) in one process; the peak RSS
of the whole run is printed at the end.

    python benchmarks/kfac_cost.py                    # N = 1024, width 16 (the issue's table)
    python benchmarks/kfac_cost.py --quick            # width 8, N = 256: a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import time

import torch
from torch import nn

from benchmarks.scale import resnet4, synthetic
from pyro_subspace import likelihoods
from pyro_subspace.infer import (
    SWAG,
    DeepEnsemble,
    Laplace,
    LastLayerLaplace,
    MixtureOfLaplace,
    MultiSWAG,
)
from pyro_subspace.subspaces import SWACollector


def train_epoch(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 128, seed: int = 0):
    """One epoch of a plain PyTorch loop (SGD, momentum 0.9)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    net.train()
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    for i in range(0, x.shape[0], batch):
        idx = perm[i : i + batch]
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    net.eval()


def best(fns: dict, rounds: int) -> dict:
    """Best wall time of each callable over interleaved rounds."""
    out = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[k] = min(out[k], time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--members", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    width, n = (8, 256) if args.quick else (16, 1024)
    n = args.rows or n
    x, y = synthetic(n)
    xt, _ = synthetic(n, seed=1)
    nets = []
    for s in range(args.members):
        torch.manual_seed(s)
        net = resnet4(width)
        for e in range(2):  # two epochs: trained a little, its BatchNorm statistics set
            train_epoch(net, x, y, seed=e)
        nets.append(net)
    net, lik = nets[0], likelihoods.Categorical()
    d = sum(q.numel() for q in net.parameters())
    load = os.getloadavg()[0]
    print(f"# K-FAC Laplace cost, {datetime.date.today()}, threads 1, load {load:.2f}")
    print(f"resnet4 width {width}: D = {d:,} weights, N = {n}, 10 classes, {args.rounds} rounds\n")

    exact = lambda: Laplace(net, lik, "all", "kron", 1.0).fit(x, y)  # noqa: E731
    mc = lambda: Laplace(net, lik, "all", "kron", 1.0, structure_options={"fisher": "mc"}).fit(x, y)  # noqa: E731
    times = best({"epoch": lambda: train_epoch(resnet4(width), x, y), "exact": exact, "mc": mc}, args.rounds)
    la = exact()
    t = time.perf_counter()
    la.optimize_prior_precision(method="marglik")
    t_tune = time.perf_counter() - t
    t = time.perf_counter()
    la(xt[:256], pred_type="nn", n_samples=10, generator=torch.Generator().manual_seed(0))
    t_nn = time.perf_counter() - t
    print("## All-layer K-FAC fit against one training epoch (SGD, batch 128)")
    print(f"{'step':44s} {'seconds':>8s} {'epochs':>7s}")
    print(f"{'one training epoch':44s} {times['epoch']:8.2f} {1:7.2f}")
    print(f"{'K-FAC fit, type-2 Fisher (target <= 5)':44s} {times['exact']:8.2f} {times['exact'] / times['epoch']:7.2f}")
    print(f"{'K-FAC fit, one-sample MC Fisher (target <= 2)':44s} {times['mc']:8.2f} {times['mc'] / times['epoch']:7.2f}")
    print(f"{'lambda by marglik (scalar)':44s} {t_tune:8.2f} {t_tune / times['epoch']:7.2f}")
    print(f"{'sampling predictive, 10 draws, 256 inputs':44s} {t_nn:8.2f} {t_nn / times['epoch']:7.2f}")

    llla = LastLayerLaplace(net, lik, prior_precision=1.0, hessian_structure="kron").fit(x, y)
    mola = MixtureOfLaplace(nets, lik, prior_precision=1.0, hessian_structure="kron").fit(x, y)
    de = DeepEnsemble(nets, lik)
    swags = []
    for s, member in enumerate(nets):
        col = SWACollector(member, max_snapshots=5)
        for e in range(5):
            train_epoch(member, x, y, seed=10 + e)
            col.collect()
        swags.append(col)
    swag = SWAG(swags[0], lik, num_samples=10, seed=0)
    multi = MultiSWAG(swags, lik, num_samples=10, seed=0)

    def forward():
        with torch.no_grad():
            net(xt).softmax(-1)

    pred = best({
        "MAP forward": forward,
        "LLLA K-FAC probit": lambda: llla.predict(xt),
        "DE": lambda: de.predict(xt),
        "MoLA K-FAC probit": lambda: mola.predict(xt),
        "SWAG (10 draws)": lambda: swag.predict(xt),
        "MultiSWAG (10 draws each)": lambda: multi.predict(xt),
    }, args.rounds)  # fmt: skip
    print(f"\n## Prediction on {xt.shape[0]} test inputs ({args.members} members)")
    print(f"{'method':28s} {'seconds':>8s} {'ratio':>22s}")
    ratios = {
        "MAP forward": "",
        "LLLA K-FAC probit": f"{pred['LLLA K-FAC probit'] / pred['MAP forward']:.2f}x MAP (<= 1.1)",
        "DE": "",
        "MoLA K-FAC probit": f"{pred['MoLA K-FAC probit'] / pred['DE']:.2f}x DE (<= 1.1)",
        "SWAG (10 draws)": f"{pred['SWAG (10 draws)'] / pred['MAP forward']:.2f}x MAP",
        "MultiSWAG (10 draws each)": f"{pred['MultiSWAG (10 draws each)'] / pred['DE']:.2f}x DE",
    }
    for k, v in pred.items():
        print(f"{k:28s} {v:8.3f} {ratios[k]:>22s}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the run: {peak:.0f} MiB")


if __name__ == "__main__":
    main()
