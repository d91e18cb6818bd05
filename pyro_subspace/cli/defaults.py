"""Defaults chosen per data set, and the warnings a user needs about an over-fitted result.

``--epochs auto`` (the regression commands' default): the synthetic problems (``toy``,
``in_between``) keep the papers' 2000 full-batch Adam epochs; real data (``diabetes``, a CSV)
get the number of epochs that minimises the NLL of a held-out 20% validation split of the
training set (early stopping; the noise scale is learned alongside, as in the final fit). On
diabetes 2000 epochs without a stopping rule over-fit badly (test NLL ~30 with a learned
``σ`` of 0.13 and 95% coverage ~0.3).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn

from .. import datasets, likelihoods, rng

SYNTHETIC = ("toy", "in_between")
MAX_EPOCHS = 2000
#: a MAP whose test NLL exceeds its training NLL by more than this (nats per point) is flagged
NLL_GAP = 1.0
#: a 95% interval whose test coverage is further than this from 0.95 is flagged
COVERAGE_SLACK = 0.1


def resolve_epochs(
    args: argparse.Namespace, data: datasets.Dataset, make_net: Callable[[], nn.Module]
) -> int:
    """``--epochs`` as an int: the given number, or the ``auto`` rule of this module."""
    if args.epochs != "auto":
        return args.epochs
    if args.dataset in SYNTHETIC:
        return MAX_EPOCHS
    return early_stopping_epochs(
        make_net, data.x_train, data.y_train, lr=args.lr, weight_decay=args.weight_decay,
        seed=args.seed,
    )  # fmt: skip


def early_stopping_epochs(
    make_net: Callable[[], nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    seed: int,
    max_epochs: int = MAX_EPOCHS,
    val_fraction: float = 0.2,
    patience: int = 200,
) -> int:
    """Epochs of full-batch Adam (``fit_map``'s objective: mean Gaussian NLL with a learned
    ``σ`` plus weight decay) that minimise the validation NLL of a random ``val_fraction`` of
    ``(x (N, d), y (N,))``; stops ``patience`` epochs after the best one. Returns ``>= 1``."""
    n = x.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(val_fraction * n)))
    val, fit = perm[:n_val], perm[n_val:]
    with rng.seeded(seed, numpy=False, python=False):
        net = make_net()
    lik = likelihoods.Gaussian()
    optimizer = torch.optim.Adam(
        [
            {"params": list(net.parameters()), "weight_decay": weight_decay},
            {"params": [p for p in lik.parameters() if p.requires_grad], "weight_decay": 0.0},
        ],
        lr=lr,
    )
    best, best_epoch = float("inf"), 1
    for epoch in range(1, max_epochs + 1):
        optimizer.zero_grad()
        loss = -lik.log_prob(net(x[fit]), y[fit]).mean()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            val_nll = float(-lik.log_prob(net(x[val]), y[val]).mean())
        if val_nll < best:
            best, best_epoch = val_nll, epoch
        elif epoch - best_epoch >= patience:
            break
    return best_epoch


def overfit_warnings(train_nll: float, rows: dict[str, dict]) -> list[str]:
    """Messages for a MAP whose test NLL is far above its training NLL, and for any method whose
    95% coverage is far from nominal (``rows``: the table's ``{method: scores}``, MAP first)."""
    out = []
    name, first = next(iter(rows.items()))
    if first["nll"] > train_nll + NLL_GAP:
        out.append(
            f"{name}: test NLL {first['nll']:.2f} is far above the training NLL {train_nll:.2f}: "
            "the network over-fits; try fewer --epochs (or --epochs auto), more --weight-decay"
        )
    for method, r in rows.items():
        if abs(r["coverage95"] - 0.95) > COVERAGE_SLACK:
            out.append(
                f"{method}: 95% interval covers {r['coverage95']:.2f} of the test points "
                "(nominal 0.95): its uncertainty is miscalibrated"
            )
    return out
