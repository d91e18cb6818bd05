"""The ``pyro-subspace`` command.

``pyro-subspace`` (no arguments) runs the main job: train a MAP/SWA network on the Subspace
Inference toy regression, build a PCA subspace of the SGD trajectory, sample it with elliptical
slice sampling (``--inference nuts|hmc|vi`` for Pyro's samplers or SVI), print a
table (test NLL, RMSE, 95% coverage: MAP vs subspace posterior) and write a PNG of the predictive
mean and 95% band. ``pyro-subspace tutorial 01`` runs a tutorial script; ``pyro-subspace grid``
the Subspace Inference grid of subspaces × inference methods (tutorial 06).
"""

from __future__ import annotations

import argparse
import itertools
import json
import runpy
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import HMC, MCMC, NUTS, SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn

from . import datasets, likelihoods, metrics, subspaces
from .infer import AutoSubspaceLaplace, EllipticalSliceSampler, linearized_predictive
from .nn import SubspaceNet
from .train import fit_map

SUBSPACES = ("pca", "random", "subnetwork", "ggn")
INFERENCE = ("ess", "nuts", "hmc", "vi", "laplace", "mola", "deep_ensemble", "swag")
INFERENCE += ("emp", "ecmp", "dropout", "ensemble")  # Ensemble Model Patching, cli_patches.py
DATASETS = ("toy", "in_between", "diabetes", "csv", "digits")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyro-subspace",
        description="Subspace inference for a neural network: MAP/SWA, a subspace, Bayesian "
        "inference in it, and a comparison table. Subcommands: 'tutorial NAME' runs "
        "tutorials/NAME; 'grid' runs the paper's subspace x inference grid (tutorial 06).",
    )
    p.add_argument("--dataset", choices=DATASETS, default="toy")
    p.add_argument("--csv", type=Path, help="CSV file for --dataset csv")
    p.add_argument("--target", help="target column of the CSV")
    p.add_argument("--subspace", choices=SUBSPACES, default="pca")
    p.add_argument("--rank", default="10", help="subspace dimension K, or 'mle' (PCA only)")
    p.add_argument(
        "--inference",
        choices=INFERENCE,
        default="ess",
        help="ess: elliptical slice sampling, the paper's recommendation (default); "
        "laplace: the linearised Laplace guide (with --subspace subnetwork or ggn: "
        "Subnetwork Inference's subnetwork / a low-rank Laplace); mola, deep_ensemble, swag: "
        "mixtures of last-layer Laplace approximations over --members networks, the deep "
        "ensemble itself, or SWAG (see pyro_subspace.cli_mixture); emp, ecmp, dropout, "
        "ensemble: Ensemble Model Patching on --dataset digits (see pyro_subspace.cli_patches)",
    )
    p.add_argument(
        "--members",
        type=int,
        default=5,
        help="mola / deep_ensemble: networks K; emp / ecmp / ensemble: components K",
    )
    p.add_argument(
        "--laplace-prior",
        choices=("marglik", "fixed"),
        default="marglik",
        help="laplace: tune the prior precision by the Laplace evidence, or keep 1/prior-scale^2",
    )
    p.add_argument(
        "--temperature",
        default="auto",
        help="likelihood temperature T, or 'auto' (T = N/K, paper 2.4)",
    )
    p.add_argument("--prior-scale", type=float, default=1.0, help="prior std of the coordinates t")
    p.add_argument("--epochs", type=int, default=2000, help="MAP epochs (Adam)")
    p.add_argument("--swa-epochs", type=int, default=200, help="SWA epochs (SGD, constant lr)")
    p.add_argument("--swa-lr", type=float, default=3e-4, help="constant SGD learning rate of SWA")
    p.add_argument("--samples", type=int, default=300, help="posterior draws (MCMC) or VI steps/4")
    p.add_argument("--warmup", type=int, default=200, help="MCMC warm-up steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out"), help="directory for the PNG and JSON")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p


def _network(data: datasets.Dataset, heteroscedastic: bool) -> nn.Module:
    out = 2 if heteroscedastic else 1
    if data.name == "toy":  # the paper's 200-50-50-50 architecture (section 3.1)
        sizes = [data.n_features, 200, 50, 50, 50]
    else:  # the paper's small-UCI net: one hidden layer of 50 units (appendix G.1.2)
        sizes = [data.n_features, 50]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], out))


def _load(args: argparse.Namespace) -> datasets.Dataset:
    if args.dataset == "csv":
        if args.csv is None or args.target is None:
            raise SystemExit("--dataset csv needs --csv PATH and --target COLUMN")
        return datasets.from_csv(args.csv, args.target, seed=args.seed)
    return datasets.load(args.dataset, seed=args.seed)


def _parse_rank(rank: str, subspace: str) -> int | str:
    if rank == "mle":
        if subspace != "pca":
            raise SystemExit("--rank mle needs --subspace pca")
        return rank
    try:
        return int(rank)
    except ValueError:
        raise SystemExit(f"--rank: expected an int or 'mle', got {rank!r}") from None


