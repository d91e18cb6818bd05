"""Posterior-predictive cost: `FlatNet` over S weight draws, vmap vs loop, vs the plain way.

The baseline is what users write without this library: for each draw, copy the weights into
the module (`vector_to_parameters`) and call it. `FlatNet` evaluates the same draws
functionally, batched with `torch.func.vmap` or one call per draw; all run in this process on
the same draws. The table prints milliseconds per draw, the ratio to the baseline and the
largest difference between the outputs. It is what `FlatNet(batch_strategy="auto")` is based on.

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


def measure(width: int, draws: int, points: int) -> tuple[int, float, float, float, float]:
    """Seconds for ``draws`` predictions: module loop, FlatNet vmap, FlatNet loop; max gap."""
    net = toy_net(width).eval()
    sub = subspaces.random(net, 10, seed=0)
    t = 0.1 * torch.randn(draws, 10)
    x = torch.randn(points, 2)
    flat = FlatNet(net, batch_strategy="vmap")
    flat_loop = FlatNet(net, batch_strategy="loop")
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

    def functional_loop() -> torch.Tensor:
        with torch.no_grad(), eval_mode(net):
            return flat_loop(sub.weights(t), x)

    ref = loop()
    diff = max((ref - f()).abs().max().item() for f in (vectorised, functional_loop))
    return flat.num_weights, best_of(loop), best_of(vectorised), best_of(functional_loop), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=300)
    parser.add_argument("--points", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"device cpu, {torch.get_num_threads()} threads, {args.draws} draws, {args.points} points"
    )
    print(
        f"{'width':>6}{'D':>8}{'module loop':>13}{'vmap':>8}{'ratio':>7}{'fn loop':>9}"
        f"{'ratio':>7}{'max |diff|':>12}   (ms per draw; ratio = baseline / ours)"
    )
    for width in (50, 200, 800):
        d, t_base, t_vmap, t_fn, diff = measure(width, args.draws, args.points)
        ms = [1e3 * v / args.draws for v in (t_base, t_vmap, t_fn)]
        print(
            f"{width:>6}{d:>8}{ms[0]:>13.3f}{ms[1]:>8.3f}{t_base / t_vmap:>7.2f}{ms[2]:>9.3f}"
            f"{t_base / t_fn:>7.2f}{diff:>12.2e}"
        )


if __name__ == "__main__":
    main()
