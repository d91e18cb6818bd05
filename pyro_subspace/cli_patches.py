"""``pyro-subspace --inference emp|ecmp|dropout|ensemble``: Ensemble Model Patching on digits.

Trains the vanilla BatchNorm MLP and the chosen `PatchedNet` method with the protocol of
`pyro_subspace.nn.patched_experiment` (Adam lr 1e-3, batch 128, the same prior), predicts with
``--samples`` Monte Carlo draws (Algorithm 1), prints accuracy / NLL / ECE / MCE (appendix D.2),
parameter overhead and training time, and writes ``results.json`` and a reliability diagram.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from . import datasets, metrics
from .nn.patched_experiment import scores, train_method

PATCH_INFERENCE = ("emp", "ecmp", "dropout", "ensemble")


def run_patches(args: argparse.Namespace) -> dict:
    """Run the job for ``args.inference`` in `PATCH_INFERENCE`; returns the results table."""
    if args.dataset not in ("digits", "toy"):  # "toy" is the command's default: use digits
        raise SystemExit(
            f"--inference {args.inference}: runs on --dataset digits (classification), "
            f"got --dataset {args.dataset}"
        )
    for name in ("epochs", "samples", "members"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected a positive int, got {getattr(args, name)}")
    if args.inference != "dropout" and args.members < 2:
        raise SystemExit(f"--members: {args.inference} needs K >= 2 components")
    data = datasets.digits(seed=args.seed)
    tau = 1.0 / args.prior_scale**2
    rows, probs = {}, {}
    for name in ("vanilla", args.inference):
        trained = train_method(
            name,
            data,
            epochs=args.epochs,
            prior_precision=tau,
            n_components=max(args.members, 2),
            seed=args.seed,
        )
        torch.manual_seed(args.seed)
        p = trained.probs(data.x_test, args.samples)
        probs[name] = p
        rows[name] = {
            **scores(p, data.y_test),
            "overhead_percent": trained.overhead,
            "train_seconds": trained.seconds,
        }
    results = {
        "dataset": "digits",
        "inference": args.inference,
        "components": args.members,
        "samples": args.samples,
        "epochs": args.epochs,
        "prior_precision": tau,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    results["plot"] = str(_plot(out, args.inference, probs, data.y_test))
    print(_table(results))
    return results


def _table(results: dict) -> str:
    lines = [
        (
            f"dataset=digits  inference={results['inference']}  K={results['components']}  "
            f"S={results['samples']}  epochs={results['epochs']}  tau={results['prior_precision']:.3g}"
        ),
        f"{'method':<10}{'acc':>8}{'NLL':>8}{'ECE':>8}{'MCE':>8}{'overhead':>10}{'train s':>9}",
    ]
    for name, r in results["rows"].items():
        lines.append(
            f"{name:<10}{r['acc']:>8.4f}{r['nll']:>8.4f}{r['ece']:>8.4f}{r['mce']:>8.4f}"
            f"{r['overhead_percent']:>9.2f}%{r['train_seconds']:>9.2f}"
        )
    return "\n".join(lines)


def _plot(out: Path, inference: str, probs: dict, y: torch.Tensor) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    for name, p in probs.items():
        conf, acc, count = metrics.reliability_diagram_data(p, y, n_bins=20)
        keep = count > 5  # the bins ECE/MCE use (appendix D.2)
        ax.plot(conf[keep], acc[keep], "o-", label=name)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(f"digits: vanilla vs {inference}")
    ax.legend(loc="upper left")
    path = out / f"digits_{inference}_calibration.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
