"""Ensemble Model Patching on scikit-learn digits: the paper's Table 3 / Table 7 protocol, small.

A BatchNorm MLP 64-128-BN-ReLU-128-BN-ReLU-10, Adam on default settings (lr 1e-3, batch 128)
for every method, the same prior ``N(0, τ⁻¹ I)`` (τ = 1; vanilla: weight decay τ/N), components
of width ``σ → 0`` (``sigma=0``; the paper fixes σ to machine epsilon):

- vanilla (MAP), MC dropout (p = 0.1 on the inputs of the 2nd and 3rd Linear, Table 1),
- EMP and ECMP (BN + output layer patched, K = 5), an explicit ensemble of 5.

Over 3 seeds (data split, init, draws), on the clean test set and on digits rotated by 15°,
30°, 45° and 60° (`benchmarks.ood.rotated_digits`): accuracy, NLL, ECE, MCE (20 bins, bins of
<= 5 samples dropped, appendix D.2), parameter overhead, and training CPU time relative to
vanilla (``time.process_time``, one thread, so that other load on the machine does not count).
Predictions use S = 100 draws; a second table compares S = 1, 20, 100 (Table 7).

A last table (`step_ratios`, also alone with ``--steps-only``) gives the **training step time**
of EMP and ECMP relative to a vanilla step of the same net (issue 13: ≤ 1.1× with
`PatchedNet.fit`, ≤ 1.5× through Pyro's ``SVI(Trace_ELBO)``, i.e. ``fit(method="svi")``): wall
time of a few epochs of `fit_map`, ``fit`` and ``fit(method="svi")`` on the same minibatches,
interleaved A B C A B C, best of the rounds, one thread. A last column times the tutorial's
``SVI(model, model.guide, pyro.optim.Adam(...), Trace_ELBO())`` over the per-tensor sites.

    python benchmarks/patches_digits.py [--epochs 200] [--seeds 3] [--quick] [--steps-only]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from pyro_subspace import datasets
from pyro_subspace.metrics import classification_scores as scores

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks.ood import rotated_digits
from benchmarks.protocols import train_method

METHODS = ("vanilla", "dropout", "emp", "ecmp", "ensemble")
ANGLES = (0, 15, 30, 45, 60)


def _fmt(values: list[float], pct: bool = False, digits: int = 3) -> str:
    scale = 100.0 if pct else 1.0
    m = statistics.fmean(values) * scale
    s = (statistics.stdev(values) if len(values) > 1 else 0.0) * scale
    return f"{m:.{digits}f}±{s:.{digits}f}"


def step_ratios(rounds: int = 7, epochs: int = 5, hidden: int = 128) -> list[str]:
    """Per-step wall time of vanilla, ``fit`` and ``fit(method="svi")``, interleaved, best of
    ``rounds``; returns the table's lines. Every call trains ``epochs`` epochs (12 minibatches
    of 128 each) from where the previous call of that method left off."""
    import pyro

    from benchmarks.protocols import bn_mlp
    from pyro_subspace import PatchedNet, fit_map, likelihoods

    data = datasets.digits(seed=0)
    x, y, n = data.x_train, data.y_train, data.n_train
    lik = likelihoods.Categorical()
    steps = epochs * (n // 128 + (n % 128 >= 2))
    lines = [
        f"Training step time, 64-{hidden}-BN-ReLU-{hidden}-BN-ReLU-10, batch 128, sigma=0, "
        f"best of {rounds} interleaved rounds of {epochs} epochs ({steps} steps), "
        f"{torch.get_num_threads()} thread",
        f"{'mode':<6}{'plain ms':>10}{'fused':>7}{'foreach':>9}{'vanilla':>9}{'fit ms':>8}"
        f"{'SVI ms':>8}{'floor ms':>10}{'van/plain':>11}{'van/foreach':>13}{'fit/plain':>11}"
        f"{'fit/fused':>11}{'SVI/floor':>11}"
        f"{'per-site SVI/van':>18}",
    ]
    medians = [
        f"median of the rounds' own ratios (a drift of the machine's speed between rounds "
        f"moves it less than the best-of ratios)",
        f"{'mode':<6}{'van/plain':>11}{'van/foreach':>13}{'fit/plain':>11}{'fit/fused':>11}"
        f"{'SVI/floor':>11}",
    ]
    for mode in ("emp", "ecmp"):
        pyro.clear_param_store()
        net = bn_mlp(data.n_features, 10, hidden=hidden, seed=0)
        patched = bn_mlp(data.n_features, 10, hidden=hidden, seed=0)
        model = PatchedNet(patched, lik, mode=mode, sigma=0.0, seed=0)
        train = dict(epochs=epochs, batch_size=128, seed=0)
        user = pyro.infer.SVI(
            model, model.guide, pyro.optim.Adam({"lr": 1e-3}), pyro.infer.Trace_ELBO()
        )

        def per_site() -> None:  # the tutorial's SVI over the per-tensor sites, same step count
            gen = torch.Generator().manual_seed(0)
            model.train()
            with pyro.validation_enabled(False):
                for _ in range(steps):
                    idx = torch.randint(0, n, (128,), generator=gen)
                    user.step(x[idx], y[idx], num_data=n)

        def plain(**adam) -> None:  # what a user writes (issue 23): randperm, gather, step
            gen = torch.Generator().manual_seed(0)
            opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1 / n, **adam)
            net.train()
            for _ in range(epochs):
                for idx in torch.randperm(n, generator=gen).split(128):
                    if len(idx) < 2:
                        continue
                    loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()

        floor_net = bn_mlp(data.n_features, 10, hidden=hidden, seed=0)

        def floor_model(xb, yb) -> None:  # Pyro's own floor: no latent sites
            pyro.module("floor_net", floor_net)
            with pyro.plate("data", n, subsample=torch.arange(len(xb))):
                lik.observe(floor_net(xb), yb)

        floor_svi = pyro.infer.SVI(
            floor_model, lambda xb, yb: None, pyro.optim.Adam({"lr": 1e-3}),
            pyro.infer.Trace_ELBO(),
        )  # fmt: skip

        def floor() -> None:
            gen = torch.Generator().manual_seed(0)
            floor_net.train()
            with pyro.validation_enabled(False):
                for _ in range(epochs):
                    for idx in torch.randperm(n, generator=gen).split(128):
                        if len(idx) >= 2:
                            floor_svi.step(x[idx], y[idx])

        runs = {
            "plain": plain,
            "fused": lambda: plain(fused=True),  # the Adam kernel fit uses
            "foreach": lambda: plain(foreach=True),  # fit_map's (bit for bit the default's)
            "floor": floor,
            "vanilla": lambda: fit_map(
                net, lik, x, y, lr=1e-3, weight_decay=1 / n, progress=False, **train
            ),
            "fit": lambda: model.fit(x, y, **train),
            "svi": lambda: model.fit(x, y, method="svi", **train),
            "site": per_site,
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():  # warm-up
            run()
        for _ in range(rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        ms = {k: 1000 * min(v) / steps for k, v in times.items()}

        def med(a: str, b: str) -> float:  # the median of the rounds' own ratios
            return statistics.median(p / q for p, q in zip(times[a], times[b]))

        medians.append(
            f"{mode:<6}{med('vanilla', 'plain'):>10.2f}x{med('vanilla', 'foreach'):>12.2f}x"
            f"{med('fit', 'plain'):>10.2f}x{med('fit', 'fused'):>10.2f}x"
            f"{med('svi', 'floor'):>10.2f}x"
        )
        lines.append(
            f"{mode:<6}{ms['plain']:>10.2f}{ms['fused']:>7.2f}{ms['foreach']:>9.2f}"
            f"{ms['vanilla']:>9.2f}{ms['fit']:>8.2f}{ms['svi']:>8.2f}{ms['floor']:>10.2f}"
            f"{ms['vanilla'] / ms['plain']:>10.2f}x{ms['vanilla'] / ms['foreach']:>12.2f}x"
            f"{ms['fit'] / ms['plain']:>10.2f}x"
            f"{ms['fit'] / ms['fused']:>10.2f}x{ms['svi'] / ms['floor']:>10.2f}x"
            f"{ms['site'] / ms['vanilla']:>17.2f}x"
        )
    lines += medians
    lines.append(
        "(plain: a plain PyTorch loop, randperm, index gather, cross_entropy, Adam with weight "
        "decay 1/N; fused: the same with Adam(fused=True), the kernel fit uses; foreach: with "
        "Adam(foreach=True), the kernel fit_map uses (on CPU the default's numbers bit for bit); "
        "vanilla: fit_map on the same; floor: Pyro's SVI over pyro.module(net) with "
        "the same likelihood and no latent sites; "
        "SVI: fit(method='svi'), SVI(fused_model, fused_guide, JointOptim(Adam), Trace_ELBO()); "
        "per-site SVI: the tutorial's SVI(model, model.guide, pyro.optim.Adam, Trace_ELBO()) "
        "over one site per tensor, no target)"
    )
    return lines


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--samples", type=int, default=100, help="S for the main tables")
    p.add_argument("--prior-precision", type=float, default=1.0)
    p.add_argument("--drop-prob", type=float, default=0.1)
    p.add_argument("--no-svi", action="store_true", help="skip the step-time table")
    p.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    p.add_argument("--steps-only", action="store_true", help="only the step-time table")
    p.add_argument("--step-rounds", type=int, default=7, help="rounds of the step-time table")
    p.add_argument(
        "--step-epochs",
        type=int,
        default=5,
        help="epochs of each timed call of the step-time table (12 minibatches each): a call's "
        "fixed costs (checks, the all-or-nothing snapshot, the target probe) weigh 1/(12 x this)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds, args.samples, args.step_rounds = 3, 1, 10, 2
    torch.set_num_threads(1)
    if args.steps_only:
        lines = step_ratios(args.step_rounds, epochs=2 if args.quick else args.step_epochs)
        print("\n".join(lines))
        return {"steps": lines}
    t_start = time.perf_counter()
    # results[method][angle] -> list of score dicts over seeds
    results = {m: {a: [] for a in ANGLES} for m in METHODS}
    s_table = {m: {s: [] for s in (1, 20, 100)} for m in ("dropout", "emp", "ecmp")}
    seconds = {m: [] for m in METHODS}
    predict_seconds = {m: [] for m in METHODS}
    overhead = {}
    warm = datasets.digits(seed=0)
    for name in METHODS:  # warm-up (lazy initialisation), not timed
        train_method(name, warm, epochs=1, seed=0)
    for seed in range(args.seeds):
        data = datasets.digits(seed=seed)
        inputs = {a: data.x_test if a == 0 else rotated_digits(data, a) for a in ANGLES}
        for name in METHODS:
            trained = train_method(
                name,
                data,
                epochs=args.epochs,
                prior_precision=args.prior_precision,
                drop_prob=args.drop_prob,
                seed=seed,
            )
            seconds[name].append(trained.seconds)
            overhead[name] = trained.overhead
            torch.manual_seed(1000 + seed)
            t0 = time.process_time()
            trained.probs(data.x_test, args.samples)
            predict_seconds[name].append(time.process_time() - t0)
            for a, x in inputs.items():
                results[name][a].append(scores(trained.probs(x, args.samples), data.y_test))
            if name in s_table:
                for s in s_table[name]:
                    torch.manual_seed(2000 + seed)
                    s_table[name][s].append(scores(trained.probs(data.x_test, s), data.y_test))
    step_lines = None
    if not args.no_svi:
        step_lines = step_ratios(args.step_rounds, epochs=2 if args.quick else 5)
    wide = {}  # per-step overhead is fixed, so the ratio falls as the compute per step grows
    data = datasets.digits(seed=0)
    for name in ("vanilla", "emp", "ecmp"):
        train_method(name, data, epochs=1, hidden=1024)  # warm-up
        wide[name] = train_method(name, data, epochs=max(1, args.epochs // 20), hidden=1024)

    n_seeds = args.seeds
    lines = [
        (
            f"digits, BN-MLP 64-128-BN-ReLU-128-BN-ReLU-10, Adam lr 1e-3, batch 128, "
            f"{args.epochs} epochs, tau={args.prior_precision}, K=5, sigma=0, dropout p={args.drop_prob}, "
            f"S={args.samples}; mean±std over {n_seeds} seed(s)"
        ),
        "",
        "Clean test set (cf. Table 3)",
        (
            f"{'method':<10}{'overhead':>10}{'acc %':>14}{'NLL':>14}{'ECE %':>14}{'MCE %':>14}"
            f"{'train time':>12}{'predict ms':>12}"
        ),
    ]
    t_van = statistics.fmean(seconds["vanilla"])
    for name in METHODS:
        r = results[name][0]
        lines.append(
            f"{name:<10}{overhead[name]:>9.2f}%"
            f"{_fmt([x['acc'] for x in r], True, 2):>14}{_fmt([x['nll'] for x in r]):>14}"
            f"{_fmt([x['ece'] for x in r], True, 2):>14}{_fmt([x['mce'] for x in r], True, 1):>14}"
            f"{statistics.fmean(seconds[name]) / t_van:>11.2f}x"
            f"{1000 * statistics.fmean(predict_seconds[name]):>12.1f}"
        )
    lines.append(
        f"(vanilla training: {t_van:.2f} CPU s per seed; predict: CPU ms for the "
        f"{len(data.y_test)} test digits, S={args.samples} draws vectorised with torch.func.vmap)"
    )
    for metric, pct, digits in (("acc", True, 1), ("nll", False, 3), ("ece", True, 2)):
        lines += ["", f"Rotated test digits: {metric.upper()}{' %' if pct else ''}"]
        lines.append(f"{'method':<10}" + "".join(f"{f'{a} deg':>14}" for a in ANGLES))
        for name in METHODS:
            row = "".join(
                f"{_fmt([x[metric] for x in results[name][a]], pct, digits):>14}" for a in ANGLES
            )
            lines.append(f"{name:<10}{row}")
    lines += ["", "Effect of the number of MC draws S, clean test set (cf. Table 7)"]
    lines.append(f"{'method':<10}{'S':>5}{'acc %':>14}{'NLL':>14}{'ECE %':>14}{'MCE %':>14}")
    for name, by_s in s_table.items():
        for s, r in by_s.items():
            lines.append(
                f"{name:<10}{s:>5}{_fmt([x['acc'] for x in r], True, 2):>14}"
                f"{_fmt([x['nll'] for x in r]):>14}{_fmt([x['ece'] for x in r], True, 2):>14}"
                f"{_fmt([x['mce'] for x in r], True, 1):>14}"
            )
    if step_lines is not None:
        lines += ["", *step_lines]
    t_w = wide["vanilla"].seconds
    lines.append(
        f"Training time relative to vanilla, 64-1024-BN-ReLU-1024-BN-ReLU-10, "
        f"{max(1, args.epochs // 20)} epochs: EMP {wide['emp'].seconds / t_w:.2f}x, "
        f"ECMP {wide['ecmp'].seconds / t_w:.2f}x (overhead {wide['emp'].overhead:.2f}%)"
    )
    lines.append(f"(wall time of this benchmark: {time.perf_counter() - t_start:.0f} s)")
    print("\n".join(lines))
    return {"results": results, "s_table": s_table, "seconds": seconds, "overhead": overhead}


if __name__ == "__main__":
    main()
