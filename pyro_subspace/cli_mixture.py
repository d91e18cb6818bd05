"""``pyro-subspace --inference mola|deep_ensemble|swag``: mixture predictives on regression data.

- ``deep_ensemble``: ``--members`` networks from different seeds (MoLA eq. 3), each with its own
  learned noise scale; the predictive is the equal mixture of their Gaussians.
- ``mola``: the same ensemble with a last-layer Laplace approximation around each member
  (`MixtureOfLaplace`, eqs. 7–8), prior precision ``N·wd`` (the weight decay the networks were
  trained with) or, with ``--laplace-prior marglik``, each member's Laplace evidence.
- ``swag``: one network, then ``--swa-epochs`` of constant-rate SGD collecting SWAG statistics;
  ``--samples`` draws (Maddox et al., 2019).

The table compares the first member's MAP with the method (test NLL of the mixture and of its
moment match, RMSE, 95% coverage); ``out/`` gets ``results.json`` and a PNG of the predictive.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyro
import torch

from . import cli, likelihoods, metrics
from .infer import SWAG, DeepEnsemble, MixtureOfLaplace, MixturePredictor, train_ensemble

MIXTURE_INFERENCE = ("mola", "deep_ensemble", "swag")
WEIGHT_DECAY = 1e-4


def _scores(predictor: MixturePredictor, x: torch.Tensor, y: torch.Tensor) -> dict:
    weights, (means, variances) = predictor.components(x)
    if not torch.allclose(weights, weights.mean().expand_as(weights)):
        raise ValueError("predictor: the CLI table expects equal mixture weights")
    return metrics.regression_scores(means[..., 0], variances[..., 0], y.double())


def run_mixture(args: argparse.Namespace) -> dict:
    """Train, fit and score one mixture method; returns the results dict (also written)."""
    if args.inference not in MIXTURE_INFERENCE:
        raise ValueError(f"args.inference: expected one of {MIXTURE_INFERENCE}")
    if args.members < 1:
        raise SystemExit(f"--members: expected a positive int, got {args.members}")
    if args.inference == "swag" and args.swa_epochs < 2:
        raise SystemExit("--inference swag needs --swa-epochs >= 2")
    torch.manual_seed(args.seed)
    pyro.set_rng_seed(args.seed)
    pyro.clear_param_store()
    data = cli._load(args)
    if data.task != "regression":
        raise SystemExit(f"--dataset {args.dataset}: the default run is for regression data")
    x, y = data.x_train, data.y_train
    swag = args.inference == "swag"
    t0 = time.perf_counter()
    ens = train_ensemble(
        lambda: cli._network(data, heteroscedastic=False),
        likelihoods.Gaussian(),  # noise scale learned per member (type-II ML), then fixed
        x,
        y,
        seeds=[1000 * args.seed + k for k in range(1 if swag else args.members)],
        progress=not args.no_progress,
        collector=swag,
        swa_epochs=max(args.swa_epochs, 2),
        swa_lr=args.swa_lr,
        epochs=args.epochs,
        lr=1e-3,
        weight_decay=WEIGHT_DECAY,
    )
    t_train = time.perf_counter() - t0
    t1 = time.perf_counter()
    if swag:
        predictor: MixturePredictor = SWAG(
            ens.collectors[0], ens.likelihoods[0], num_samples=args.samples, seed=args.seed
        )
        name = "SWAG"
    elif args.inference == "deep_ensemble":
        predictor, name = DeepEnsemble(ens.nets, ens.likelihoods), f"DE ({len(ens.nets)} nets)"
    else:
        predictor = MixtureOfLaplace(
            ens.nets, ens.likelihoods, prior_precision=data.n_train * WEIGHT_DECAY
        ).fit(x, y)
        if args.laplace_prior == "marglik":
            predictor.optimize_prior_precision("marglik")
        name = f"MoLA ({len(ens.nets)} nets)"
    t_infer = time.perf_counter() - t1
    rank = sum(p.numel() for p in ens.nets[0].parameters())
    if isinstance(predictor, MixtureOfLaplace):
        rank = predictor.members[0][0].rank
    rows = {
        "MAP": _scores(DeepEnsemble(ens.nets[:1], ens.likelihoods[0]), data.x_test, data.y_test),
        name: _scores(predictor, data.x_test, data.y_test),
    }
    results = {
        "dataset": data.name,
        "subspace": "last_layer" if args.inference == "mola" else "all weights",
        "rank": rank,
        "inference": args.inference,
        "temperature": 1.0,
        "sigma": float(ens.likelihoods[0].sigma.detach()),
        "train_seconds": t_train,
        "inference_seconds": t_infer,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    results["plot"] = str(_plot(args, data, predictor, name))
    print(cli._table(results))
    return results


def _plot(args: argparse.Namespace, data, predictor: MixturePredictor, name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    x_plot = data.grid if data.grid is not None else data.x_test
    mean, var = predictor.predict(x_plot)  # the moment-matched mixture, (N, 1) each
    mean, sd = mean[:, 0].float(), var[:, 0].sqrt().float()
    lo, hi = metrics.gaussian_interval(mean, sd, 0.95)
    if data.grid is not None:
        ax.fill_between(data.grid_x, lo, hi, alpha=0.3, label="95% predictive band")
        ax.plot(data.grid_x, mean, label="predictive mean")
        ax.scatter(data.x_train_raw, data.y_train, s=6, color="C3", label="training data")
        ax.set_xlabel("x")
    else:
        ax.errorbar(data.y_test, mean, yerr=1.96 * sd, fmt="o", ms=3, alpha=0.6, label="95% band")
        lim = [float(data.y_test.min()), float(data.y_test.max())]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set_xlabel("true y (standardised)")
    ax.set_ylabel("y")
    ax.set_title(f"{name} on {data.name}")
    ax.legend(loc="best", fontsize=8)
    path = args.out / f"{data.name}_{args.inference}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
