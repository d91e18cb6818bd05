"""MoLA Table 1 and Figure 2 at 8x8 scale: out-of-distribution detection and rotation shift.

In-distribution: scikit-learn's digits (1797 8x8 images, 10 classes), a seeded stratified 80/20
split; 15% of the training split is held out as the validation set that tunes the prior
precision of LLLA and MoLA (never trained on by any method). Network: a ReLU MLP
64-100-100-C trained with Adam and weight decay (the MAP). OOD sets, built offline
(`benchmarks/ood.py`: `ood_digits`, `digits_split_classes`):

- uniform noise images; pixel-permuted test digits; test digits scaled far away, ``δ·x`` for
  ``δ = 10, 100, 1000`` (MoLA B.1);
- held-out classes: a second set of models trained on digits 0–4 only, with 5–9 as OOD.

Methods (MoLA section 4 / Table 1):

- MAP: the first network; DE: K = 5 networks from different seeds (eq. 3);
- SWAG / MultiSWAG: 20 epochs of constant-rate SGD from the first / every trained network, 20
  snapshots, 30 draws per network (Maddox et al., 2019); the rate tuned as in the paper's
  Appendix F: the largest of 0.1, 0.05, 0.01, 0.005, 0.001 whose mean validation confidence
  reaches the threshold below (tuning time counted in SWAG's fit time);
- LLLA / MoLA: a last-layer Laplace approximation around the first / every network (eqs. 1,
  6, 7) with the full GGN of the last layer (``hessian_structure="full"``, bias included),
  probit predictive, one prior precision shared by the members tuned as in the paper's
  Appendix F: the smallest λ in 10^-4 … 10^4 whose mean validation confidence reaches the
  validation accuracy of the networks minus 0.01.
- KFAC-LLLA / MoLA (K-FAC): the same with the last layer's K-FAC posterior
  (``hessian_structure="kron"``: the type-2 Fisher = GGN factors ``G ⊗ A`` of the last
  ``nn.Linear``'s weight, its bias a block ``G`` of its own as in laplace-torch, the prior
  ``λI`` added exactly in the Kronecker eigenbasis), MoLA's Algorithm 1 as the paper runs it
  (App. B.2); same λ tuning.
- MAP + TS: the first network with temperature scaling (Guo et al., 2017): one ``T`` on the
  logits minimising the NLL of the same validation split (`infer.TemperatureScaling`).

Metrics: in-distribution accuracy, NLL, ECE (20 bins) and MMC; OOD MMC (lower is better) and
AUROC of telling OOD from test points by the confidence; the rotated test digits' log-likelihood
and ECE against the angle (Figure 2 at this scale). Means ± standard errors over seeds (each
seed: a new split, new networks). Fit and predict times are relative to DE (fit: training plus
any post-hoc step; predict: the in-distribution test set); wall-clock on shared CPU cores.

    python benchmarks/ood_digits.py [--seeds 5] [--quick]

The K-FAC and temperature-scaling rows are computed after the others and draw no random
numbers, so they leave every other row's numbers as they were. ``T`` is searched in
``[1e-3, 1e3]``: where the MAP classifies every point of a validation split correctly (the
0–4 task's small split, on some seeds) the validation NLL decreases all the way to ``T → 0``,
``T`` stops at ``1e-3`` with a ``ConvergenceWarning`` and MAP + TS is a one-hot predictive on
that task (its "classes 5-9" columns); the ``T`` of each seed is printed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from pyro_subspace import datasets, fit_map, likelihoods, metrics, subspaces
from pyro_subspace.infer import (
    SWAG,
    DeepEnsemble,
    LastLayerLaplace,
    MixtureOfLaplace,
    MultiSWAG,
    TemperatureScaling,
    train_ensemble,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks.ood import digits_split_classes, ood_sets, rotated_digits

SWA_LRS = (0.1, 0.05, 0.01, 0.005, 0.001)  # MoLA App. F's grid for SWAG, largest first
METHODS = (
    "MAP", "DE", "SWAG", "MultiSWAG", "LLLA", "MoLA", "KFAC-LLLA", "MoLA (K-FAC)", "MAP + TS",
)  # fmt: skip
#: the Laplace rows: (nets used, last-layer posterior structure)
LAPLACE = {
    "LLLA": (1, "full"),
    "MoLA": (None, "full"),
    "KFAC-LLLA": (1, "kron"),
    "MoLA (K-FAC)": (None, "kron"),
}
OOD_SETS = ("noise", "permuted", "δ=10", "δ=100", "δ=1000", "classes 5-9")


def make_net(d: int, c: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, c),
    )  # fmt: skip


def split_validation(data: datasets.Dataset, seed: int, fraction: float = 0.15):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(data.n_train, generator=gen)
    n_val = round(fraction * data.n_train)
    val, tr = order[:n_val], order[n_val:]
    return data.x_train[tr], data.y_train[tr], data.x_train[val], data.y_train[val]


def build(data: datasets.Dataset, args: argparse.Namespace, seed: int) -> tuple[dict, dict]:
    """Train the ensemble, SWAG phases and Laplace fits; return predictors and fit times."""
    x, y, x_val, y_val = split_validation(data, seed)
    lik = likelihoods.Categorical()
    fit_kw = {
        "epochs": args.epochs,
        "lr": 1e-3,
        "weight_decay": args.weight_decay,
        "batch_size": 64,
    }
    seeds = [1000 * seed + k for k in range(args.members)]
    t_net = []
    nets = []
    for s in seeds:  # timed one by one; train_ensemble does the seeding
        t0 = time.perf_counter()
        ens = train_ensemble(
            lambda: make_net(data.n_features, data.n_classes, args.hidden), lik, x, y,
            seeds=[s], progress=False, **fit_kw,
        )  # fmt: skip
        t_net.append(time.perf_counter() - t0)
        nets += ens.nets

    def swa(net: nn.Module, s: int, lr: float) -> subspaces.SWACollector:
        copy = make_net(data.n_features, data.n_classes, args.hidden)
        copy.load_state_dict(net.state_dict())
        col = subspaces.SWACollector(copy, max_snapshots=20)
        fit_map(copy, lik, x, y, epochs=0, swa_epochs=args.swa_epochs, swa_lr=lr,
                collector=col, batch_size=64, weight_decay=args.weight_decay, seed=s,
                optimizer="sgd", progress=False)  # fmt: skip
        return col

    # the SWAG learning rate, tuned like the prior precision (paper App. F): the largest rate in
    # the paper's grid whose SWAG mean validation confidence reaches the threshold
    threshold = metrics.accuracy(DeepEnsemble(nets, lik).predict(x_val).probs, y_val) - 0.01
    t0 = time.perf_counter()
    first, swa_lr = None, SWA_LRS[-1]
    for lr in SWA_LRS:
        try:
            col = swa(nets[0], seeds[0], lr)
        except FloatingPointError:
            continue  # diverged at this rate
        if metrics.mmc(SWAG(col, lik, num_samples=30, seed=seed).predict(x_val).probs) >= threshold:
            first, swa_lr = col, lr
            break
    t_tune_swa = time.perf_counter() - t0
    collectors, t_swa = [], []
    for k, (net, s) in enumerate(zip(nets, seeds)):  # SWAG from each trained mode (MultiSWAG)
        t0 = time.perf_counter()
        collectors.append(first if k == 0 and first is not None else swa(net, s, swa_lr))
        t_swa.append(time.perf_counter() - t0 + (t_tune_swa if k == 0 else 0.0))
    lam0 = x.shape[0] * args.weight_decay  # the training prior, the Laplace starting point
    timed = {}
    for name, (k, structure) in LAPLACE.items():
        t0 = time.perf_counter()
        kw = {"prior_precision": lam0, "hessian_structure": structure}
        la = LastLayerLaplace(nets[0], lik, **kw) if k == 1 else MixtureOfLaplace(nets, lik, **kw)
        la.fit(x, y).optimize_prior_precision("confidence", x_val, y_val)
        timed[name] = (la, time.perf_counter() - t0)
    t0 = time.perf_counter()
    ts = TemperatureScaling(nets[0], lik).fit(x_val, y_val)  # T on the same validation split
    timed["MAP + TS"] = (ts, time.perf_counter() - t0)
    predictors = {
        "MAP": (DeepEnsemble(nets[:1], lik), t_net[0]),
        "DE": (DeepEnsemble(nets, lik), sum(t_net)),
        "SWAG": (SWAG(collectors[0], lik, num_samples=30, seed=seed), t_net[0] + t_swa[0]),
        "MultiSWAG": (
            MultiSWAG(collectors, lik, num_samples=30, seed=seed),
            sum(t_net) + sum(t_swa),
        ),
        "LLLA": (timed["LLLA"][0], t_net[0] + timed["LLLA"][1]),
        "MoLA": (timed["MoLA"][0], sum(t_net) + timed["MoLA"][1]),
    }
    for name in ("KFAC-LLLA", "MoLA (K-FAC)", "MAP + TS"):
        k = LAPLACE[name][0] if name in LAPLACE else 1
        predictors[name] = (timed[name][0], (t_net[0] if k == 1 else sum(t_net)) + timed[name][1])
    lams = {n: timed[n][0].prior_precision for n in ("LLLA", "MoLA")} | {"SWAG lr": swa_lr}
    lams_new = {n: timed[n][0].prior_precision for n in ("KFAC-LLLA", "MoLA (K-FAC)")}
    lams_new["T (MAP + TS)"] = float(ts.temperature)
    return predictors, (lams, lams_new)


def one_seed(args: argparse.Namespace, seed: int) -> dict:
    torch.manual_seed(seed)
    data = datasets.digits(seed=seed)
    ood = ood_sets(data, seed)
    rotated = {a: rotated_digits(data, a) for a in args.angles}
    predictors, lams = build(data, args, seed)
    half, x_half_ood = digits_split_classes(seed=seed)
    predictors_half, lams_half = build(half, args, seed)
    (lams, lams_new), (lams_half, lams_new_half) = lams, lams_half
    out: dict = {"lambda": {**lams, **{f"{k} (0-4)": v for k, v in lams_half.items()}}}
    out["new"] = {**lams_new, **{f"{k} (0-4)": v for k, v in lams_new_half.items()}}
    for name in METHODS:
        pred, t_fit = predictors[name]
        t0 = time.perf_counter()
        p_in = pred.predict(data.x_test).probs
        t_pred = time.perf_counter() - t0
        row = {
            "acc": metrics.accuracy(p_in, data.y_test),
            "nll": metrics.categorical_nll(p_in, data.y_test),
            "ece": metrics.calibration_errors(p_in, data.y_test)[0],
            "mmc": metrics.mmc(p_in),
            "t_fit": t_fit,
            "t_pred": t_pred,
        }
        for key, x_ood in ood.items():
            p_out = pred.predict(x_ood).probs
            row[f"mmc {key}"] = metrics.mmc(p_out)
            row[f"auroc {key}"] = metrics.ood_auroc(p_in, p_out)
        pred_half = predictors_half[name][0]
        p_in_half = pred_half.predict(half.x_test).probs
        p_out_half = pred_half.predict(x_half_ood).probs
        row["mmc classes 5-9"] = metrics.mmc(p_out_half)
        row["auroc classes 5-9"] = metrics.ood_auroc(p_in_half, p_out_half)
        for angle, x_rot in rotated.items():
            p = pred.predict(x_rot).probs
            row[f"ll {angle}"] = -metrics.categorical_nll(p, data.y_test)
            row[f"ece {angle}"] = metrics.calibration_errors(p, data.y_test)[0]
        out[name] = row
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    se = float(t.std() / math.sqrt(len(values))) if len(values) > 1 else 0.0
    return float(t.mean()), se


def table(title: str, columns: list[tuple[str, str, float]], runs: list[dict]) -> None:
    """Print one table: rows = methods, columns = (header, key, scale) as mean ± se."""
    print(f"\n{title}")
    width = 15
    print(f"{'method':<13}" + "".join(f"{h:>{width}}" for h, _, _ in columns))
    for name in METHODS:
        cells = []
        for _, key, scale in columns:
            m, se = mean_se([r[name][key] * scale for r in runs])
            cells.append(f"{m:.2f} ± {se:.2f}" if scale != 1 or abs(m) < 100 else f"{m:.0f}")
        print(f"{name:<13}" + "".join(f"{c:>{width}}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--members", type=int, default=5, help="K networks of DE and MoLA")
    parser.add_argument("--epochs", type=int, default=60, help="Adam epochs per network")
    parser.add_argument("--swa-epochs", type=int, default=20, help="SGD epochs of SWAG")
    parser.add_argument("--hidden", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--quick", action="store_true", help="2 seeds, 3 members, short runs")
    args = parser.parse_args()
    args.angles = [0, 15, 30, 45, 60, 90, 120, 180]
    if args.quick:
        args.seeds, args.members, args.epochs, args.swa_epochs = 2, 3, 20, 5
        args.angles = [0, 45, 90]
    torch.set_num_threads(1)  # small MLPs: threads only contend on shared cores
    t0 = time.perf_counter()
    runs = [one_seed(args, seed) for seed in range(args.seeds)]
    # times relative to DE, per seed
    for r in runs:
        for name in METHODS:
            r[name]["fit/DE"] = r[name]["t_fit"] / r["DE"]["t_fit"]
            r[name]["pred/DE"] = r[name]["t_pred"] / r["DE"]["t_pred"]
    print(
        f"OOD digits: {args.seeds} seeds, K={args.members}, MLP 64-{args.hidden}-{args.hidden}-C, "
        f"{args.epochs} Adam epochs, wd {args.weight_decay}, SWAG {args.swa_epochs} epochs; "
        f"mean ± standard error over seeds; total {time.perf_counter() - t0:.0f}s"
    )
    print(
        "Rows: LLLA, MoLA: full GGN of the last layer (hessian_structure='full', bias included); "
        "KFAC-LLLA, MoLA (K-FAC): K-FAC of the last layer (hessian_structure='kron': type-2 "
        "Fisher factors G ⊗ A of the weight, the bias its own block G, prior λI added exactly "
        "in the Kronecker eigenbasis; MoLA's Algorithm 1); every Laplace row probit, λ by the "
        "App. F confidence rule; MAP + TS: the first network with one temperature T on its "
        "logits minimising the NLL of the same validation split (Guo et al., 2017)"
    )
    table(
        "In-distribution (digits test split); times relative to DE",
        [("acc %", "acc", 100), ("NLL", "nll", 1.0), ("ECE %", "ece", 100), ("MMC %", "mmc", 100),
         ("fit / DE", "fit/DE", 1.0), ("predict / DE", "pred/DE", 1.0)],
        runs,
    )  # fmt: skip
    table("OOD MMC % (lower is better)", [(k, f"mmc {k}", 100) for k in OOD_SETS], runs)
    table("OOD AUROC % (higher is better)", [(k, f"auroc {k}", 100) for k in OOD_SETS], runs)
    table("Rotated digits: test log-likelihood per point vs angle (higher is better)",
          [(f"{a}°", f"ll {a}", 1.0) for a in args.angles], runs)  # fmt: skip
    table("Rotated digits: ECE % vs angle (lower is better)",
          [(f"{a}°", f"ece {a}", 100) for a in args.angles], runs)  # fmt: skip
    print("\nTuned prior precision λ (LLLA, MoLA) and SWAG learning rate per seed (and 0-4 task):")
    for i, r in enumerate(runs):
        print(f"  seed {i}: " + ", ".join(f"{k} {v:.3g}" for k, v in r["lambda"].items()))
    print("\nTuned λ of the K-FAC rows and the temperature T of MAP + TS per seed (and 0-4 task):")
    for i, r in enumerate(runs):
        print(f"  seed {i}: " + ", ".join(f"{k} {v:.3g}" for k, v in r["new"].items()))
    for mola, llla in (("MoLA", "LLLA"), ("MoLA (K-FAC)", "KFAC-LLLA")):
        of = "" if mola == "MoLA" else f" for {mola} against DE and {llla}"
        print(f"\nTarget ordering (MoLA Table 1){of}, per OOD set on the seed means:")
        for key in OOD_SETS:
            m = {n: mean_se([r[n][f"auroc {key}"] for r in runs])[0] for n in METHODS}
            c = {n: mean_se([r[n][f"mmc {key}"] for r in runs])[0] for n in METHODS}
            checks = [
                ("AUROC ≥ DE", m[mola] >= m["DE"], 100 * (m[mola] - m["DE"])),
                (f"AUROC ≥ {llla}", m[mola] >= m[llla], 100 * (m[mola] - m[llla])),
                ("MMC < DE", c[mola] < c["DE"], 100 * (c[mola] - c["DE"])),
                (f"MMC < {llla}", c[mola] < c[llla], 100 * (c[mola] - c[llla])),
            ]
            text = ", ".join(
                f"{n} {'met' if ok else 'MISSED'} ({gap:+.2f})" for n, ok, gap in checks
            )
            print(f"  {key:<12} {text}")


if __name__ == "__main__":
    main()
