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
    """One row a method: test NLL (mixture and moment-matched), RMSE, 95% coverage."""
    header = (
        f"dataset={results['dataset']}  subspace={results['subspace']} (K={results['rank']})  "
        f"inference={results['inference']}  T={results['temperature']:.3g}  "
        f"sigma={results['sigma']:.3f}  train {results['train_seconds']:.1f}s  "
        f"inference {results['inference_seconds']:.1f}s"
    )
    lines = [header, f"{'method':<20}{'test NLL':>10}{'NLL (MM)':>10}{'RMSE':>8}{'cover95':>9}"]
    for name, r in results["rows"].items():
        lines.append(
            f"{name:<20}{r['nll']:>10.3f}{r['nll_moment_matched']:>10.3f}"
            f"{r['rmse']:>8.3f}{r['coverage95']:>9.3f}"
        )
    if "loo_elpd_per_point" in results:
        lines.append(
            f"PSIS-LOO of the training points (convert.tempered_loo): elpd/N = "
            f"{results['loo_elpd_per_point']:.3f}, largest Pareto k = "
            f"{results['loo_pareto_k_max']:.2f} (above 0.7: unreliable)"
        )
    lines.append(
        "test NLL: mean negative log predictive density of the test points under the posterior\n"
        "mixture (lower is better); NLL (MM): the same under one Gaussian with the mixture's mean\n"
        "and variance (moment-matched, Subspace Inference G.1); cover95: fraction of test points\n"
        "inside the central 95% predictive interval (nominal 0.95)."
    )
    return "\n".join(lines)


def classification_table(results: dict) -> str:
    """One row a method: accuracy, NLL, ECE, MCE, parameter overhead, training CPU seconds."""
    lines = [
        (
            f"dataset={results['dataset']}  inference={results['inference']}  "
            f"K={results['components']}  S={results['samples']}  epochs={results['epochs']}  "
            f"tau={results['prior_precision']:.3g}"
        ),
        f"{'method':<10}{'acc':>8}{'NLL':>8}{'ECE':>8}{'MCE':>8}{'overhead':>10}{'train s':>9}",
    ]
    for name, r in results["rows"].items():
        lines.append(
            f"{name:<10}{r['acc']:>8.4f}{r['nll']:>8.4f}{r['ece']:>8.4f}{r['mce']:>8.4f}"
            f"{r['overhead_percent']:>9.2f}%{r['train_seconds']:>9.2f}"
        )
    return "\n".join(lines)


def _figure(size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=size)


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
    that the uncertainty growing away from the data shows apart from the constant noise."""
    plt, fig, ax = _figure((8, 4.5))
    lo, hi = metrics.gaussian_interval(mean, std, 0.95)
    if data.grid is not None:
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
        ax.set_xlabel("x")
    else:
        ax.errorbar(data.y_test, mean, yerr=1.96 * std, fmt="o", ms=3, alpha=0.6, label="95% band")
        lim = [float(data.y_test.min()), float(data.y_test.max())]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set_xlabel("true y (standardised)")
    ax.set_ylabel("y")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    return _save(plt, fig, path)


def plot_reliability(
    path: Path, probs: dict[str, torch.Tensor], y: torch.Tensor, title: str
) -> Path:
    """Reliability diagrams (20 bins; only bins of more than 5 points, as ECE/MCE use them)."""
    plt, fig, ax = _figure((5, 5))
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    for name, p in probs.items():
        conf, acc, count = metrics.reliability_diagram_data(p, y, n_bins=20)
        keep = count > 5  # the bins ECE/MCE use (appendix D.2)
        ax.plot(conf[keep], acc[keep], "o-", label=name)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.legend(loc="upper left")
    return _save(plt, fig, path)
