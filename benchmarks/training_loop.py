"""Training loops against a plain PyTorch loop (and SVI against Pyro's own floor).

The plain loop is what a user writes: per epoch one ``randperm``, then per minibatch an index
gather, forward, ``cross_entropy``, ``zero_grad``, ``backward``, ``step``. Both train the
BatchNorm MLP 64-128-128-10 on scikit-learn's digits, batch 64, Adam at 1e-3, for the same
epochs from the same initial weights; CPU seconds (``time.process_time``, one thread),
interleaved A B A B, best of the rounds (and the median over the rounds of each round's own
ratio, which a drift of the machine's speed between rounds moves less). The row "plain loop,
our loss" is the plain loop with ``-Categorical().log_prob(...)`` (the distribution-object loss
`fit_map` used before), which shows where the difference was; "plain loop, fused Adam" the
plain loop with PyTorch's fused Adam kernel, which `PatchedNet.fit` uses on its flat means
(`minibatch.fused_option`), and "plain loop, foreach Adam" with the multi-tensor kernel, which
`fit_map` uses (`minibatch.foreach_option`: the default kernel's numbers bit for bit on CPU),
so that the loops' own overhead can be read apart from the kernels' gain. `PatchedNet.fit` (EMP, ECMP, K = 5; its steps also draw a component; the last row also the weight noise of a positive ``σ``, drawn for all ``D``
weights each step) is timed against the same plain loop, and
``PatchedNet.fit(method="svi")`` against Pyro's floor: ``SVI`` over ``pyro.module(net)`` with the
same likelihood and no latent sites.

Run: ``python benchmarks/training_loop.py [--rounds 5] [--epochs 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import pyro
from pyro.infer import SVI, Trace_ELBO

from pyro_subspace import PatchedNet, fit_map, likelihoods

torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    lik = likelihoods.Categorical()

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
            nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10),
        )  # fmt: skip

    def plain(loss_fn, **adam) -> None:
        net = make()
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, **adam)
        gen = torch.Generator().manual_seed(0)
        net.train()
        for _ in range(args.epochs):
            for idx in torch.randperm(len(x), generator=gen).split(args.batch_size):
                if len(idx) < 2:  # BatchNorm needs two rows (fit_map skips them too)
                    continue
                loss = loss_fn(net(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()

    runs = {
        "plain loop (cross_entropy)": lambda: plain(nn.functional.cross_entropy),
        "plain loop, our loss before": lambda: plain(
            lambda out, t: -torch.distributions.Categorical(logits=out).log_prob(t).mean()
        ),
        "plain loop, fused Adam": lambda: plain(nn.functional.cross_entropy, fused=True),
        "plain loop, foreach Adam": lambda: plain(nn.functional.cross_entropy, foreach=True),
        "fit_map": lambda: fit_map(
            make(), lik, x, y, epochs=args.epochs, lr=1e-3, batch_size=args.batch_size,
            progress=False, seed=0,
        ),  # fmt: skip
    }
    def patched(mode: str, method: str, sigma: float = 0.0) -> None:
        pyro.clear_param_store()
        PatchedNet(make(), lik, mode=mode, n_components=5, sigma=sigma).fit(
            x, y, epochs=args.epochs, lr=1e-3, batch_size=args.batch_size, method=method
        )

    def pyro_floor() -> None:
        pyro.clear_param_store()
        net = make()
        net.train()

        def model(xb: torch.Tensor, yb: torch.Tensor) -> None:
            pyro.module("net", net)
            with pyro.plate("data", len(x), subsample=torch.arange(len(xb))):
                lik.observe(net(xb), yb)

        svi = SVI(model, lambda xb, yb: None, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
        gen = torch.Generator().manual_seed(0)
        with pyro.validation_enabled(False):
            for _ in range(args.epochs):
                for idx in torch.randperm(len(x), generator=gen).split(args.batch_size):
                    if len(idx) >= 2:
                        svi.step(x[idx], y[idx])

    runs["PatchedNet.fit EMP"] = lambda: patched("emp", "torch")
    runs["PatchedNet.fit ECMP"] = lambda: patched("ecmp", "torch")
    runs["PatchedNet.fit EMP, sigma 1e-3"] = lambda: patched("emp", "torch", 1e-3)
    runs["Pyro's floor (SVI, no latents)"] = pyro_floor
    runs["PatchedNet.fit EMP, svi"] = lambda: patched("emp", "svi")
    runs["PatchedNet.fit ECMP, svi"] = lambda: patched("ecmp", "svi")
    best = dict.fromkeys(runs, float("inf"))
    rounds: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t = time.process_time()
            fn()
            rounds.setdefault(name, []).append(time.process_time() - t)
            best[name] = min(best[name], rounds[name][-1])
    base = best["plain loop (cross_entropy)"]
    steps = args.epochs * ((len(x) + args.batch_size - 1) // args.batch_size)
    floor = best["Pyro's floor (SVI, no latents)"]

    def median_ratio(name: str, ref: str) -> float:  # of the rounds' own ratios
        return statistics.median(a / b for a, b in zip(rounds[name], rounds[ref]))

    print(
        f"{'loop':<36}{'CPU s':>8}{'ms/step':>9}{'vs plain':>10}{'median':>8}"
        f"{'vs Pyro floor':>15}{'median':>8}"
    )
    for name, t in best.items():
        vs_floor = ""
        if "svi" in name or "floor" in name:
            ratio = median_ratio(name, "Pyro's floor (SVI, no latents)")
            vs_floor = f"{t / floor:>14.2f}x{ratio:>7.2f}x"
        med = median_ratio(name, "plain loop (cross_entropy)")
        print(f"{name:<36}{t:>8.3f}{1e3 * t / steps:>9.3f}{t / base:>9.2f}x{med:>7.2f}x{vs_floor}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
