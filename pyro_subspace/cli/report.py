"""The report every subcommand writes: ``results.json``, a PNG, and a table on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from .. import datasets, metrics


def publish(
    results: dict, out: Path, table: Callable[[dict], str], plot: Callable[[Path], Path]
) -> dict:
    """Write ``out/results.json``, draw ``plot(out)`` (its path goes to ``results["plot"]``),
    print ``table(results)``; returns ``results``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    results["plot"] = str(plot(out))
    print(table(results))
    for warning in results.get("warnings", []):
        print(f"warning: {warning}")
    print(f"wrote {out / 'results.json'} (this table and the settings) and {results['plot']}")
    return results


def regression_table(results: dict) -> str:
    """One row a method: test NLL (mixture and moment-matched), RMSE, 95% coverage; then the
    epistemic band's widths (1-D toy problems, ``fit``), PSIS-LOO (``fit`` with draws) and a
    legend of the columns."""
    header = (
        f"dataset={results['dataset']}  recipe={results.get('recipe', '-')}  "
        f"subspace={results['subspace']} (K={results['rank']})  "
        f"inference={results['inference']}  T={results['temperature']:.3g}  "
        f"sigma={results['sigma']:.3f}  train {results['train_seconds']:.1f}s  "
        f"inference {results['inference_seconds']:.1f}s"
    )
    mixing = results.get("convergence", {})
    head = f"{'method':<20}{'test NLL':>10}{'NLL (MM)':>10}{'RMSE':>8}{'cover95':>9}"
    if mixing:
        head += f"{'R-hat':>8}{'bulk ESS':>10}{'tail ESS':>10}"
    lines = [header, head]
    for name, r in results["rows"].items():
        line = (
            f"{name:<20}{r['nll']:>10.3f}{r['nll_moment_matched']:>10.3f}"
            f"{r['rmse']:>8.3f}{r['coverage95']:>9.3f}"
        )
        if name in mixing:
            c = mixing[name]
            line += f"{c['rhat']:>8.3f}{c['ess_bulk']:>10.0f}{c['ess_tail']:>10.0f}"
            line += "" if c["ok"] else "  NOT CONVERGED"
        lines.append(line)
    for name, c in mixing.items():
        divergences = f", {c['divergences']} divergent" if c["divergences"] else ""
        lines.append(
            f"{name}: {c['chains']} chains x {c['draws']} draws{divergences}; "
            + (
                "R-hat <= 1.01 and bulk/tail ESS >= 100 per chain: converged"
                if c["ok"]
                else "has NOT converged (see the warning): do not trust its row yet"
            )
        )
    if "band_width_ratio" in results:
        lines.append(
            f"epistemic 95% band (function only, no noise): mean width "
            f"{results['band_width_train']:.3f} at the training inputs, "
            f"{results['band_width_away']:.3f} over the gaps between and beyond the training "
            f"clusters: ratio {results['band_width_ratio']:.2f}"
        )
    if "loo_elpd_per_point" in results:
        lines.append(
            f"PSIS-LOO of the training points (convert.tempered_loo): elpd/N = "
            f"{results['loo_elpd_per_point']:.3f}, largest Pareto k = "
            f"{results['loo_pareto_k_max']:.2f} (above 0.7: unreliable)"
        )
    if "sigma_learned_with_map" in results:
        lines.append(
            f"sigma: the noise scale every row uses, the maximum-likelihood value at the SWA "
            f"solution (learned with the MAP: {results['sigma_learned_with_map']:.3f})"
        )
    if "sigma_in_training" in results:
        lines.append(
            f"sigma: the noise scale every row uses, the maximum-likelihood value at the SWA "
            f"solution (training held it at {results['sigma_in_training']:g})"
        )
    lines.append(
        "test NLL: mean negative log predictive density of the test points under the posterior\n"
        "mixture (lower is better); NLL (MM): the same under one Gaussian with the mixture's mean\n"
        "and variance (moment-matched, Subspace Inference G.1); RMSE: root mean squared error of\n"
        "the predictive mean; cover95: fraction of test points inside the central 95%\n"
        "predictive interval (nominal 0.95)."
        + (
            "\nR-hat: rank-normalised split R-hat, the largest over the coordinates t (gess: also\n"
            "across its two independent populations); bulk/tail ESS: the smallest effective sample\n"
            "sizes (Vehtari et al. 2021, ArviZ's estimators)."
            if mixing
            else ""
        )
    )
    return "\n".join(lines)


