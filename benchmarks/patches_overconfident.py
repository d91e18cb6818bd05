"""Ensemble Model Patching in the regime the paper claims it for: an *overconfident* network.

Chang et al. report their calibration gains (ImageNet ECE 1.65 % for ECMP against 8.09 % for
vanilla, Table 3; CIFAR-100 8.73 % against 21.6 %, Table 8) for large networks trained long to
near-zero training loss with almost no regularisation (λ = 0.001 / batch size, appendix C.1).
On the full digits set (``benchmarks/patches_digits.py``) a small BN-MLP is already calibrated
(vanilla ECE 0.7 %), so there is nothing for ECMP to fix. This benchmark builds the overconfident
regime at a size two shared cores train in minutes:

- **data**: scikit-learn digits, a stratified training subset of ``--n-train`` points (300) per
  seed; every other digit (≈ 1500) is the test set, so that test error and ECE are not
  dominated by a handful of points;
- **net**: a wide BN-MLP ``64-W-BN-ReLU-W-BN-ReLU-10`` (``W = --hidden``, 512), Adam on
  default settings (lr 1e-3, batch 64) for ``--epochs`` (300) epochs: training loss ≈ 0;
- **prior**: ``N(0, τ⁻¹ I)`` with τ = 0.01 for every method (vanilla: weight decay τ/N =
  3.3e-5, the order of the paper's λ), so nothing but the method changes the calibration.

Methods: vanilla (MAP), MC dropout (p = 0.1 on the inputs of the 2nd and 3rd Linear), EMP and
ECMP (BN + output layer patched, K = 5, σ → 0: `PatchedNet` defaults of the paper), and a deep
ensemble of 5 vanilla nets trained independently, each for the full number of epochs. S = 100
draws for the Bayesian predictives. Test sets: clean, rotated 15° and 30°, and Gaussian pixel
noise (std 4 on the raw 0–16 scale, clipped). Columns: accuracy, NLL, ECE (20 bins, appendix
D.2), and the mutual information between the draws (epistemic part of the predictive entropy,
``H[E p] − E H[p]``). A last table reports how far the K components of each patched tensor are
apart at initialisation and after training (rms distance of each component from the
component mean, relative to the rms of that mean).

Numbers are mean ± standard error over ``--seeds`` seeds (data subset, init, draws).

``--ablation`` instead trains EMP/ECMP with ``init_jitter`` 0.1 (default) and 0.5 (wider initial
spread of the normalisation-layer components) and reports ECE, NLL and mutual information.

    python benchmarks/patches_overconfident.py [--seeds 3] [--epochs 300] [--hidden 512]
        [--n-train 300] [--ablation] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import torch
from sklearn.model_selection import train_test_split

from pyro_subspace import PatchedNet, datasets, fit_map, likelihoods
from pyro_subspace.metrics import classification_scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks.ood import rotate_images
from benchmarks.protocols import bn_mlp

METHODS = ("vanilla", "dropout", "emp", "ecmp", "deep_ens")
SHIFTS = ("clean", "rot15", "rot30", "noise4")


def overconfident_split(seed: int, n_train: int) -> dict:
    """Digits: a stratified training subset of ``n_train`` points, all other digits as test
    set, standardised with the training statistics; the shifted test inputs by name."""
    full = datasets.digits(seed=seed, standardize=False)
    x = torch.cat([full.x_train, full.x_test]).numpy()
    y = torch.cat([full.y_train, full.y_test]).numpy()
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, train_size=n_train, random_state=seed, stratify=y
    )
    mean, std = x_tr.mean(0), x_tr.std(0)
    std = np.where(std > 0, std, 1.0)
    mean, std = (
        torch.as_tensor(mean, dtype=torch.float32),
        torch.as_tensor(std, dtype=torch.float32),
    )
    raw = torch.as_tensor(x_te, dtype=torch.float32)
    gen = torch.Generator().manual_seed(10_000 + seed)
    noisy = (raw + 4.0 * torch.randn(raw.shape, generator=gen)).clamp(0.0, 16.0)
    shifted = {
        "clean": raw,
        "rot15": rotate_images(raw, 15.0),
        "rot30": rotate_images(raw, 30.0),
        "noise4": noisy,
    }
    return {
        "x": (torch.as_tensor(x_tr, dtype=torch.float32) - mean) / std,
        "y": torch.as_tensor(y_tr, dtype=torch.int64),
        "y_test": torch.as_tensor(y_te, dtype=torch.int64),
        "tests": {k: (v - mean) / std for k, v in shifted.items()},
    }


def mutual_information(draws: torch.Tensor) -> float:
    """Mean over points of ``H[mean_s p_s] − mean_s H[p_s]`` (nats) for draws ``(S, N, C)``."""
    p = draws.clamp_min(1e-12)
    mean = p.mean(0)
    h_mean = -(mean * mean.log()).sum(-1)
    mean_h = -(p * p.log()).sum(-1).mean(0)
    return float((h_mean - mean_h).mean())


def component_spread(model: PatchedNet) -> dict[str, float]:
    """Per patched tensor: rms distance of the K components from their mean over the rms of
    that mean (0: collapsed components)."""
    out = {}
    for s in model.slots:
        if s.kind != "patch":
            continue
        m = model.means()[s.name].detach()
        centre = m.mean(0)
        spread = (m - centre).square().mean().sqrt()
        out[s.name] = float(spread / centre.square().mean().sqrt().clamp_min(1e-12))
    return out


def train_all(split: dict, seed: int, args: argparse.Namespace) -> dict:
    """Train every method on one split; returns {method: (draw fn, seconds, extras)}."""
    x, y, n = split["x"], split["y"], split["x"].shape[0]
    lik = likelihoods.Categorical()
    train = dict(epochs=args.epochs, batch_size=args.batch_size, seed=seed)
    trained = {}

    def vanilla(s: int):
        net = bn_mlp(64, 10, hidden=args.hidden, seed=s)
        torch.manual_seed(s)
        losses = fit_map(
            net,
            lik,
            x,
            y,
            lr=1e-3,
            weight_decay=args.tau / n,
            progress=False,
            **{**train, "seed": s},
        )
        return net.eval(), losses[-1]

    t0 = time.process_time()
    net, last = vanilla(seed)
    trained["vanilla"] = (
        lambda xt, net=net: net(xt).softmax(-1)[None],
        time.process_time() - t0,
        {"train_loss": last},
    )
    t0 = time.process_time()
    members = [net] + [vanilla(1000 * (j + 1) + seed)[0] for j in range(args.k - 1)]
    trained["deep_ens"] = (
        lambda xt, ms=members: torch.stack([m(xt).softmax(-1) for m in ms]),
        time.process_time() - t0 + trained["vanilla"][1],
        {},
    )
    for mode in ("dropout", "emp", "ecmp"):
        pyro.clear_param_store()
        torch.manual_seed(seed)
        model = PatchedNet(
            bn_mlp(64, 10, hidden=args.hidden, seed=seed),
            lik,
            mode=mode,
            n_components=args.k,
            prior_precision=args.tau,
            sigma=0.0,
            drop_prob=0.1,
            seed=seed,
        )
        init_spread = component_spread(model) if mode != "dropout" else {}
        t0 = time.process_time()
        losses = model.fit(x, y, lr=1e-3, **train)
        seconds = time.process_time() - t0
        model.eval()

        def draws(xt, model=model):
            return model.likelihood.mean(model.sample_outputs(xt, args.samples))

        extras = {"train_loss": losses[-1], "spread0": init_spread}
        if mode != "dropout":
            extras["spread"] = component_spread(model)
        trained[mode] = (draws, seconds, extras)
    return trained


def jitter_ablation(args: argparse.Namespace, jitters=(0.1, 0.5)) -> list[str]:
    """EMP/ECMP with wider initial spread of the normalisation-layer components
    (``init_jitter``): does the calibration follow the diversity left after training?"""
    lik = likelihoods.Categorical()
    rows = {}
    for seed in range(args.seeds):
        split = overconfident_split(seed, args.n_train)
        for mode in ("emp", "ecmp"):
            for jit in jitters:
                pyro.clear_param_store()
                torch.manual_seed(seed)
                model = PatchedNet(
                    bn_mlp(64, 10, hidden=args.hidden, seed=seed),
                    lik,
                    mode=mode,
                    n_components=args.k,
                    prior_precision=args.tau,
                    sigma=0.0,
                    init_jitter=jit,
                    seed=seed,
                )
                model.fit(
                    split["x"],
                    split["y"],
                    lr=1e-3,
                    epochs=args.epochs,
                    batch_size=args.batch_size,
                    seed=seed,
                )
                model.eval()
                spread = component_spread(model)
                row = rows.setdefault((mode, jit), {})
                row.setdefault("bn_w", []).append(spread["1.weight"])
                torch.manual_seed(2000 + seed)
                for shift in SHIFTS:
                    with torch.no_grad():
                        d = model.likelihood.mean(
                            model.sample_outputs(split["tests"][shift], args.samples)
                        )
                    sc = classification_scores(d.mean(0), split["y_test"])
                    row.setdefault(f"ece_{shift}", []).append(sc["ece"])
                    row.setdefault(f"nll_{shift}", []).append(sc["nll"])
                    row.setdefault(f"mi_{shift}", []).append(mutual_information(d))
    lines = [
        "Ablation: initial spread of the BN components (init_jitter; default 0.1), "
        f"{args.seeds} seed(s)",
        f"{'mode':<6}{'jitter':>7}{'BN-1 gamma spread':>19}"
        + "".join(f"{'ECE ' + t + ' %':>16}{'NLL ' + t:>14}{'MI ' + t:>16}" for t in SHIFTS),
    ]
    for (mode, jit), r in rows.items():
        lines.append(
            f"{mode:<6}{jit:>7.2f}{_se(r['bn_w']):>19}"
            + "".join(
                f"{_se(r['ece_' + t], 100, 2):>16}{_se(r['nll_' + t]):>14}"
                f"{_se(r['mi_' + t], 1, 4):>16}"
                for t in SHIFTS
            )
        )
    return lines


def _se(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    m = statistics.fmean(values) * scale
    se = (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0) * scale
    return f"{m:.{digits}f}±{se:.{digits}f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--n-train", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--tau", type=float, default=0.01, help="prior precision τ of every method")
    p.add_argument("--k", type=int, default=5, help="K components / ensemble members")
    p.add_argument("--samples", type=int, default=100, help="S draws for the predictives")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    p.add_argument("--ablation", action="store_true", help="only the init_jitter ablation")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.hidden, args.samples, args.k = 1, 2, 32, 5, 2
    torch.set_num_threads(1)
    if args.ablation:
        load0 = os.getloadavg()[0]
        lines = jitter_ablation(args)
        lines.append(f"(load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end)")
        print("\n".join(lines))
        return {"ablation": lines}
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    # res[method][shift][metric] -> list over seeds
    res = {m: {s: {k: [] for k in ("acc", "nll", "ece", "mi")} for s in SHIFTS} for m in METHODS}
    secs = {m: [] for m in METHODS}
    train_loss = {m: [] for m in METHODS}
    spreads: dict[str, dict[str, list[tuple[float, float]]]] = {"emp": {}, "ecmp": {}}
    for seed in range(args.seeds):
        split = overconfident_split(seed, args.n_train)
        trained = train_all(split, seed, args)
        for name, (draw, seconds, extras) in trained.items():
            secs[name].append(seconds)
            if "train_loss" in extras:
                train_loss[name].append(extras["train_loss"])
            for tname, spread in extras.get("spread", {}).items():
                spreads[name].setdefault(tname, []).append((extras["spread0"][tname], spread))
            torch.manual_seed(2000 + seed)
            for shift, xt in split["tests"].items():
                with torch.no_grad():
                    d = draw(xt)
                sc = classification_scores(d.mean(0), split["y_test"])
                for k in ("acc", "nll", "ece"):
                    res[name][shift][k].append(sc[k])
                res[name][shift]["mi"].append(mutual_information(d) if d.shape[0] > 1 else 0.0)
    n_test = split["y_test"].shape[0]
    lines = [
        f"digits overconfident regime: {args.n_train} training digits, {n_test} test digits, "
        f"BN-MLP 64-{args.hidden}-BN-ReLU-{args.hidden}-BN-ReLU-10, Adam lr 1e-3, batch "
        f"{args.batch_size}, {args.epochs} epochs, tau={args.tau} (vanilla weight decay "
        f"{args.tau / args.n_train:.2g}), K={args.k}, sigma=0, dropout p=0.1, S={args.samples}; "
        f"mean ± standard error over {args.seeds} seed(s)",
        "final training loss (mean NLL per point, last epoch): "
        + ", ".join(f"{m} {_se(v, digits=4)}" for m, v in train_loss.items() if v),
    ]
    for shift in SHIFTS:
        lines += ["", f"Test set: {shift}"]
        lines.append(
            f"{'method':<10}{'acc %':>14}{'NLL':>16}{'ECE %':>14}{'MI (nats)':>16}"
            f"{'ECE vs van.':>13}{'CPU s':>9}"
        )
        van = res["vanilla"][shift]["ece"]
        for name in METHODS:
            r = res[name][shift]
            diff = [a - b for a, b in zip(r["ece"], van)]
            lines.append(
                f"{name:<10}{_se(r['acc'], 100, 2):>14}{_se(r['nll']):>16}"
                f"{_se(r['ece'], 100, 2):>14}{_se(r['mi'], 1, 4):>16}"
                f"{_se(diff, 100, 2):>13}{statistics.fmean(secs[name]):>9.1f}"
            )
    lines += [
        "",
        "Spread of the K components of each patched tensor (rms distance from the component "
        "mean / rms of that mean): at initialisation -> after training",
    ]
    for mode, by_tensor in spreads.items():
        for tname, pairs in by_tensor.items():
            a = _se([p[0] for p in pairs], 1, 3)
            b = _se([p[1] for p in pairs], 1, 3)
            lines.append(f"{mode:<6}{tname:<12}{a:>16} -> {b:>16}")
    lines.append(
        f"(wall time {time.perf_counter() - t_start:.0f} s; torch threads "
        f"{torch.get_num_threads()}; load average {load0:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end)"
    )
    print("\n".join(lines))
    return {"results": res, "seconds": secs, "spreads": spreads, "train_loss": train_loss}


if __name__ == "__main__":
    main()
