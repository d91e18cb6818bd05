"""Posterior-predictive cost: `FlatNet` with `vmap` over S weight draws vs a Python loop.

The baseline is what users write without this library: for each draw, copy the weights into
the module (`vector_to_parameters`) and call it. Both run in this process on the same draws;
the table prints wall time per draw and the speed-up. Also checks both agree numerically.

    python benchmarks/vectorised_predictions.py [--draws 300] [--points 1000]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from pyro_subspace import subspaces
from pyro_subspace.flat import FlatNet, eval_mode


def toy_net(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, width),
        nn.ReLU(),
        nn.Linear(width, 50),
        nn.ReLU(),
        nn.Linear(50, 50),
        nn.ReLU(),
        nn.Linear(50, 1),
    )


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(width: int, draws: int, points: int) -> tuple[int, float, float, float]:
    """Seconds for ``draws`` predictions by a Python loop and by `FlatNet` + vmap, and their gap."""
    net = toy_net(width).eval()
    sub = subspaces.random(net, 10, seed=0)
    t = 0.1 * torch.randn(draws, 10)
    x = torch.randn(points, 2)
    flat = FlatNet(net)
    original = flat.vector()

    def loop() -> torch.Tensor:
        outs = []
        with torch.no_grad():
            for w in sub.weights(t):
                nn.utils.vector_to_parameters(w, net.parameters())
                outs.append(net(x))
        nn.utils.vector_to_parameters(original, net.parameters())
        return torch.stack(outs)

    def vectorised() -> torch.Tensor:
        with torch.no_grad(), eval_mode(net):
            return flat(sub.weights(t), x)

    diff = (loop() - vectorised()).abs().max().item()
    return flat.num_weights, best_of(loop), best_of(vectorised), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--points", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"{'width':>6}{'D':>9}{'K':>4}{'loop ms/draw':>14}{'vmap ms/draw':>14}"
        f"{'speed-up':>10}{'max |diff|':>12}"
    )
    for width in (50, 200, 800):
        d, t_loop, t_vmap, diff = measure(width, args.draws, args.points)
        print(
            f"{width:>6}{d:>9}{10:>4}{1e3 * t_loop / args.draws:>14.3f}"
            f"{1e3 * t_vmap / args.draws:>14.3f}{t_loop / t_vmap:>10.2f}{diff:>12.2e}"
        )


if __name__ == "__main__":
    main()