def classification_table(results: dict) -> str:
    """One row a method: accuracy, NLL, ECE, MCE, parameter overhead, training CPU seconds; then
    a legend of the columns."""
    lines = [
        (
            f"dataset={results['dataset']}  inference={results['inference']}  "
            f"K={results['components']}  S={results['samples']}  epochs={results['epochs']}  "
            f"tau={results['prior_precision']:.3g}"
        ),
        f"{'method':<10}{'acc':>8}{'NLL':>8}{'ECE':>8}{'MCE':>8}{'overhead':>10}{'train s':>9}",
    ]
    for name, r in results["rows"].items():
        ece, mce = ("n/a" if r[k] is None else f"{r[k]:.4f}" for k in ("ece", "mce"))
        lines.append(
            f"{name:<10}{r['acc']:>8.4f}{r['nll']:>8.4f}{ece:>8}{mce:>8}"
            f"{r['overhead_percent']:>9.2f}%{r['train_seconds']:>9.2f}"
        )
    lines.append(
        "acc: test accuracy of the predictive's most probable class; NLL: mean negative log\n"
        "predictive probability of the true class (lower is better); ECE, MCE: expected and\n"
        "maximum calibration error, |accuracy - confidence| over 20 equal-width confidence bins\n"
        "(bins of more than 5 points, Ensemble Model Patching D.2); overhead: parameters the\n"
        "method adds to the vanilla network, in % of its parameter count (section 3.3; the\n"
        "ensemble's extra networks, nothing for dropout); train s: training CPU seconds."
    )
    return "\n".join(lines)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_predictive(
    path: Path,
    data: datasets.Dataset,
    mean: torch.Tensor,
    std: torch.Tensor,
    title: str,
    map_mean: torch.Tensor | None = None,
    epistemic_std: torch.Tensor | None = None,
) -> Path:
    """A regression predictive: the mean and 95% band over ``data.grid`` for 1-D problems
    (``mean``, ``std`` of shape ``(G,)``), else predicted against true test targets (``(M,)``).
    ``map_mean (G,)``, if given, is drawn as a dashed line; ``epistemic_std (G,)`` (the spread
    of the network's output over the posterior, without the noise) as a darker inner band, so
    that the uncertainty growing away from the data shows apart from the constant noise, and
    its width against ``x`` in a panel below, the training inputs marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = metrics.gaussian_interval(mean, std, 0.95)
    if data.grid is None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.errorbar(data.y_test, mean, yerr=1.96 * std, fmt="o", ms=3, alpha=0.6,
                    label="predictive mean and 95% band")  # fmt: skip
        lim = [float(data.y_test.min()), float(data.y_test.max())]
        ax.plot(lim, lim, "k--", lw=1, label="predicted = true")
        ax.set_xlabel("true y (standardised)")
        ax.set_ylabel("predicted y (standardised)")
        ax.set_title(title)
        ax.legend(loc="best", fontsize=8)
        return _save(plt, fig, path)
    if epistemic_std is None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    else:
        fig, (ax, below) = plt.subplots(
            2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
        )
    ax.fill_between(
        data.grid_x, lo, hi, alpha=0.25, color="C0", label="95% predictive (epistemic + noise)"
    )
    if epistemic_std is not None:
        elo, ehi = metrics.gaussian_interval(mean, epistemic_std, 0.95)
        ax.fill_between(
            data.grid_x, elo, ehi, alpha=0.5, color="C1", label="95% epistemic (function)"
        )
    ax.plot(data.grid_x, mean, label="predictive mean")
    if map_mean is not None:
        ax.plot(data.grid_x, map_mean, "--", color="k", lw=1, label="MAP (SWA) mean")
    ax.scatter(data.x_train_raw, data.y_train, s=6, color="C3", label="training data")
    ax.set_ylabel("y")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    if epistemic_std is None:
        ax.set_xlabel("x")
        return _save(plt, fig, path)
    below.plot(data.grid_x, ehi - elo, color="C1", label="width of the 95% epistemic band")
    below.plot(data.x_train_raw, torch.zeros_like(data.x_train_raw), "|", color="C3", ms=8,
               label="training inputs")  # fmt: skip
    below.set_ylim(bottom=0)
    below.set_xlabel("x")
    below.set_ylabel("band width")
    below.legend(loc="upper center", fontsize=8)
    return _save(plt, fig, path)


def plot_reliability(
    path: Path, probs: dict[str, torch.Tensor], y: torch.Tensor, title: str, n_bins: int = 20
) -> Path:
    """Reliability diagrams over the ``n_bins`` equal-width confidence bins that ECE/MCE use
    (`metrics.reliability_diagram_data`), every non-empty bin drawn: filled where it has more
    than 5 points (the bins ECE/MCE count, appendix D.2), hollow otherwise, its area growing
    with its count; below, the number of test points per bin. An accurate classifier puts
    almost every point in the top bin, so keeping only the counted bins would leave two or
    three points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hist) = plt.subplots(
        2, 1, figsize=(5.5, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.2]}
    )
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    edges = torch.linspace(0, 1, n_bins + 1)
    width = 1.0 / n_bins / (len(probs) + 1)
    for i, (name, p) in enumerate(probs.items()):
        data = metrics.reliability_diagram_data(p, y, n_bins)
        conf, acc, count = (v.numpy(force=True) for v in data)
        seen, counted = count > 0, count > 5
        ax.plot(conf[seen], acc[seen], "-", color=f"C{i}", lw=1, alpha=0.4)
        size = 12 + 4 * count**0.5
        ax.scatter(conf[counted], acc[counted], s=size[counted], color=f"C{i}", zorder=3,
                   label=f"{name} ({int(counted.sum())} bins of > 5 points)")  # fmt: skip
        few = seen & ~counted
        ax.scatter(conf[few], acc[few], s=size[few], facecolors="none", edgecolors=f"C{i}",
                   zorder=3, label=f"{name} ({int(few.sum())} bins of 1-5 points)")  # fmt: skip
        hist.bar(edges[:-1].numpy() + (i + 0.5) * width, count, width=width, align="edge",
                 color=f"C{i}", label=name)  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("accuracy in the bin")
    ax.set_title(f"{title}\n({n_bins} equal-width confidence bins, as ECE/MCE)", fontsize=10)
    ax.legend(loc="upper left", fontsize=7)
    hist.set_yscale("log")
    hist.set_xlabel("confidence (largest predicted class probability)")
    hist.set_ylabel("test points")
    hist.legend(loc="upper left", fontsize=7)
    return _save(plt, fig, path)
