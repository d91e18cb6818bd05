"""Elliptical slice sampling vs Pyro's NUTS on the same SubspaceNet, and the sampler's overhead.

For the toy regression (Subspace Inference 3.1) and diabetes, a MAP/SWA net and PCA subspaces
of rank 2, 5 and 10, at the paper's temperature T = N/K (``--temperature auto``, the default)
or another (e.g. 1: a posterior much narrower than the prior, ESS's hard case); ESS and NUTS
draw the same number of samples in 2 chains. Per run:
wall time, bulk effective sample size (ArviZ, minimum over coordinates), effective samples per
second, max R-hat, likelihood evaluations per draw (NUTS: model evaluations with gradient) and
the ratio ESS/NUTS of effective samples per second. Overhead of the sampler itself:
time per draw / (evaluations per draw × time of one full-data likelihood evaluation), for the
kernel's ``sample`` alone and, in brackets, for a step of Pyro's ``MCMC`` driver.
Finally the peak memory of one likelihood evaluation on N = 200,000 points, chunked vs not,
each measured in a fresh process (``ru_maxrss`` increase).

``--gess`` prints instead the generalised elliptical slice tables (issue 13): at T = N/K and
T = 1, for toy and diabetes and K = 2, 5, 10: NUTS, plain ESS, and
`EllipticalSliceSampler(reference=...)` (the generalised kernel: the subspace Laplace fit as a fixed reference, the kernel's
default for it) with its chains run one at a time and in one batched pass; effective samples/s,
R-hat, evaluations (and batched passes) per draw and the ratio to NUTS. R-hat is ArviZ's
rank-normalised split R-hat, the larger of the bulk and the folded (tail) one. Its Monte Carlo
noise shrinks like 1/draws; an elliptical slice move keeps ``|t − μ|`` correlated (lag-one
correlation 1/2 even with a perfect reference), so the folded R-hat of an ideal kernel over 4
chains of 400 draws exceeds 1.01 about one time in four (simulated, K = 5); ``--gess`` therefore
draws 1000 per chain (all samplers), where that R-hat is 1.003 (median) and 1.006 (90 %).
Effective samples/s is a rate: the run length changes it only through the fixed costs (Laplace
fit, warm-up) it amortises, for every sampler alike. The two generalised kernels run interleaved
in ``--rounds`` rounds with the same seed (same draws), best time kept; NUTS and plain ESS once
(their cost). Wall times include the Laplace fit and warm-up. The load average is printed per
block. ``--load`` runs a busy-loop Python process alongside.

``GESS-auto`` (issue 34) is ``EllipticalSliceSampler(model, reference="auto", chains=4 (K + 2))``:
Nishihara et al.'s population scheme, two independent populations of two groups of ``K + 2``
chains, each group's multivariate t fitted to the other group's current states, in warm-up and
sampling; its wall time includes the Laplace fit (its start) and every t fit. Its R-hat is
the larger of the chains' and the populations' (`diagnostics.check`). Every row also shows the
smallest tail ESS and ``|dm|/se``, the largest difference of a posterior mean from NUTS's in
units of ``sqrt(MCSE² + MCSE_NUTS²)`` (ArviZ's MCSE of the mean). Where NUTS's own R-hat exceeds
1.01 its means are no reference: the row's reference is then `importance_reference`, Pareto-smoothed
importance sampling from a mixture of t's at the posterior's modes (found by L-BFGS from every
sampler's final states), and ``|dm|/se`` of every sampler, NUTS included, is against it (its MCSE
in place of NUTS's); the line above the row gives its modes, their mass, PSIS's k-hat and its ESS.
On the toy problem at T = 1, K = 20 the posterior has two modes of comparable mass with a barrier
between them that NUTS's chains do not cross. ``--ranks``, ``--samplers`` and ``--auto-draws``
select rows and the GESS-auto chain length (a rate, ESS/s, is compared, so a longer chain changes
only the fixed costs it amortises).

    python benchmarks/ess_vs_nuts.py [--draws 400] [--warmup 200] [--quick]
    python benchmarks/ess_vs_nuts.py --gess [--draws 1000] [--chains 4] [--load] [--quick]
        [--temperatures auto,1] [--data toy,diabetes] [--ranks 2,5,10] [--samplers ...]
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import signal
import subprocess
import sys
import time
import warnings
from typing import NamedTuple

import arviz as az
import numpy as np
import pyro
import torch
from pyro.infer import MCMC, NUTS
from scipy.stats import multivariate_t
from torch import nn

from pyro_subspace import (
    ConvergenceWarning,
    EllipticalSliceSampler,
    SubspaceNet,
    datasets,
    fit_map,
    likelihoods,
    subspaces,
)
from pyro_subspace.diagnostics import check
from pyro_subspace.infer import EllipticalSliceSampler as _Kernel
from pyro_subspace.infer.ess import one_process


def load_average() -> list[str]:
    """The 1, 5 and 15 minute load averages (the machine is shared: printed with every table)."""
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def toy_net(d_in: int) -> nn.Module:
    sizes = [d_in, 200, 50, 50, 50]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(50, 1))


def small_net(d_in: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, 50), nn.ReLU(), nn.Linear(50, 1))


def snapshots_for(rank: int) -> int:
    """The collector's size: 20 snapshots for K <= 10 (the rows of every earlier table), 40 for
    larger K (PCA of 20 snapshots has at most 19 directions with variance)."""
    return 20 if rank <= 10 else 40


def trained(name: str, quick: bool, snapshots: int = 20):
    data = datasets.load(name, seed=0)
    torch.manual_seed(0)
    net = toy_net(data.n_features) if name == "toy" else small_net(data.n_features)
    lik = likelihoods.Gaussian()
    col = subspaces.SWACollector(net, max_snapshots=snapshots)
    epochs = 300 if quick else 2000
    fit_map(
        net,
        lik,
        data.x_train,
        data.y_train,
        epochs=epochs,
        lr=1e-3,
        weight_decay=1e-4,
        seed=0,
        progress=False,
    )
    fit_map(
        net,
        lik,
        data.x_train,
        data.y_train,
        epochs=0,
        collector=col,
        swa_epochs=40,
        swa_lr=3e-4,
        batch_size=50,
        weight_decay=1e-4,
        seed=0,
        progress=False,
    )
    return data, net, lik, col


class CallCounter:
    """Counts forward calls of a module (NUTS: one per gradient evaluation)."""

    def __init__(self, module: nn.Module) -> None:
        self.calls = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def run_sampler(kind: str, model: SubspaceNet, x, y, draws: int, warmup: int):
    pyro.set_rng_seed(0)
    kernel = EllipticalSliceSampler(model) if kind == "ESS" else NUTS(model)
    counter = CallCounter(model)
    mcmc = MCMC(kernel, num_samples=draws, warmup_steps=warmup, num_chains=2, disable_progbar=True)
    start = time.perf_counter()
    mcmc.run(x, y)
    seconds = time.perf_counter() - start
    counter.handle.remove()
    steps = 2 * (draws + warmup)
    if kind == "ESS":
        evals = sum(mcmc.diagnostics()["evaluations per draw"].values()) / 2
    else:  # minus the driver's set-up traces
        evals = max(counter.calls - 4, 0) / steps
    posterior = az.from_dict(posterior={"t": mcmc.get_samples(group_by_chain=True)["t"].numpy()})
    ess = float(az.ess(posterior, method="bulk")["t"].min())
    rhat = float(az.rhat(posterior)["t"].max())
    return seconds, ess, rhat, evals, seconds / steps


def overheads(model: SubspaceNet, x, y, per_step_driver: float, repeats: int = 300):
    """Sampler overhead: seconds per draw / (evaluations per draw × one full-data evaluation).

    ``kernel`` times ``EllipticalSliceSampler.sample`` alone; ``driver`` uses the wall time per
    step inside ``MCMC.run`` (Pyro's driver adds logging and bookkeeping per step).
    """
    pyro.set_rng_seed(1)
    kernel = EllipticalSliceSampler(model)
    kernel.setup(0, x, y)
    t = {"t": torch.zeros(model.rank)}
    kernel.log_likelihood(t)
    start = time.perf_counter()
    for _ in range(repeats):
        kernel.log_likelihood(t)
    fwd = (time.perf_counter() - start) / repeats
    params = kernel.initial_params
    kernel._evals = kernel._t = 0
    start = time.perf_counter()
    for _ in range(repeats):
        params = kernel.sample(params)
    per_draw = (time.perf_counter() - start) / repeats
    evals = kernel.evaluations_per_draw
    return per_draw / (evals * fwd), per_step_driver / (evals * fwd)


def memory_child(chunk: int) -> None:
    """Print the peak-RSS increase (MB) of one likelihood evaluation on 200k points."""
    torch.manual_seed(0)
    net = toy_net(2)
    model = SubspaceNet(net, subspaces.random(net, 10, seed=0), likelihoods.Gaussian(0.1))
    x, y = torch.randn(200_000, 2), torch.randn(200_000)
    # the kernel's likelihood path: the model's full-data evaluator, in chunks
    loglik, _ = model.log_likelihood_fn(x, y, chunk_size=chunk)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loglik({"t": torch.zeros(10)})
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) / 1024)


def ess_memory_child(n: int) -> None:
    """Print the peak-RSS increases (MB) of ESS setup and of setup + 5 transitions on ``n``
    points, 10-200-1 net, rank 10, chunk 4096, above the baseline with the data in memory.

    Run with ``MALLOC_MMAP_THRESHOLD_=65536`` (set by the parent): blocks above 64 kB are then
    returned to the system when freed, so the peak RSS follows the live memory instead of
    glibc's cache of freed chunk buffers (which otherwise grows with the number of chunks
    evaluated, up to a few tens of MB, and then stays).
    """
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 200), nn.ReLU(), nn.Linear(200, 1))
    model = SubspaceNet(net, subspaces.random(net, 10, seed=0), likelihoods.Gaussian(0.1))
    x, y = torch.randn(n, 10), torch.randn(n)
    kernel = EllipticalSliceSampler(model, chunk_size=4096)

    def peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    before = peak()
    kernel.setup(0, x, y)
    setup = peak() - before
    params = kernel.initial_params
    for _ in range(5):
        params = kernel.sample(params)
    print(setup, peak() - before)


def auto_chains(rank: int) -> int:
    """``C = 4 (K + 2)``: two populations of two groups of ``K + 2`` chains."""
    return 4 * (rank + 2)


def slice_kernel(kind: str, model: SubspaceNet, chains: int):
    if kind == "ESS":
        return EllipticalSliceSampler(model)
    if kind == "GESS-auto":
        return _Kernel(model, reference="auto", chains=chains, seed=0)
    batched = chains if kind == "GESS-bat" else None
    return _Kernel(model, reference="laplace", chains=batched, seed=0)


def run_chains(kernel, x, y, draws: int, warmup: int, chains: int):
    """``(seconds, min bulk ESS, max R-hat, evaluations/draw, batched passes/draw, min tail ESS,
    posterior means (K,), their MCSE (K,))``. R-hat of ``reference="auto"``: the larger of the
    chains' and the independent populations' (`diagnostics.check`)."""
    pyro.set_rng_seed(0)
    mcmc = MCMC(
        kernel, num_samples=draws, warmup_steps=warmup, num_chains=chains, disable_progbar=True
    )
    one_process(mcmc)  # every chain in this process (reference="auto" needs it; the others
    # ran so before: this machine has fewer cores than chains)
    counter = CallCounter(kernel.model)
    start = time.perf_counter()
    with warnings.catch_warnings():  # the table shows R-hat and ESS; no warning text in it
        warnings.simplefilter("ignore", ConvergenceWarning)
        mcmc.run(x, y)
    seconds = time.perf_counter() - start
    counter.handle.remove()
    diag = mcmc.diagnostics()
    if "evaluations per draw" in diag:
        evals = sum(diag["evaluations per draw"].values()) / chains
    else:  # NUTS: model calls with gradient, minus the driver's set-up traces
        evals = max(counter.calls - 2 * chains, 0) / (chains * (draws + warmup))
    passes = diag.get("passes per draw", {}).get("chain 0", evals)
    samples = mcmc.get_samples(group_by_chain=True)["t"].numpy()
    posterior = az.from_dict(posterior={"t": samples})
    report = check(mcmc, warn=False)
    mcse = az.mcse(posterior, method="mean")["t"].values
    by_population = report.rhat_populations
    return Run(
        seconds,
        report.min_ess_bulk,
        report.max_rhat,
        evals,
        passes,
        report.min_ess_tail,
        samples.reshape(-1, samples.shape[-1]).mean(0),
        mcse,
        None if by_population is None else float(by_population["t"].max()),
        samples[:, -1],
    )


class Run(NamedTuple):
    """One sampler's run on one row (`run_chains`)."""

    seconds: float
    ess_bulk: float
    rhat: float  # the larger of the chains' and (GESS-auto) the populations'
    evals: float
    passes: float
    ess_tail: float
    mean: np.ndarray  # (K,) posterior means
    mcse: np.ndarray  # (K,) their Monte Carlo standard errors (ArviZ)
    rhat_populations: float | None  # GESS-auto: across its independent populations alone
    last: np.ndarray  # (chains, K): every chain's final state (the mode search's starts)


