"""``pyro-subspace patch``: Ensemble Model Patching against the vanilla network, classification.

Trains a BatchNorm MLP (``in-h-BN-ReLU-…-h-BN-ReLU-out``, ``--hidden``) twice from the same
initialisation, with Adam on shuffled minibatches and the same prior ``N(0, τ⁻¹ I)``
(``τ = --prior-precision``): the vanilla MAP (weight decay ``τ/N``) and a `PatchedNet` (``emp``
/ ``ecmp``: BN + output layer patched with ``--components`` components, eqs. 5-6; ``dropout``:
MC dropout; ``ensemble``: ``--components`` whole networks). Predicts with ``--samples`` Monte
Carlo draws (Algorithm 1), prints accuracy / NLL / ECE / MCE (20 bins, appendix D.2),
parameter overhead and training CPU time, and writes ``results.json`` and a reliability
diagram (Chang et al., Ensemble Model Patching). The defaults are the protocol of
``benchmarks/protocols.py`` in a source checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch

from .. import datasets, likelihoods, metrics
from ..nn import PatchedNet
from ..train import fit_map
from . import options, report

INFERENCE = ("emp", "ecmp", "dropout", "ensemble")
#: The report's calibration bins (Ensemble Model Patching, appendix D.2: 20 equal-width bins,
#: a bin counted by ECE/MCE when it holds more than 5 test points).
N_BINS, MIN_COUNT = 20, 5


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "Ensemble Model Patching (emp, ecmp, dropout, ensemble) vs vanilla, classification"
    p = options.command_parser(commands, "patch", summary, __doc__, (("digits", "csv"), "digits"))
    g = p.add_argument_group("method")
    g.add_argument("--inference", choices=INFERENCE, default="ecmp", help="the patching method")
    g.add_argument(
        "--components",
        type=options.int_at_least(2),
        default=5,
        help="K: mixture components per patch (emp, ecmp) or networks (ensemble)",
    )
    g.add_argument(
        "--drop-prob",
        type=options.probability,
        default=0.1,
        help="dropout: probability of dropping a unit",
    )
    g.add_argument(
        "--prior-precision",
        type=options.positive_float,
        default=1.0,
        help="tau of the weight prior N(0, 1/tau I), shared by all methods",
    )
    g.add_argument(
        "--samples", type=options.int_at_least(1), default=300, help="Monte Carlo predictive draws"
    )
    t = options.add_network_options(
        p, hidden="128,128", hidden_help="hidden widths (each Linear-BN-ReLU)", epochs=200, lr=1e-3
    )
    t.add_argument("--batch-size", type=options.int_at_least(1), default=128, help="minibatch")
    options.add_run_options(p)
    p.set_defaults(run=run, check=check)
    return p


def check(args: argparse.Namespace, given: set[str]) -> None:
    """Reject option combinations that do not make sense (`options.UsageError`)."""
    options.check_data(args, given)
    if args.epochs < 1:
        raise options.UsageError("--epochs: expected a positive int")
    dropout = args.inference == "dropout"
    options.reject_unused(
        given,
        {
            "--components": (not dropout, "to --inference emp, ecmp or ensemble"),
            "--drop-prob": (dropout, "to --inference dropout"),
        },
    )


def check_size(args: argparse.Namespace, data: datasets.Dataset) -> None:
    """The data can give the report (`options.UsageError` before any training, naming its
    size): two classes at least, and more than ``MIN_COUNT`` test points, without which no
    calibration bin is counted and ECE/MCE do not exist."""
    source = f"--csv {args.csv}" if args.dataset == "csv" else f"--dataset {args.dataset}"
    if int(data.n_classes) < 2:
        raise options.UsageError(
            f"{source}: --target {args.target} holds {int(data.n_classes)} class; a classifier "
            "needs at least 2"
        )
    n_test = data.x_test.shape[0]
    rows = data.n_train + n_test
    if n_test <= MIN_COUNT:
        need = math.ceil(rows * (MIN_COUNT + 1) / n_test)
        raise options.UsageError(
            f"{source}: {rows} rows give a test split of {n_test} points; the report's ECE and "
            f"MCE count the confidence bins of more than {MIN_COUNT} test points "
            f"(Ensemble Model Patching D.2), so they need at least {MIN_COUNT + 1}: give a CSV "
            f"of about {need} rows or more"
        )


def _scores(name: str, probs: torch.Tensor, y: torch.Tensor, warnings: list[str]) -> dict:
    """`metrics.classification_scores`, with ECE and MCE ``None`` (and a warning) where no
    confidence bin holds more than ``MIN_COUNT`` of the test points (possible below
    ``N_BINS · MIN_COUNT`` points): the trained models are still reported."""
    count = metrics.reliability_diagram_data(probs, y, N_BINS)[2]
    if bool((count > MIN_COUNT).any()):
        return metrics.classification_scores(probs, y, N_BINS, MIN_COUNT)
    warnings.append(
        f"{name}: ECE and MCE are n/a: none of the {N_BINS} confidence bins holds more than "
        f"{MIN_COUNT} of the {len(y)} test points (a larger test split)"
    )
    return {
        "acc": metrics.accuracy(probs, y), "nll": metrics.categorical_nll(probs, y),
        "ece": None, "mce": None,
    }  # fmt: skip


def _train(name: str, args: argparse.Namespace, data: datasets.Dataset):
    """Train ``vanilla`` or a patching method; returns the model (eval mode), CPU seconds and
    the parameter overhead in percent."""
    with torch.random.fork_rng(devices=[]):  # one initialisation for every method
        torch.manual_seed(args.seed)
        net = options.mlp(data.n_features, args.hidden, int(data.n_classes), batchnorm=True)
    lik = likelihoods.Categorical()
    options.seed_everything(args.seed)
    t0 = time.process_time()
    settings = dict(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
    if name == "vanilla":
        settings.update(weight_decay=args.prior_precision / data.n_train, progress=False)
        fit_map(net, lik, data.x_train, data.y_train, **settings)  # the prior as L2: tau/N
        return net.eval(), time.process_time() - t0, 0.0
    model = PatchedNet(
        net,
        lik,
        mode=name,
        n_components=args.components,
        prior_precision=args.prior_precision,
        drop_prob=args.drop_prob,
        sigma=0.0,
        seed=args.seed,
    )
    model.fit(data.x_train, data.y_train, **settings)
    return model.eval(), time.process_time() - t0, model.overhead


@torch.no_grad()
def _probs(model, x: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Class probabilities ``(N, C)``: the mean of ``num_samples`` draws, or one softmax."""
    if isinstance(model, PatchedNet):
        return model.predictive_mean(x, num_samples)
    return model(x).softmax(-1)