def _parse_temperature(value: str) -> float | str:
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"--temperature: expected a number or 'auto', got {value!r}") from None


def posterior_draws(model: SubspaceNet, args: argparse.Namespace, x, y) -> torch.Tensor:
    """Draws of ``t`` (S, K) by the chosen inference method."""
    if args.inference in ("ess", "nuts", "hmc"):
        kernels = {
            "ess": EllipticalSliceSampler,
            "nuts": NUTS,
            "hmc": lambda m: HMC(m, num_steps=10),
        }
        kernel = kernels[args.inference](model)
        mcmc = MCMC(
            kernel,
            num_samples=args.samples,
            warmup_steps=args.warmup,
            disable_progbar=args.no_progress,
        )
        mcmc.run(x, y)
        return mcmc.get_samples()["t"]
    guide = AutoNormal(model)
    steps = 4 * args.samples
    svi = SVI(
        model,
        guide,
        pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.1 ** (1 / steps)}),
        Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1),
    )
    for _ in range(steps):
        svi.step(x, y)
    draws = Predictive(model, guide=guide, num_samples=args.samples, return_sites=["t"])(x, y)["t"]
    return draws.reshape(-1, model.rank)


def _subspace(
    kind: str, net: nn.Module, lik, data: datasets.Dataset, rank: int, args
) -> subspaces.Subspace:
    """A random, subnetwork (diagonal-Laplace selection) or GGN-eigen subspace at ``net``."""
    if kind == "random":
        return subspaces.random(net, rank, seed=args.seed)
    if kind == "subnetwork":
        return subspaces.subnetwork(
            net,
            rank,
            strategy="diag_laplace",
            likelihood=lik,
            x=data.x_train,
            prior_precision=1 / args.prior_scale**2,
        )
    return subspaces.ggn_eigen(net, lik, data.x_train, rank, seed=args.seed)


def _laplace(model: SubspaceNet, args, data: datasets.Dataset):
    """Fit the Laplace guide; returns draws of ``t`` and the GLM predictive on the test set."""
    guide = AutoSubspaceLaplace(model).fit(data.x_train, data.y_train)
    if args.laplace_prior == "marglik":
        guide.optimize_prior_precision("marglik")
    draws = guide.get_posterior().sample((args.samples,)).to(data.x_train.dtype)
    mean, var = linearized_predictive(guide, data.x_test)
    return draws, (mean[:, 0].float()[None], var[:, 0].float()[None])  # one mixture component


