"""K-FAC Laplace at scale: a torchvision-shaped ResNet-18 and a 1000-class last layer.

1. All-layer K-FAC on ResNet-18 (the torchvision architecture built here: BasicBlocks 2-2-2-2 at
   64-128-256-512 channels, BatchNorm, a 3×3 stem for 3×32×32 inputs as in CIFAR ResNets, 10
   classes: 11.2M weights), N synthetic images: fit (`curvature.kfac`, one pass, type-2 Fisher),
   λ by the evidence (scalar, O(D) per step), the sampling predictive (``pred_type="nn"``,
   weights drawn from the Kronecker posterior, the network run on each draw). Time and peak RSS.
2. A last layer with C = 1000 classes on P = 2048 synthetic penultimate features (ImageNet
   ResNet-50's head), N = 10 000: K-FAC fit, λ by the evidence, the probit predictive on
   10 000 inputs (the variances only: no N × C × C array), in a fresh process each, peak RSS
   against the 1 GiB target; the full structure is refused at construction (4 K² numbers).

    python benchmarks/kfac_scale.py                 # both, N = 1024 for ResNet-18
    python benchmarks/kfac_scale.py --part head     # only the 1000-class head
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import time

import torch
from torch import nn

from benchmarks.scale import Block


def resnet18(classes: int = 10) -> nn.Module:
    """ResNet-18 (torchvision's layer layout: `scale.Block` is its BasicBlock, two 3×3
    convolutions with BatchNorm and a projection shortcut) with a CIFAR stem for 3×32×32."""
    layers, cin = [], 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
        cin = cout
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes),
    )  # fmt: skip


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resnet_part(n: int, chunk: int) -> None:
    from pyro_subspace import likelihoods
    from pyro_subspace.infer import Laplace

    torch.manual_seed(0)
    net = resnet18().eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    d = sum(p.numel() for p in net.parameters())
    base = peak_mib()
    t = time.perf_counter()
    la = Laplace(net, likelihoods.Categorical(), "all", "kron", 1.0, chunk_size=chunk).fit(x, y)
    t_fit = time.perf_counter() - t
    t = time.perf_counter()
    la.optimize_prior_precision(method="marglik")
    t_tune = time.perf_counter() - t
    t = time.perf_counter()
    probs = la(x[:64], pred_type="nn", n_samples=8, generator=torch.Generator().manual_seed(1))
    t_pred = time.perf_counter() - t
    assert probs.shape == (64, 10) and bool(torch.isfinite(probs).all())
    blocks = len(la.guide.posterior.blocks())
    print(f"ResNet-18 (CIFAR stem): D = {d:,} weights in {blocks} blocks, N = {n}, chunk {chunk}")
    print(f"{'step':52s} {'seconds':>8s}")
    print(f"{'K-FAC fit (type-2 Fisher, one pass + eigendecompositions)':52s} {t_fit:8.1f}")
    print(f"{'lambda by marglik (scalar): ' + format(float(la.prior_precision), '.3g'):52s} {t_tune:8.1f}")
    print(f"{'sampling predictive: 8 weight draws x 64 inputs':52s} {t_pred:8.1f}")
    print(f"peak RSS {peak_mib():.0f} MiB (after building the data and net: {base:.0f} MiB)")


def head_part(n: int) -> None:
    from pyro_subspace import likelihoods
    from pyro_subspace.infer import Laplace

    torch.manual_seed(0)
    c, p = 1000, 2048
    net = nn.Sequential(nn.Linear(p, c)).eval()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, p, generator=gen)
    with torch.no_grad():
        y = (net(x) + torch.randn(n, c, generator=gen)).argmax(-1)
    base = peak_mib()
    try:
        Laplace(net, likelihoods.Categorical(), "last_layer", "full")
        refused = "not refused"
    except ValueError as e:
        refused = str(e).split(";")[0]
    t = time.perf_counter()
    la = Laplace(net, likelihoods.Categorical(), "last_layer", "kron", 1.0).fit(x, y)
    t_fit = time.perf_counter() - t
    t = time.perf_counter()
    la.optimize_prior_precision(method="marglik")
    t_tune = time.perf_counter() - t
    t = time.perf_counter()
    probs = la(x, link_approx="probit")
    t_pred = time.perf_counter() - t
    assert probs.shape == (n, c) and bool(torch.isfinite(probs).all())
    print(f"last layer C = {c}, P = {p} (K = {la.n_params:,}), N = {n}")
    print(f"full structure: {refused}")
    print(f"{'step':52s} {'seconds':>8s}")
    print(f"{'K-FAC fit (G = sum of softmax Hessians, A, eigh)':52s} {t_fit:8.1f}")
    print(f"{'lambda by marglik (scalar): ' + format(float(la.prior_precision), '.3g'):52s} {t_tune:8.1f}")
    print(f"{'probit predictive on ' + str(n) + ' inputs (variances only)':52s} {t_pred:8.1f}")
    print(f"peak RSS {peak_mib():.0f} MiB (target < 1024; data, net and torch: {base:.0f} MiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("both", "resnet", "head"), default="both")
    p.add_argument("--rows", type=int, default=1024, help="ResNet-18's N")
    p.add_argument("--chunk", type=int, default=128, help="ResNet-18's rows per chunk")
    p.add_argument("--head-rows", type=int, default=10_000)
    p.add_argument("--child", choices=("resnet", "head"), help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.child == "resnet":
        return resnet_part(args.rows, args.chunk)
    if args.child == "head":
        return head_part(args.head_rows)
    print(f"# K-FAC at scale, {datetime.date.today()}, threads 1, load {os.getloadavg()[0]:.2f}")
    parts = ("head", "resnet") if args.part == "both" else (args.part,)
    for part in parts:  # each in a fresh process: its own peak RSS
        print()
        cmd = [sys.executable, "-m", "benchmarks.kfac_scale", "--child", part,
               "--rows", str(args.rows), "--chunk", str(args.chunk),
               "--head-rows", str(args.head_rows)]  # fmt: skip
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
