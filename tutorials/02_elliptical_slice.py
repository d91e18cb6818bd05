# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Elliptical slice sampling in a PCA subspace
#
# Subspace Inference (Izmailov et al., 2019, appendix F) samples the subspace posterior with
# elliptical slice sampling (ESS; Murray, Adams & MacKay, 2010): no step size to tune, no
# gradients, one full-data likelihood evaluation per proposal. `EllipticalSliceSampler` is a
# Pyro `MCMCKernel`, so it runs in Pyro's `MCMC` driver exactly where `NUTS` would.
#
# Here: the same `SubspaceNet` sampled by ESS and by NUTS, trace plots and R-hat with ArviZ,
# and the two predictive distributions side by side. Run it as a script or with
# `pyro-subspace tutorial 02`; `PYRO_SUBSPACE_TINY=1` shrinks every setting.

# %%
import os
import time
from pathlib import Path

import arviz as az
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pyro
import torch
from pyro.infer import MCMC, NUTS
from torch import nn

from pyro_subspace import (
    EllipticalSliceSampler,
    SubspaceNet,
    convert,
    datasets,
    fit_map,
    likelihoods,
    metrics,
    subspaces,
)

TINY = os.environ.get("PYRO_SUBSPACE_TINY") == "1"
OUT = Path(os.environ.get("PYRO_SUBSPACE_OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
EPOCHS, SWA_EPOCHS = (30, 10) if TINY else (2000, 100)
SAMPLES, WARMUP = (100, 50) if TINY else (500, 200)  # GESS starts dispersed: >= 50 warm-up
torch.manual_seed(0)
pyro.set_rng_seed(0)

# %% [markdown]
# ## A trained network and its PCA subspace (as in tutorial 01)

# %%
data = datasets.toy_regression(n=400, seed=0)
net = nn.Sequential(
    nn.Linear(2, 200), nn.ReLU(), nn.Linear(200, 50), nn.ReLU(),
    nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 1),
)  # fmt: skip
likelihood = likelihoods.Gaussian()
collector = subspaces.SWACollector(net, max_snapshots=20)
fit_map(net, likelihood, data.x_train, data.y_train, epochs=EPOCHS, lr=1e-3, weight_decay=1e-4,
        seed=0, progress=False)  # fmt: skip
fit_map(net, likelihood, data.x_train, data.y_train, epochs=0, collector=collector,
        swa_epochs=SWA_EPOCHS, swa_lr=3e-4, batch_size=50, weight_decay=1e-4, seed=0,
        progress=False)  # fmt: skip
model = SubspaceNet(net, subspaces.pca(collector, rank=5), likelihood, temperature="auto")

# %% [markdown]
# ## ESS and NUTS with the same number of draws
# ESS evaluates the likelihood over all 400 points in chunks (`chunk_size`) without gradients;
# `diagnostics()` reports how many evaluations a draw took.

# %%
runs = {}
for name, kernel in [("ESS", EllipticalSliceSampler(model, chunk_size=256)), ("NUTS", NUTS(model))]:
    mcmc = MCMC(kernel, num_samples=SAMPLES, warmup_steps=WARMUP, num_chains=2,
                disable_progbar=TINY)  # fmt: skip
    start = time.perf_counter()
    mcmc.run(data.x_train, data.y_train)
    seconds = time.perf_counter() - start
    idata = convert.to_inference_data(mcmc, seed=0)
    ess = float(az.ess(idata, var_names=["t"])["t"].min())
    rhat = float(az.rhat(idata, var_names=["t"])["t"].max())
    runs[name] = (mcmc, idata)
    print(f"{name:<5} {seconds:6.1f} s   min bulk ESS {ess:6.0f}   ESS/s {ess / seconds:7.1f}"
          f"   max R-hat {rhat:.3f}")  # fmt: skip
print("ESS likelihood evaluations per draw:",
      runs["ESS"][0].diagnostics()["evaluations per draw"])  # fmt: skip

# %% [markdown]
# ## Trace plots (ArviZ)

# %%
for name, (_, idata) in runs.items():
    axes = az.plot_trace(idata, var_names=["t"], compact=True)
    axes[0, 0].figure.suptitle(f"{name}: trace of t")
    axes[0, 0].figure.savefig(OUT / f"02_trace_{name.lower()}.png", dpi=80)
    plt.close("all")

# %% [markdown]
# ## Predictive comparison

# %%
sigma2 = likelihood.sigma.detach() ** 2
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for ax, (name, (mcmc, _)) in zip(axes, runs.items(), strict=True):
    t = mcmc.get_samples()["t"]
    with torch.no_grad():
        f_test = model.outputs(t, data.x_test)[..., 0]
        f_grid = model.outputs(t, data.grid)[..., 0]
    var_test = sigma2.expand_as(f_test)
    nll = metrics.mixture_gaussian_nll(f_test, var_test, data.y_test)
    mu, var = metrics.moment_match(f_test, var_test)
    lo, hi = metrics.gaussian_interval(mu, var.sqrt())
    print(f"{name:<5} test NLL {nll:.3f}  RMSE {metrics.rmse(mu, data.y_test):.3f}  "
          f"95% coverage {metrics.interval_coverage(data.y_test, lo, hi):.3f}")  # fmt: skip
    mu_g, var_g = metrics.moment_match(f_grid, sigma2.expand_as(f_grid))
    lo_g, hi_g = metrics.gaussian_interval(mu_g, var_g.sqrt())
    ax.fill_between(data.grid_x, lo_g, hi_g, alpha=0.3)
    ax.plot(data.grid_x, mu_g)
    ax.scatter(data.x_train_raw, data.y_train, s=4, color="C3")
    ax.set_title(f"PCA subspace (K=5) + {name}")
fig.tight_layout()
fig.savefig(OUT / "02_elliptical_slice.png", dpi=100)
print("wrote", OUT / "02_elliptical_slice.png")

# %% [markdown]
# ## A fitted reference: generalised elliptical slice sampling
# At `T = 1` the posterior is much narrower than the prior and plain ESS shrinks its bracket
# many times per draw. With `reference=` the same kernel slices over a Gaussian reference
# `N(μ, Σ)` fitted to the posterior (here the Laplace guide, kept fixed; the chains start
# dispersed, at draws of `N(μ, 4Σ)`, so that R-hat can see unmixed chains) and treats
# `p(t) L(t) / N(t; μ, Σ)` as the likelihood (Nishihara, Murray & Adams, 2014); `chains=2`
# advances both chains in one batched likelihood evaluation. Checked against the Laplace
# approximation it started from: at `T = 1` on 400 points the posterior is close to
# Gaussian, so the sampled mean lies within a fraction of a posterior standard deviation of the
# MAP and the sampled spread is within a factor 2 of Laplace's.

# %%
from pyro_subspace.infer import AutoSubspaceLaplace

cold = SubspaceNet(net, subspaces.pca(collector, rank=2), likelihood, temperature=1.0)
laplace = AutoSubspaceLaplace(cold).fit(data.x_train, data.y_train)
for name, kernel in [
    ("ESS", EllipticalSliceSampler(cold)),
    ("GESS", EllipticalSliceSampler(cold, reference=laplace, chains=2, seed=0)),
]:
    mcmc = MCMC(kernel, num_samples=SAMPLES, warmup_steps=WARMUP, num_chains=2,
                disable_progbar=True)  # fmt: skip
    start = time.perf_counter()
    mcmc.run(data.x_train, data.y_train)
    seconds = time.perf_counter() - start
    ess = float(az.ess(convert.to_inference_data(mcmc, seed=0), var_names=["t"])["t"].min())
    evals = sum(mcmc.diagnostics()["evaluations per draw"].values()) / 2
    print(f"{name:<5} T=1  {seconds:6.1f} s   min bulk ESS {ess:6.0f}   ESS/s {ess / seconds:7.1f}"
          f"   evaluations/draw {evals:.2f}")  # fmt: skip
t = mcmc.get_samples()["t"].double()  # the generalised kernel's draws
sd = laplace.covariance.diagonal().sqrt()
assert ((t.mean(0) - laplace.loc).abs() <= 0.5 * sd + 5 * t.std(0) / len(t) ** 0.5).all()
assert ((t.std(0) / sd > 0.5) & (t.std(0) / sd < 2)).all(), (t.std(0), sd)

# %% [markdown]
# ## Any temperature, no reference to trust: `reference="auto"` and the diagnostics
# A Laplace reference fits badly where the posterior is sharp and non-Gaussian, and nothing in
# the chains says so. `reference="auto"` runs Nishihara, Murray & Adams's population scheme:
# `C = 4(K + 2)` chains in two independent populations of two groups; each group's reference
# is a multivariate t (location, scale and `ν`, fitted by ECME) to the *other* group's current
# states, refitted after every group update, in warm-up and sampling. The chains must share
# one process (`one_process`). At the end the kernel runs `diagnostics.check`: rank-normalised
# split R-hat (across the chains and across the two populations, which never exchange states)
# and bulk/tail ESS, with a `ConvergenceWarning` saying what to do when they fail; the same
# check runs on any `MCMC`, NUTS included. The ArviZ export carries, per draw, the likelihood
# evaluations of its transition (`n_evals`) and the `ν` of the reference it used
# (`reference_df`).

# %%
import warnings

from pyro_subspace import ConvergenceWarning, diagnostics
from pyro_subspace.infer import one_process

chains = 4 * (cold.rank + 2)
draws, warmup = (40, 20) if TINY else (SAMPLES, WARMUP)  # per chain: 4(K + 2) chains
auto = EllipticalSliceSampler(cold, reference="auto", chains=chains, seed=0)
mcmc = one_process(MCMC(auto, num_samples=draws, warmup_steps=warmup, num_chains=chains,
                        disable_progbar=True))  # fmt: skip
with warnings.catch_warnings(record=True) as caught:  # TINY runs are too short to mix
    warnings.simplefilter("always", ConvergenceWarning)
    start = time.perf_counter()
    mcmc.run(data.x_train, data.y_train)
    seconds = time.perf_counter() - start
report = auto.convergence
print(f"auto  T=1  {seconds:6.1f} s   {chains} chains   R-hat {report.max_rhat:.3f} "
      f"(across populations {max(float(v.max()) for v in report.rhat_populations.values()):.3f})"
      f"   min bulk ESS {report.min_ess_bulk:.0f}   tail ESS {report.min_ess_tail:.0f}"
      f"   {'converged' if report.ok else 'NOT converged: ' + report.problems[-1]}")  # fmt: skip
stats = convert.to_inference_data(mcmc, seed=0).sample_stats
print(f"evaluations per draw {float(stats['n_evals'].mean()):.2f}, fitted nu: median "
      f"{float(stats['reference_df'].median()):.1f}")  # fmt: skip
t = mcmc.get_samples()["t"].double()
assert ((t.mean(0) - laplace.loc).abs() <= 0.5 * sd + 5 * t.std(0) / len(t) ** 0.5).all()
assert ((t.std(0) / sd > 0.5) & (t.std(0) / sd < 2)).all(), (t.std(0), sd)
# the check of any run, NUTS's included: the two runs of the first section
for name, (first, _) in runs.items():
    r = diagnostics.check(first, warn=False)
    print(f"{name:<5} R-hat {r.max_rhat:.3f}  bulk ESS {r.min_ess_bulk:.0f}  tail ESS "
          f"{r.min_ess_tail:.0f}  divergences {r.divergences}  ok {r.ok}")  # fmt: skip
