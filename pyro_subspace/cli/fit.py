"""``pyro-subspace fit`` (also plain ``pyro-subspace``): subspace inference on regression data.

Train a MAP network (full-batch Adam), run SWA (minibatch SGD at a constant rate) collecting the
trajectory, build a subspace at the SWA mean (PCA of the trajectory, random, a diagonal-Laplace
subnetwork or GGN eigenvectors), infer its coordinates ``t`` (elliptical slice sampling, Pyro's
NUTS / HMC / SVI, or the linearised Laplace guide), and compare with the MAP: test NLL, RMSE and
95% coverage, plus a PNG of the predictive (Izmailov et al., Subspace Inference, 2019).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyro
import torch
from pyro.infer import HMC, MCMC, NUTS, SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from torch import nn
from tqdm.auto import tqdm

from .. import convert, datasets, likelihoods, metrics, subspaces
from ..infer import (
    AutoSubspaceLaplace,
    EllipticalSliceSampler,
    GeneralizedEllipticalSliceSampler,
    linearized_predictive,
)
from ..nn import SubspaceNet
from ..train import fit_map
from . import defaults, options, report

SUBSPACES = ("pca", "random", "subnetwork", "ggn")
INFERENCE = ("ess", "gess", "nuts", "hmc", "vi", "laplace")
MCMC_KERNELS = {
    "ess": EllipticalSliceSampler,
    # the generalised kernel: slices over the subspace Laplace posterior (fast at T = 1)
    "gess": lambda model: GeneralizedEllipticalSliceSampler(model, reference="laplace"),
    "nuts": NUTS,
    "hmc": lambda model: HMC(model, num_steps=10),
}


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    summary = "MAP/SWA -> subspace -> ESS/NUTS/HMC/VI/Laplace on regression data (the default)"
    p = options.command_parser(commands, "fit", summary, __doc__, (options.REGRESSION_DATA, "toy"))
    g = p.add_argument_group("subspace and inference")
    g.add_argument("--subspace", choices=SUBSPACES, default="pca", help="the subspace kind")
    g.add_argument(
        "--rank",
        type=options.number_or("mle", options.int_at_least(1), "an integer >= 1"),
        default="10",
        help="subspace dimension K; 'mle': Minka's choice (PCA only)",
    )
    g.add_argument(
        "--inference",
        choices=INFERENCE,
        default="ess",
        help="ess: elliptical slice sampling (the paper's recommendation); nuts, hmc: Pyro's "
        "samplers; vi: SVI with AutoNormal; laplace: the linearised Laplace guide. Mixtures: "
        "'pyro-subspace mixture'; Ensemble Model Patching: 'pyro-subspace patch'",
    )
    g.add_argument(
        "--temperature",
        type=options.number_or("auto", options.positive_float, "a number > 0"),
        default="auto",
        help="likelihood temperature T; 'auto': T = N/K (paper 2.4)",
    )
    g.add_argument(
        "--prior-scale",
        type=options.positive_float,
        default=1.0,
        help="prior std s of the coordinates t (the subnetwork selection's weight prior "
        "N(0, s^2) too)",
    )
    g.add_argument("--samples", type=options.int_at_least(1), default=300, help="posterior draws")
    g.add_argument("--warmup", type=options.int_at_least(0), default=200, help="MCMC warm-up")
    g.add_argument("--vi-steps", type=options.int_at_least(1), default=1200, help="SVI steps")
    options.add_laplace_prior(g, "laplace", "1/prior-scale^2")
    t = options.add_regression_training(p, "of the MAP and SWA phases")
    options.add_swa_options(t, "SWA (trajectory)")
    t.add_argument(
        "--swa-batch-size", type=options.int_at_least(1), default=50, help="SWA minibatch size"
    )
    options.add_run_options(p)
    p.set_defaults(run=run, check=check)
    return p


def check(args: argparse.Namespace, given: set[str]) -> None:
    """Reject option combinations that do not make sense (`options.UsageError`)."""
    options.check_data(args, given)
    if args.rank == "mle" and args.subspace != "pca":
        raise options.UsageError("--rank mle needs --subspace pca")
    snapshots = min(args.swa_epochs, args.max_snapshots)
    if args.subspace == "pca" and args.rank != "mle" and args.rank > snapshots:
        raise options.UsageError(
            f"--rank {args.rank}: a PCA subspace needs at least as many SWA snapshots; "
            f"--swa-epochs {args.swa_epochs} --max-snapshots {args.max_snapshots} keep {snapshots}"
        )
    options.reject_unused(
        given,
        {
            "--warmup": (args.inference in MCMC_KERNELS, "to --inference ess, gess, nuts or hmc"),
            "--vi-steps": (args.inference == "vi", "to --inference vi"),
            "--laplace-prior": (args.inference == "laplace", "to --inference laplace"),
            "--max-snapshots": (args.subspace == "pca", "to --subspace pca"),
        },
    )


def posterior_draws(model: SubspaceNet, args: argparse.Namespace, x, y) -> torch.Tensor:
    """Draws of ``t`` ``(S, K)`` by MCMC (``--inference ess|gess|nuts|hmc``) or SVI (``vi``)."""
    if args.inference in MCMC_KERNELS:
        kernel = MCMC_KERNELS[args.inference](model)
        mcmc = MCMC(
            kernel,
            num_samples=args.samples,
            warmup_steps=args.warmup,
            disable_progbar=args.no_progress,
        )
        mcmc.run(x, y)
        return mcmc.get_samples()["t"]
    guide = AutoNormal(model)
    steps = args.vi_steps
    svi = SVI(
        model,
        guide,
        pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.1 ** (1 / steps)}),
        Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1),
    )
    bar = tqdm(range(steps), desc="SVI", disable=args.no_progress, leave=False, mininterval=0.5)
    for step in bar:
        loss = svi.step(x, y)
        if step % 50 == 0:
            bar.set_postfix(elbo_loss=f"{loss:.1f}")
    draws = Predictive(model, guide=guide, num_samples=args.samples, return_sites=["t"])(x, y)["t"]
    return draws.reshape(-1, model.rank)


def _subspace(
    args: argparse.Namespace, net: nn.Module, collector, lik, data: datasets.Dataset
) -> subspaces.Subspace:
    """The ``--subspace``: PCA of the SWA trajectory, or random / subnetwork (diagonal-Laplace
    selection) / GGN-eigen at the SWA mean."""
    if args.subspace == "pca":
        return subspaces.pca(collector, args.rank, seed=args.seed)
    nn.utils.vector_to_parameters(collector.mean, net.parameters())
    if args.subspace == "random":
        return subspaces.random(net, args.rank, seed=args.seed)
    if args.subspace == "subnetwork":
        return subspaces.subnetwork(
            net,
            args.rank,
            strategy="diag_laplace",
            likelihood=lik,
            x=data.x_train,
            prior_precision=1 / args.prior_scale**2,
        )
    return subspaces.ggn_eigen(net, lik, data.x_train, args.rank, seed=args.seed)


def _laplace(model: SubspaceNet, args: argparse.Namespace, data: datasets.Dataset):
    """Fit the Laplace guide; returns draws of ``t`` and the GLM predictive on the test set."""
    guide = AutoSubspaceLaplace(model).fit(data.x_train, data.y_train)
    if args.laplace_prior == "marglik":
        guide.optimize_prior_precision("marglik")
    draws = guide.get_posterior().sample((args.samples,)).to(data.x_train.dtype)
    pred = linearized_predictive(guide, data.x_test)
    mean, var = pred.mean, pred.variance
    return draws, (mean[:, 0].float()[None], var[:, 0].float()[None])  # one mixture component


def _train(args: argparse.Namespace, data: datasets.Dataset):
    """MAP (full-batch Adam), then SWA collecting the trajectory; returns net, lik, collector."""

    def make_net():
        return options.mlp(data.n_features, options.hidden_widths(args), 1)

    args.epochs = defaults.resolve_epochs(args, data, make_net)
    net = make_net()
    lik = likelihoods.Gaussian()  # noise scale learned with the MAP (type-II ML), then fixed
    collector = subspaces.SWACollector(net, max_snapshots=args.max_snapshots)
    common = dict(weight_decay=args.weight_decay, seed=args.seed, progress=not args.no_progress)
    fit_map(net, lik, data.x_train, data.y_train, epochs=args.epochs, lr=args.lr, **common)
    fit_map(
        net,
        lik,
        data.x_train,
        data.y_train,
        epochs=0,
        collector=collector,
        swa_epochs=args.swa_epochs,
        swa_lr=args.swa_lr,
        batch_size=args.swa_batch_size,
        **common,
    )
    return net, lik, collector


def run(args: argparse.Namespace) -> dict:
    """The job; returns the results table as a dict and writes ``--out``."""
    options.seed_everything(args.seed)
    data = options.load_data(args, "regression")
    t0 = time.perf_counter()
    net, lik, collector = _train(args, data)
    t_train = time.perf_counter() - t0
    sub = _subspace(args, net, collector, lik, data)
    model = SubspaceNet(net, sub, lik, prior_scale=args.prior_scale, temperature=args.temperature)
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
    with torch.no_grad():
        train_out = model.outputs(torch.zeros(1, sub.rank), data.x_train)[..., 0]
    train_nll = metrics.regression_scores(train_out, sigma2.expand_as(train_out), data.y_train)
    warnings = defaults.overfit_warnings(train_nll["nll"], rows)
    loo = {}
    if glm is None:  # draws of t: PSIS-LOO of the training points under the tempered posterior
        idata = convert.to_inference_data(
            samples={"t": t}, model=model, args=(data.x_train, data.y_train), seed=args.seed
        )
        elpd = convert.tempered_loo(idata, reff=1.0)
        loo = {
            "loo_elpd_per_point": float(elpd["elpd_loo"]) / data.n_train,
            "loo_pareto_k_max": float(np.max(np.asarray(elpd.pareto_k))),
        }
    results = {
        "dataset": data.name,
        "subspace": args.subspace,
        "rank": sub.rank,
        "inference": args.inference,
        "temperature": model.temperature_for(data.n_train),
        "sigma": float(lik.sigma.detach()),
        "train_seconds": t_train,
        "inference_seconds": t_infer,
        "epochs": args.epochs,
        "rows": rows,
        **loo,
        "warnings": warnings,
    }

    def plot(out):
        x = data.grid if data.grid is not None else data.x_test
        with torch.no_grad():
            f = model.outputs(t, x)[..., 0]
            f_map = model.outputs(torch.zeros(1, model.rank), x)[0, :, 0]
        mean, var = metrics.moment_match(f, torch.full_like(f, float(sigma2)))
        title = f"{args.subspace.upper()} subspace (K={model.rank}) + {args.inference.upper()}"
        path = out / f"{data.name}_{args.subspace}_{args.inference}.png"
        map_mean = f_map if data.grid is not None else None
        epistemic = f.std(0, unbiased=False)  # spread of the function over the draws
        return report.plot_predictive(path, data, mean, var.sqrt(), title, map_mean, epistemic)

    return report.publish(results, args.out, report.regression_table, plot)