class Reference(NamedTuple):
    """Posterior means by importance sampling over the posterior's modes (`importance_reference`)."""

    mean: np.ndarray  # (K,)
    mcse: np.ndarray  # (K,)
    pareto_k: float  # PSIS's k-hat: below 0.7 the estimate is reliable (Vehtari et al.)
    ess: float  # 1 / sum of the squared normalised weights
    weights: np.ndarray  # (modes,) the posterior mass near each mode (its proposals' weights)
    log_density: np.ndarray  # (modes,) log p(t, D) at each mode
    draws: int  # the importance draws


def importance_reference(
    model: SubspaceNet, x, y, starts: np.ndarray, draws: int = 40_000, df: float = 5.0,
    inflation: float = 1.2, seed: int = 0,
) -> Reference:  # fmt: skip
    """The posterior means of ``t`` with their Monte Carlo errors, independent of every sampler:
    Pareto-smoothed importance sampling (Vehtari, Simpson, Gelman, Yao & Gabry 2024; ArviZ's
    ``psislw``) from an equal-weight mixture of multivariate t's (``df``), one per mode of the
    posterior, each with the inverse Hessian of ``−log p(t, D)`` at its mode times
    ``inflation`` as its scale. The modes: L-BFGS from every row of ``starts`` ``(S, K)`` (the
    final states of every sampler's chains) and from the Laplace mode's start ``0``, optima
    merged when they are within 0.5 posterior standard deviations of one another (the
    Mahalanobis distance under the better one's Hessian).

    The reference for a row on which NUTS does not converge: on a posterior with modes
    separated by a barrier NUTS's chains each keep to one mode and no run length fixes that,
    while the importance weights are exact wherever the mixture covers the posterior (k-hat
    says whether it does)."""
    from pyro import poutine

    k = starts.shape[-1]

    def energy(t: torch.Tensor) -> torch.Tensor:  # −log p(t, D), the model's own density
        trace = poutine.trace(poutine.condition(model, {"t": t})).get_trace(x, y)
        return -trace.log_prob_sum()

    modes: list[tuple[float, np.ndarray, np.ndarray]] = []  # (energy, mode, Hessian)
    dtype = model.prior().mean.dtype
    for start in [np.zeros(k), *starts]:
        t = torch.tensor(start, dtype=dtype, requires_grad=True)
        opt = torch.optim.LBFGS(
            [t], max_iter=500, line_search_fn="strong_wolfe", tolerance_grad=1e-7,
            tolerance_change=1e-10,
        )  # fmt: skip

        def closure(t=t, opt=opt):
            opt.zero_grad()
            u = energy(t)
            u.backward()
            return u

        for _ in range(3):
            opt.step(closure)
        point = t.detach()
        hess = torch.autograd.functional.hessian(energy, point).double().numpy()
        with torch.no_grad():
            u = float(energy(point))
        mode = point.double().numpy()
        if np.linalg.eigvalsh(hess)[0] <= 0:
            continue  # a saddle or a flat stop: no mode
        same = [
            i for i, (v, m, h) in enumerate(modes)
            if float((mode - m) @ (h if v <= u else hess) @ (mode - m)) < 0.25
        ]  # fmt: skip
        if not same:
            modes.append((u, mode, hess))
        elif u < modes[same[0]][0]:
            modes[same[0]] = (u, mode, hess)
    if not modes:
        raise RuntimeError("importance_reference: no start reached a mode (every stop a saddle)")
    rng = np.random.default_rng(seed)
    scales = [inflation * np.linalg.inv(h) for _, _, h in modes]
    which = rng.integers(0, len(modes), draws)
    z = rng.standard_normal((draws, k)) / np.sqrt(rng.chisquare(df, (draws, 1)) / df)
    trils = np.stack([np.linalg.cholesky(0.5 * (s + s.T)) for s in scales])
    points = np.stack([m for _, m, _ in modes])[which] + np.einsum("nij,nj->ni", trils[which], z)
    log_q = np.logaddexp.reduce(
        [
            multivariate_t(m, 0.5 * (s + s.T), df=df).logpdf(points)
            for (_, m, _), s in zip(modes, scales)
        ],
        axis=0,
    ) - np.log(len(modes))  # fmt: skip
    evaluator = model.evaluator(x, y)
    log_p = []
    with torch.no_grad():
        for rows in np.array_split(points, max(1, draws // 2000)):
            t = torch.from_numpy(rows).to(dtype)
            log_p.append((evaluator.log_likelihood(t) + model.prior().log_prob(t)).double().numpy())
    log_w, pareto_k = az.psislw(np.concatenate(log_p) - log_q)
    w = np.exp(log_w - log_w.max())
    w /= w.sum()
    mean = w @ points
    mcse = np.sqrt((w[:, None] ** 2 * (points - mean) ** 2).sum(0))  # self-normalised IS
    weights = np.array([w[which == i].sum() for i in range(len(modes))])
    return Reference(
        mean, mcse, float(pareto_k), float(1 / (w**2).sum()), weights,
        np.array([-u for u, _, _ in modes]), draws,
    )  # fmt: skip


def gess_tables(args) -> None:
    kinds = [k for k in ("ESS", "GESS-sep", "GESS-bat", "GESS-auto") if k in args.samplers]
    print(
        f"{args.draws} draws + {args.warmup} warm-up per chain; slice kernels {args.chains} "
        f"chains (generalised: best of {args.rounds} interleaved rounds), "
        f"GESS-auto 4(K + 2) chains (two populations), "
        f"NUTS {args.nuts_chains} chains "
        f"(one round); torch threads {torch.get_num_threads()}; CPU"
    )
    print(
        "R-hat: rank-normalised split R-hat, max over coordinates (GESS-auto: also across its "
        "populations; 'pops': across them alone); |dm|/se: max over coordinates of "
        "|mean - mean NUTS| / sqrt(MCSE^2 + MCSE_NUTS^2); where NUTS's R-hat exceeds 1.01 the "
        "reference is instead importance sampling over the posterior's modes "
        "(`importance_reference`, its own MCSE), for NUTS too"
    )
    head = (
        f"{'T':<6}{'data':<9}{'K':>3} {'sampler':<10}{'wall s':>8}{'bulk ESS':>9}{'tail ESS':>9}"
        f"{'ESS/s':>9}{'R-hat':>7}{'pops':>6}{'evals/draw':>11}{'passes':>7}{'vs NUTS':>8}"
        f"{'|dm|/se':>8}"
    )
    print(head)
    cache: dict = {}
    for temperature in args.temperatures.split(","):
        temp = temperature if temperature == "auto" else float(temperature)
        label = "N/K" if temp == "auto" else temperature
        for name in args.data.split(","):
            print(f"# load average: {load_average()}", flush=True)
            for rank in [int(r) for r in args.ranks.split(",")]:
                key = (name, snapshots_for(rank))
                if key not in cache:  # train once per data set and collector size
                    cache[key] = trained(name, args.quick, key[1])
                data, net, lik, col = cache[key]
                x, y = data.x_train, data.y_train
                model = SubspaceNet(net, subspaces.pca(col, rank), lik, temperature=temp)
                nuts = run_chains(NUTS(model), x, y, args.draws, args.warmup, args.nuts_chains)
                rows = {}
                if "ESS" in kinds:
                    plain = slice_kernel("ESS", model, 0)
                    rows["ESS"] = run_chains(plain, x, y, args.draws, args.warmup, args.chains)
                for _ in range(args.rounds):
                    for kind in kinds:
                        if kind == "ESS":
                            continue
                        chains = auto_chains(rank) if kind == "GESS-auto" else args.chains
                        draws = args.auto_draws if kind == "GESS-auto" else args.draws
                        kernel = slice_kernel(kind, model, chains)
                        res = run_chains(kernel, x, y, draws, args.warmup, chains)
                        if kind not in rows or res.seconds < rows[kind].seconds:
                            rows[kind] = res
                rate_nuts = nuts.ess_bulk / nuts.seconds
                ref_mean, ref_mcse = nuts.mean, nuts.mcse
                nuts_is_reference = nuts.rhat <= 1.01
                if not nuts_is_reference:  # NUTS has not converged: it cannot be the reference
                    starts = np.concatenate([nuts.last, *(r.last for r in rows.values())])
                    ref = importance_reference(model, x, y, starts)
                    ref_mean, ref_mcse = ref.mean, ref.mcse
                    print(
                        f"# NUTS R-hat {nuts.rhat:.3f} > 1.01: reference by importance sampling "
                        f"over {len(ref.weights)} mode(s) (log p at each "
                        f"{np.array2string(ref.log_density, precision=2)}, posterior mass near "
                        f"each {np.array2string(ref.weights, precision=3)}): PSIS k-hat "
                        f"{ref.pareto_k:.2f}, ESS {ref.ess:.0f} of {ref.draws}",
                        flush=True,
                    )
                for kind, row in [("NUTS", nuts), *rows.items()]:
                    ratio, shift = f"{'':>8}", ""
                    if kind != "NUTS":
                        ratio = f"{row.ess_bulk / row.seconds / rate_nuts:>8.1f}"
                    if kind != "NUTS" or not nuts_is_reference:
                        se = (row.mcse**2 + ref_mcse**2) ** 0.5
                        shift = f"{float((abs(row.mean - ref_mean) / se).max()):>8.2f}"
                    pops = "" if row.rhat_populations is None else f"{row.rhat_populations:.3f}"
                    print(
                        f"{label:<6}{name:<9}{rank:>3} {kind:<10}{row.seconds:>8.1f}"
                        f"{row.ess_bulk:>9.0f}{row.ess_tail:>9.0f}{row.ess_bulk / row.seconds:>9.1f}"
                        f"{row.rhat:>7.3f}{pops:>6}{row.evals:>11.2f}{row.passes:>7.2f}"
                        f"{ratio}{shift}",
                        flush=True,
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, help="per chain; default 400, --gess 1000")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="short training, few draws")
    parser.add_argument(
        "--temperature", default="auto", help="'auto' (T = N/K, the paper's setting) or a number"
    )
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ess-memory-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--memory-only", action="store_true", help="only the memory section")
    parser.add_argument("--gess", action="store_true", help="the generalised ESS tables")
    parser.add_argument("--chains", type=int, default=4, help="--gess: slice-kernel chains")
    parser.add_argument("--nuts-chains", type=int, default=2, help="--gess: NUTS chains")
    parser.add_argument("--rounds", type=int, default=2, help="--gess: interleaved rounds")
    parser.add_argument("--temperatures", default="auto,1", help="--gess: comma-separated")
    parser.add_argument("--data", default="toy,diabetes", help="--gess: comma-separated")
    parser.add_argument("--ranks", default="2,5,10", help="--gess: subspace ranks K")
    parser.add_argument(
        "--samplers",
        default="ESS,GESS-sep,GESS-bat,GESS-auto",
        help="--gess: slice-kernel rows besides NUTS (comma-separated)",
    )
    parser.add_argument(
        "--auto-draws", type=int, help="--gess: draws per chain of GESS-auto (default --draws)"
    )
    parser.add_argument("--load", action="store_true", help="--gess: a busy-loop process alongside")
    args = parser.parse_args()
    if args.memory_child is not None:
        memory_child(args.memory_child)
        return
    if args.ess_memory_child is not None:
        ess_memory_child(args.ess_memory_child)
        return
    if args.memory_only:
        memory_section()
        return
    if args.gess:
        torch.set_num_threads(1)
        if args.quick:
            args.draws, args.warmup = 100, 60
        args.draws = args.draws or 1000
        args.auto_draws = args.auto_draws or args.draws
        print(f"# load average at start: {load_average()}")
        busy = None
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so `finally` ends the load
        if args.load:  # a deliberate second load: one core kept busy for the whole run
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            print(f"# with a busy-loop load process (pid {busy.pid})")
        try:
            gess_tables(args)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        print(f"# load average at end: {load_average()}")
        return
    if args.quick:
        args.draws, args.warmup = 60, 30
    args.draws = args.draws or 400
    temperature = args.temperature if args.temperature == "auto" else float(args.temperature)
    header = (
        f"{'data':<9}{'K':>3} {'sampler':<8}{'wall s':>8}{'bulk ESS':>10}{'ESS/s':>9}"
        f"{'R-hat':>7}{'evals/draw':>11}{'ESS/s ratio':>12}{'overhead':>10}{'(driver)':>9}"
    )
    print(f"{args.draws} draws + {args.warmup} warm-up per chain, 2 chains, CPU, T={temperature}")
    print(header)
    for name in ("toy", "diabetes"):
        data, net, lik, col = trained(name, args.quick)
        for rank in (2, 5, 10):
            model = SubspaceNet(net, subspaces.pca(col, rank), lik, temperature=temperature)
            rows = {
                kind: run_sampler(kind, model, data.x_train, data.y_train, args.draws, args.warmup)
                for kind in ("ESS", "NUTS")
            }
            kernel_oh, driver_oh = overheads(model, data.x_train, data.y_train, rows["ESS"][4])
            ratio = (rows["ESS"][1] / rows["ESS"][0]) / (rows["NUTS"][1] / rows["NUTS"][0])
            for kind, (secs, ess, rhat, evals, _) in rows.items():
                overhead = f"{kernel_oh:>10.2f}{driver_oh:>9.2f}" if kind == "ESS" else ""
                last = f"{ratio:>12.1f}" if kind == "ESS" else f"{'':>12}"
                print(
                    f"{name:<9}{rank:>3} {kind:<8}{secs:>8.1f}{ess:>10.0f}{ess / secs:>9.1f}"
                    f"{rhat:>7.3f}{evals:>11.1f}{last}{overhead}"
                )
    memory_section()


def _ratio(a: float, b: float) -> str:
    """``a / b`` for the table; "n/a" when ``b`` is 0 (a step that reused memory the process
    already held shows no peak-RSS increase)."""
    return f"{a / b:.3f}" if b > 0 else f"n/a ({a:.1f} MB over 0)"


def memory_section() -> None:
    """Peak memory: one likelihood evaluation chunked vs not; ESS setup and sampling vs ``N``."""
    print("\npeak memory of one likelihood evaluation, N = 200,000, toy net (MB above baseline)")
    for chunk in (4096, 200_000):
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", str(chunk)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        label = f"chunk_size={chunk}" + (" (unchunked)" if chunk == 200_000 else "")
        print(f"  {label:<32}{float(out):>8.1f} MB")

    print(
        "\npeak memory of elliptical slice sampling, 10-200-1 net, rank 10, chunk_size=4096 "
        "(MB above the baseline with the data loaded; fresh process each, "
        "MALLOC_MMAP_THRESHOLD_=65536)"
    )
    print(f"  {'N':>9}{'setup':>10}{'setup + 5 draws':>18}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = {}
    for n in (100_000, 1_000_000):
        out = subprocess.run(
            [sys.executable, __file__, "--ess-memory-child", str(n)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        ).stdout.split()
        rows[n] = float(out[0]), float(out[1])
        print(f"  {n:>9,}{rows[n][0]:>10.1f}{rows[n][1]:>18.1f}")
    small, large = rows[100_000], rows[1_000_000]
    print(
        f"  ratio N=10^6 / N=10^5: setup {_ratio(large[0], small[0])}, "
        f"setup + draws {_ratio(large[1], small[1])} (bounded by the chunk: within 1.10)"
    )


if __name__ == "__main__":
    main()
