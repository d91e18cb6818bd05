"""``pyro-subspace mixture``: mixture predictives over trained networks on regression data.

- ``deep_ensemble``: ``--members`` networks from different seeds (MoLA eq. 3), each with its own
  learned noise scale; the predictive is the equal mixture of their Gaussians.
- ``mola``: the same ensemble with a last-layer Laplace approximation around each member
  (`MixtureOfLaplace`, eqs. 7-8); prior precision ``--prior-precision`` (``auto``: N times the
  weight decay the networks were trained with), tuned by each member's Laplace evidence unless
  ``--laplace-prior fixed``.
- ``swag``: one network, then ``--swa-epochs`` of constant-rate SGD collecting SWAG statistics;
  ``--samples`` draws (Maddox et al., 2019).

The table compares the first member's MAP with the method (test NLL of the mixture and of its
moment match, RMSE, 95% coverage); ``--out`` gets ``results.json`` and a PNG of the predictive.
"""

from __future__ import annotations

import argparse
import time

import torch

from .. import likelihoods, metrics
from ..flat import num_weights
from ..infer import SWAG, DeepEnsemble, MixtureOfLaplace, MixturePredictor, train_ensemble
from . import defaults, options, report

INFERENCE = ("mola", "deep_ensemble", "swag")


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "MoLA, deep ensemble or SWAG on regression data"
    data = (options.REGRESSION_DATA, "toy")
    p = options.command_parser(commands, "mixture", summary, __doc__, data)
    g = p.add_argument_group("method")
    g.add_argument("--inference", choices=INFERENCE, default="mola", help="the mixture")
    g.add_argument(
        "--members", type=options.int_at_least(1), default=5, help="networks K (mola, DE)"
    )
    g.add_argument(
        "--prior-precision",
        type=options.number_or("auto", options.positive_float, "a number > 0"),
        default="auto",
        help="mola: the weight prior's precision; 'auto': N x --weight-decay",
    )
    options.add_laplace_prior(g, "mola", "--prior-precision")
    options.add_hessian(g, "mola", "auto")
    g.add_argument("--samples", type=options.int_at_least(1), default=300, help="swag: draws")
    t = options.add_regression_training(p, "of the MAP training")
    options.add_swa_options(t, "swag: SWAG")
    options.add_run_options(p)
    p.set_defaults(run=run, check=check)
    return p


def check(args: argparse.Namespace, given: set[str]) -> None:
    """Reject option combinations that do not make sense (`options.UsageError`)."""
    options.check_data(args, given)
    swag, mola = args.inference == "swag", args.inference == "mola"
    if swag and args.swa_epochs < 2:
        raise options.UsageError("--inference swag needs --swa-epochs >= 2")
    options.reject_unused(
        given,
        {
            "--members": (not swag, "to --inference mola or deep_ensemble"),
            "--prior-precision": (mola, "to --inference mola"),
            "--laplace-prior": (mola, "to --inference mola"),
            "--hessian": (mola, "to --inference mola"),
            **{o: (swag, "to --inference swag") for o in ("--samples", "--swa-epochs")},
            **{o: (swag, "to --inference swag") for o in ("--swa-lr", "--max-snapshots")},
        },
    )


def _scores(predictor: MixturePredictor, x: torch.Tensor, y: torch.Tensor) -> dict:
    weights, (means, variances) = predictor.components(x)
    if not torch.allclose(weights, weights.mean().expand_as(weights)):
        raise ValueError("predictor: the CLI table expects equal mixture weights")
    return metrics.regression_scores(means[..., 0], variances[..., 0], y.double())


def _train_nll(ens, data) -> float:
    """Training NLL of the first member (the MAP row of the table)."""
    _, (means, variances) = DeepEnsemble(ens.nets[:1], ens.likelihoods[0]).components(data.x_train)
    return metrics.regression_scores(means[..., 0], variances[..., 0], data.y_train.double())["nll"]


def _predictor(args: argparse.Namespace, ens, data) -> tuple[MixturePredictor, str]:
    if args.inference == "swag":
        swag = SWAG(ens.collectors[0], ens.likelihoods[0], num_samples=args.samples, seed=args.seed)
        return swag, "SWAG"
    if args.inference == "deep_ensemble":
        return DeepEnsemble(ens.nets, ens.likelihoods), f"DE ({len(ens.nets)} nets)"
    precision = args.prior_precision
    if precision == "auto":
        precision = data.n_train * args.weight_decay
    mola = MixtureOfLaplace(
        ens.nets, ens.likelihoods, prior_precision=precision, hessian_structure=args.hessian
    )
    mola.fit(data.x_train, data.y_train)
    if args.laplace_prior == "marglik":
        mola.optimize_prior_precision("marglik")
    return mola, f"MoLA ({len(ens.nets)} nets)"


def run(args: argparse.Namespace) -> dict:
    """Train, fit and score one mixture method; returns the results dict (also written)."""
    options.seed_everything(args.seed)
    data = options.load_data(args, "regression")
    swag = args.inference == "swag"
    swa = dict(swa_epochs=args.swa_epochs, swa_lr=args.swa_lr, max_snapshots=args.max_snapshots)
    t0 = time.perf_counter()

    def make_net():
        return options.mlp(data.n_features, options.hidden_widths(args), 1)

    args.epochs = defaults.resolve_epochs(args, data, make_net)
    ens = train_ensemble(
        make_net,
        likelihoods.Gaussian(),  # noise scale learned per member (type-II ML), then fixed
        data.x_train,
        data.y_train,
        seeds=[1000 * args.seed + k for k in range(1 if swag else args.members)],
        progress=not args.no_progress,
        collector=swag,
        epochs=args.epochs,
        lr=args.lr,
        weight_decay=args.weight_decay,
        **(swa if swag else {}),
    )
    t_train = time.perf_counter() - t0
    t1 = time.perf_counter()
    predictor, name = _predictor(args, ens, data)
    t_infer = time.perf_counter() - t1
    rank = num_weights(ens.nets[0])
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
        "epochs": args.epochs,
        "rows": rows,
        "warnings": defaults.overfit_warnings(_train_nll(ens, data), rows),
    }

    def plot(out):
        pred = predictor.predict(data.grid if data.grid is not None else data.x_test)
        mean, var = pred.mean, pred.variance  # the mixture of Gaussians: its moments
        path = out / f"{data.name}_{args.inference}.png"
        mean, std = mean[:, 0].float(), var[:, 0].sqrt().float()
        return report.plot_predictive(path, data, mean, std, f"{name} on {data.name}")

    return report.publish(results, args.out, report.regression_table, plot)
