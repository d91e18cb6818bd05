"""Selected-weight Jacobians of ResNet-18 (CIFAR stem): the output-gradient × input fast path
against the generic path (`jacobians._generic_index_blocks`: vmap of jacrev through every
touched parameter tensor, then indexed).

`jacobians.index_jacobian_blocks` on `subnetwork_resnet18.resnet18()` in eval mode, float32
(running statistics set by one train-mode forward), ``K = 42,438`` selected weights (the
Subnetwork Inference paper's size) drawn either uniformly over all 11.2M weights or biased
toward the last stages (60% from stage 4 and the head, 25% from stage 3, 15% anywhere), on
CIFAR-shaped random images: seconds per image of each path, the largest difference relative
to the largest entry, and each path's block sizes. Also the fast path with each branch of the
convolutions' cost rule forced (`jacobians.MATMUL_RATIO` 0: the pairs' products; 1e9: the
channel × column matmul).

    python benchmarks/subnetwork_jacobians.py                    # 16 images, both paths
    python benchmarks/subnetwork_jacobians.py --generic-images 4 # fewer for the slow path
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from subnetwork_resnet18 import resnet18  # noqa: E402

import pyro_subspace.curvature.jacobians as jacobians  # noqa: E402
from pyro_subspace.flat import FlatNet  # noqa: E402


def selection(flat: FlatNet, k: int, biased: bool, gen: torch.Generator) -> torch.Tensor:
    d = flat.num_weights
    if not biased:
        return torch.randperm(d, generator=gen)[:k].sort().values
    starts = torch.tensor([0, *flat.numels]).cumsum(0)
    # nn.Sequential: 0-2 stem, 3-4 stage 1, 5-6 stage 2, 7-8 stage 3, 9-10 stage 4, 13 head
    stage = lambda *heads: torch.cat([  # noqa: E731
        torch.arange(starts[t], starts[t + 1])
        for t, name in enumerate(flat.names) if name.split(".")[0] in heads
    ])  # fmt: skip
    picks = []
    for pool, share in ((stage("9", "10", "13"), 0.60), (stage("7", "8"), 0.25)):
        picks.append(pool[torch.randperm(pool.numel(), generator=gen)[: int(share * k)]])
    chosen = torch.zeros(d, dtype=torch.bool)
    chosen[torch.cat(picks)] = True
    others = (~chosen).nonzero().squeeze(1)
    rest = others[torch.randperm(others.numel(), generator=gen)[: k - int(chosen.sum())]]
    return torch.cat([*picks, rest]).sort().values


def timed(blocks) -> tuple[float, torch.Tensor, int]:
    t = time.perf_counter()
    parts = [j.contiguous() for _, j in blocks]
    return time.perf_counter() - t, torch.cat(parts), len(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--generic-images", type=int, default=None, help="default: --images")
    parser.add_argument("--k", type=int, default=42438)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-rule-branches", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    net = resnet18()
    with torch.no_grad():  # non-trivial running statistics
        net.train()
        net(torch.randn(64, 3, 32, 32, generator=gen))
    net.eval()
    flat = FlatNet(net)
    w = flat.vector()
    x = torch.randn(args.images, 3, 32, 32, generator=gen)
    n_gen = args.generic_images or args.images
    print(f"ResNet-18 D = {flat.num_weights:,}, K = {args.k:,}, float32, {args.threads} thread(s), "
          f"{args.images} images (generic: {n_gen}); load {os.getloadavg()}")  # fmt: skip
    for biased in (False, True):
        idx = selection(flat, args.k, biased, gen)
        plan, rest = jacobians.linear_plan(flat, idx)
        name = "biased to the last stages" if biased else "uniform"
        print(f"\n{name}: {len(plan)} planned layers, {rest.numel()} generic columns")
        list(jacobians.index_jacobian_blocks(flat, x[:2], idx, None, w))  # warm-up
        t_fast, fast, nb = timed(jacobians.index_jacobian_blocks(flat, x, idx, None, w))
        print(f"  fast    {t_fast / args.images:8.3f} s/image  ({nb} blocks)")
        if not args.no_rule_branches:
            for ratio in (0, 10**9):
                old, jacobians.MATMUL_RATIO = jacobians.MATMUL_RATIO, ratio
                try:
                    t, other, _ = timed(jacobians.index_jacobian_blocks(flat, x, idx, None, w))
                finally:
                    jacobians.MATMUL_RATIO = old
                diff = ((other - fast).abs().max() / fast.abs().max()).item()
                label = "products" if ratio == 0 else "matmul"
                print(f"  {label:8s}{t / args.images:8.3f} s/image  (max rel. diff {diff:.1e})")
        t_gen, gen_jac, nb = timed(jacobians._generic_index_blocks(flat, x[:n_gen], idx, None, w))
        diff = ((gen_jac - fast[:n_gen]).abs().max() / gen_jac.abs().max()).item()
        speed_up = t_gen / n_gen / (t_fast / args.images)
        print(f"  generic {t_gen / n_gen:8.3f} s/image  ({nb} blocks); "
              f"speed-up {speed_up:.1f}x; max rel. diff {diff:.1e}")  # fmt: skip
    print(f"\nload {os.getloadavg()}")


if __name__ == "__main__":
    main()
