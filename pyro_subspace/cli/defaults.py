"""Defaults chosen per data set, and the warnings a user needs about an over-fitted result.

``--epochs auto`` (the regression commands' default): the synthetic problems (``toy``,
``in_between``) keep the papers' 2000 full-batch Adam epochs; real data (``diabetes``, a CSV)
get the number of epochs that minimises the NLL of a held-out 20% validation split of the
training set (early stopping; the noise scale is learned alongside, as in the final fit). On
diabetes 2000 epochs without a stopping rule over-fit badly (test NLL ~30 with a learned
``σ`` of 0.13 and 95% coverage ~0.3).

``fit --recipe auto`` (the default) is ``authors`` on ``toy`` and ``library`` elsewhere:

- ``authors``: the settings of the authors' code for the toy regression figure of Subspace
  Inference (Izmailov et al., 2019, Fig. 1 and 10; ``experiments/synthetic_regression`` of
  wjmaddox/drbayes): one SGD run from the initialisation, learning rate 1e-2, momentum 0.95,
  minibatches of 50, no weight decay, on the squared error (a Gaussian loss with ``σ = 1``),
  3000 epochs, the last 1000 at the same rate collected once per epoch with the last 10
  deviations kept; in a PCA subspace the prior std of ``t`` is 5 and the temperature 1.5
  (other subspaces keep the library's inference settings); with ESS 1000 draws and no
  warm-up (other samplers keep theirs: NUTS needs its warm-up to adapt). The paper
  text gives none of these numbers (only "an SWA solution" and ``T = N/K`` as a heuristic).
  On ``toy`` the network reads ``(x/2, (x/2)²)`` as in their notebook (`AUTHORS_TOY_INPUT_SCALE`;
  the text says ``(x, x²)``): with the unscaled ``x² <= 52`` the first SGD steps at 1e-2 can
  kill every ReLU of a narrower network (``--hidden 20``: loss 1033 after one epoch, then
  constant).
- ``library``: a MAP by full-batch Adam (``--lr 1e-3``, weight decay 1e-4, ``σ`` learned
  alongside), then SWA by SGD at ``--swa-lr 3e-4`` with momentum 0.9 over 200 epochs keeping the
  last 20 deviations; ``T = N/K``, prior std 1, 300 draws after 200 warm-up steps.

Every option given on the command line wins over its recipe's value.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from .. import datasets, likelihoods, rng
from ..minibatch import foreach_option

SYNTHETIC = ("toy", "in_between")
RECIPES = ("auto", "authors", "library")
#: ``--recipe authors``: training (every subspace) and sampling settings, by option name
AUTHORS = {
    "optimizer": "sgd",
    "lr": 1e-2,
    "momentum": 0.95,
    "batch_size": 50,
    "weight_decay": 0.0,
    "train_sigma": 1.0,
    "epochs": 2000,
    "swa_epochs": 1000,
    "swa_lr": 1e-2,
    "swa_batch_size": 50,
    "max_snapshots": 10,
}
#: ``--recipe authors`` with ``--inference ess``: their draws (from ``t = 0``, none discarded)
AUTHORS_ESS = {"samples": 1000, "warmup": 0}
#: ``--recipe authors`` on toy: the network's inputs are ``(x/s, (x/s)²)`` with ``s = 2``
AUTHORS_TOY_INPUT_SCALE = 0.5
#: ``--recipe authors`` in a PCA subspace: the prior of ``t`` and the likelihood's temperature
AUTHORS_PCA = {"prior_scale": 5.0, "temperature": 1.5}
MAX_EPOCHS = 2000
#: a MAP whose test NLL exceeds its training NLL by more than this (nats per point) is flagged
NLL_GAP = 1.0
#: a 95% interval whose test coverage is further than this from 0.95 is flagged
COVERAGE_SLACK = 0.1


def resolve_recipe(args: argparse.Namespace, given: set[str]) -> None:
    """Resolve ``args.recipe`` (``auto``: ``authors`` on toy, else ``library``) and write the
    ``authors`` recipe's values into the options not in ``given`` (the module docstring)."""
    if args.recipe == "auto":
        args.recipe = "authors" if args.dataset == "toy" else "library"
    if args.recipe != "authors":
        return
    values = dict(AUTHORS, **(AUTHORS_PCA if args.subspace == "pca" else {}))
    values.update(AUTHORS_ESS if args.inference == "ess" else {})
    for name, value in values.items():
        if "--" + name.replace("_", "-") not in given:
            setattr(args, name, value)


def authors_inputs(args: argparse.Namespace, data: datasets.Dataset) -> datasets.Dataset:
    """``data`` as the ``authors`` recipe feeds it: on toy the features ``(x, x²)`` become
    ``(x s, (x s)²)`` with ``s = AUTHORS_TOY_INPUT_SCALE`` (inputs, test inputs and the plotting
    grid; the targets and ``grid_x`` unchanged); any other recipe or data set as it is."""
    if args.recipe != "authors" or data.name != "toy":
        return data
    s = AUTHORS_TOY_INPUT_SCALE
    scale = torch.tensor([s, s * s], dtype=data.x_train.dtype)
    names = ("x_train", "x_test", "grid")
    return dataclasses.replace(data, **{n: getattr(data, n) * scale for n in names})


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
    groups = [
        {"params": list(net.parameters()), "weight_decay": weight_decay},
        {"params": [p for p in lik.parameters() if p.requires_grad], "weight_decay": 0.0},
    ]
    # the multi-tensor kernels: on CPU the default kernels' numbers bit for bit, as in fit_map
    optimizer = torch.optim.Adam(groups, lr=lr, **foreach_option(groups))
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