def run(args: argparse.Namespace) -> dict:
    """Train vanilla and ``--inference``, score both; returns the results (also written)."""
    data = options.load_data(args, "classification")
    check_size(args, data)
    rows, probs, warnings = {}, {}, []
    # untimed: one epoch of each on a few rows pays the one-off costs (first autograd and BLAS
    # calls, lazy imports: ~1 s) that would otherwise land on whichever method runs first
    few = dataclasses.replace(data, x_train=data.x_train[:64], y_train=data.y_train[:64])
    for name in ("vanilla", args.inference):
        _train(name, argparse.Namespace(**{**vars(args), "epochs": 1}), few)
    for name in ("vanilla", args.inference):
        if not args.no_progress:
            print(f"training {name} ({args.epochs} epochs) ...", end=" ", flush=True)
        model, seconds, overhead = _train(name, args, data)
        if not args.no_progress:
            print(f"done in {seconds:.1f} CPU s", flush=True)
        torch.manual_seed(args.seed)
        probs[name] = _probs(model, data.x_test, args.samples)
        rows[name] = {
            **_scores(name, probs[name], data.y_test, warnings),
            "overhead_percent": overhead,
            "train_seconds": seconds,
        }
    results = {
        "dataset": data.name,
        "inference": args.inference,
        "components": args.components,
        "samples": args.samples,
        "epochs": args.epochs,
        "prior_precision": args.prior_precision,
        "rows": rows,
    }
    if warnings:
        results["warnings"] = warnings

    def plot(out):
        path = out / f"{data.name}_{args.inference}_calibration.png"
        title = f"{data.name}: vanilla vs {args.inference}"
        return report.plot_reliability(path, probs, data.y_test, title)

    return report.publish(results, args.out, report.classification_table, plot)