def run(args: argparse.Namespace) -> dict:
    """The default job; returns the results table as a dict and writes ``out/``."""
    if args.inference in ("mola", "deep_ensemble", "swag"):
        from .cli_mixture import run_mixture

        return run_mixture(args)
    if args.inference in ("emp", "ecmp", "dropout", "ensemble"):
        from .cli_patches import run_patches

        return run_patches(args)
    torch.manual_seed(args.seed)
    pyro.set_rng_seed(args.seed)
    pyro.clear_param_store()
    rank = _parse_rank(args.rank, args.subspace)
    temperature = _parse_temperature(args.temperature)
    if args.subspace == "pca" and rank != "mle" and rank > min(args.swa_epochs, 20):
        raise SystemExit(
            f"--rank {rank}: a PCA subspace needs at least as many SWA snapshots; "
            f"--swa-epochs {args.swa_epochs} keeps {min(args.swa_epochs, 20)}"
        )
    data = _load(args)
    if data.task != "regression":
        raise SystemExit(f"--dataset {args.dataset}: the default run is for regression data")
    t0 = time.perf_counter()
    net = _network(data, heteroscedastic=False)
    lik = likelihoods.Gaussian()  # noise scale learned with the MAP (type-II ML), then fixed
    collector = subspaces.SWACollector(net, max_snapshots=20)
    progress = not args.no_progress
    fit_map(
        net,
        lik,
        data.x_train,
        data.y_train,
        epochs=args.epochs,
        lr=1e-3,
        weight_decay=1e-4,
        seed=args.seed,
        progress=progress,
    )  # MAP: full-batch Adam
    fit_map(
        net,
        lik,
        data.x_train,
        data.y_train,
        epochs=0,
        collector=collector,
        swa_epochs=args.swa_epochs,
        swa_lr=args.swa_lr,
        batch_size=50,
        weight_decay=1e-4,
        seed=args.seed,
        progress=progress,
    )  # SWA: minibatch SGD at a constant rate
    t_train = time.perf_counter() - t0
    if args.subspace == "pca":
        sub = subspaces.pca(collector, rank, seed=args.seed)
    else:
        nn.utils.vector_to_parameters(collector.mean, net.parameters())
        sub = _subspace(args.subspace, net, lik, data, rank, args)
    model = SubspaceNet(net, sub, lik, prior_scale=args.prior_scale, temperature=temperature)
    t1 = time.perf_counter()
    glm = None
    if args.inference == "laplace":
        t, glm = _laplace(model, args, data)
    else:
        t = posterior_draws(model, args, data.x_train, data.y_train)
    t_infer = time.perf_counter() - t1

    sigma2 = lik.sigma.detach() ** 2
    with torch.no_grad():
        map_out = model.outputs(torch.zeros(1, sub.rank), data.x_test)[..., 0]  # ŵ: the SWA mean
        post_out = model.outputs(t, data.x_test)[..., 0]
    rows = {
        "MAP (SWA)": metrics.regression_scores(map_out, sigma2.expand_as(map_out), data.y_test),
        f"{args.subspace.upper()}+{args.inference.upper()}": metrics.regression_scores(
            post_out, sigma2.expand_as(post_out), data.y_test
        ),
    }
    if glm is not None:
        rows["LAPLACE (GLM)"] = metrics.regression_scores(glm[0], glm[1], data.y_test)
    results = {
        "dataset": data.name,
        "subspace": args.subspace,
        "rank": sub.rank,
        "inference": args.inference,
        "temperature": model.temperature_for(data.n_train),
        "sigma": float(lik.sigma.detach()),
        "train_seconds": t_train,
        "inference_seconds": t_infer,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    results["plot"] = str(_plot(args, data, model, t, float(sigma2)))
    print(_table(results))
    return results


def _table(results: dict) -> str:
    header = (
        f"dataset={results['dataset']}  subspace={results['subspace']} (K={results['rank']})  "
        f"inference={results['inference']}  T={results['temperature']:.3g}  "
        f"sigma={results['sigma']:.3f}  train {results['train_seconds']:.1f}s  "
        f"inference {results['inference_seconds']:.1f}s"
    )
    lines = [
        header,
        f"{'method':<20}{'test NLL':>10}{'NLL (MM)':>10}{'RMSE':>8}{'cover95':>9}",
    ]
    for name, r in results["rows"].items():
        lines.append(
            f"{name:<20}{r['nll']:>10.3f}{r['nll_moment_matched']:>10.3f}"
            f"{r['rmse']:>8.3f}{r['coverage95']:>9.3f}"
        )
    return "\n".join(lines)


def _plot(args, data: datasets.Dataset, model: SubspaceNet, t: torch.Tensor, sigma2: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if data.grid is not None:
        with torch.no_grad():
            f = model.outputs(t, data.grid)[..., 0]
            f_map = model.outputs(torch.zeros(1, model.rank), data.grid)[0, :, 0]
        mu, var = metrics.moment_match(f, torch.full_like(f, sigma2))
        lo, hi = metrics.gaussian_interval(mu, var.sqrt(), 0.95)
        gx = data.grid_x
        ax.fill_between(gx, lo, hi, alpha=0.3, label="posterior 95% predictive band")
        ax.plot(gx, mu, label="posterior predictive mean")
        ax.plot(gx, f_map, "--", color="k", lw=1, label="MAP (SWA) mean")
        ax.scatter(data.x_train_raw, data.y_train, s=6, color="C3", label="training data")
        ax.set_xlabel("x")
    else:
        with torch.no_grad():
            f = model.outputs(t, data.x_test)[..., 0]
        mu, var = metrics.moment_match(f, torch.full_like(f, sigma2))
        ax.errorbar(
            data.y_test, mu, yerr=1.96 * var.sqrt(), fmt="o", ms=3, alpha=0.6, label="95% band"
        )
        lim = [float(data.y_test.min()), float(data.y_test.max())]
        ax.plot(lim, lim, "k--", lw=1)
        ax.set_xlabel("true y (standardised)")
    ax.set_ylabel("y")
    ax.set_title(f"{args.subspace.upper()} subspace (K={model.rank}) + {args.inference.upper()}")
    ax.legend(loc="best", fontsize=8)
    path = args.out / f"{data.name}_{args.subspace}_{args.inference}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_tutorial(name: str) -> None:
    """Run ``tutorials/<name>*.py`` from a source checkout (e.g. ``pyro-subspace tutorial 01``)."""
    folder = Path(__file__).resolve().parents[1] / "tutorials"
    matches = sorted(folder.glob(f"{name}*.py")) if folder.is_dir() else []
    if not matches:
        available = sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []
        raise SystemExit(f"tutorial {name!r} not found in {folder}; available: {available}")
    runpy.run_path(str(matches[0]), run_name="__main__")


def execute(argv: list[str] | None = None) -> dict | None:
    """Run the command with ``argv``; returns the default run's results (``None`` for tutorials)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "tutorial":
        if len(argv) != 2:
            raise SystemExit("usage: pyro-subspace tutorial NAME   (e.g. 01)")
        run_tutorial(argv[1])
        return None
    if argv and argv[0] == "grid":  # the paper's subspace × inference grid (Figure 3)
        if len(argv) != 1:
            raise SystemExit("usage: pyro-subspace grid   (writes out/06_subspace_grid.png)")
        run_tutorial("06")
        return None
    return run(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: exit status 0 on success."""
    execute(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
