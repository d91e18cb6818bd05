# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Subspaces × inference methods: the Subspace Inference grid (Figure 3, appendix figures)
#
# On the paper's 1-D toy regression (section 3.1): three subspaces — random (rank 10), PCA of
# the SGD trajectory (rank 10) and the 2-D plane of a Bezier curve between two independently
# trained solutions (appendix C.3) — times four inference methods: mean-field VI (`AutoNormal`),
# VI with a normalizing flow (`AutoIAFNormal`, in place of the paper's RealNVP), elliptical slice
# sampling and NUTS. A 3×4 grid of predictive bands, and the posterior over the curve plane with
# ESS samples, as in the paper's Figure 2.
#
# Run with `pyro-subspace grid` (or `pyro-subspace tutorial 06`); `PYRO_SUBSPACE_TINY=1` for a
# smoke test.

# %%
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pyro
import torch
from pyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoIAFNormal, AutoNormal
from torch import nn
from tqdm.auto import tqdm

from pyro_subspace import (
    EllipticalSliceSampler,
    SubspaceNet,
    datasets,
    fit_map,
    likelihoods,
    metrics,
    subspaces,
)

TINY = os.environ.get("PYRO_SUBSPACE_TINY") == "1"
OUT = Path(os.environ.get("PYRO_SUBSPACE_OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
EPOCHS, SWA_EPOCHS, CURVE_EPOCHS = (30, 12, 5) if TINY else (2000, 100, 300)
DRAWS, WARMUP, VI_STEPS = (10, 5, 10) if TINY else (300, 150, 1500)
data = datasets.toy_regression(n=400, seed=0)


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 200), nn.ReLU(), nn.Linear(200, 50), nn.ReLU(),
        nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 50), nn.ReLU(), nn.Linear(50, 1),
    )  # fmt: skip


# %% [markdown]
# ## Two independent solutions, an SWA trajectory, and a curve between the solutions

# %%
likelihood = likelihoods.Gaussian(sigma=0.1)  # the data's noise level, fixed for every method
solutions = []
for seed in (0, 1):
    torch.manual_seed(seed)
    net = make_net()
    fit_map(net, likelihood, data.x_train, data.y_train, epochs=EPOCHS, lr=1e-3,
            weight_decay=1e-4, seed=seed, progress=not TINY)  # fmt: skip
    solutions.append(net)
net, other = solutions
collector = subspaces.SWACollector(net, max_snapshots=20)
w0 = nn.utils.parameters_to_vector(net.parameters()).detach().clone()
w1 = nn.utils.parameters_to_vector(other.parameters()).detach().clone()
fit_map(net, likelihood, data.x_train, data.y_train, epochs=0, collector=collector,
        swa_epochs=SWA_EPOCHS, swa_lr=1e-4, batch_size=50, weight_decay=1e-4, seed=0,
        progress=not TINY)  # fmt: skip
theta = subspaces.fit_curve(net, likelihood, data.x_train, data.y_train, w0, w1,
                            epochs=CURVE_EPOCHS, lr=1e-3, batch_size=50, seed=0,
                            progress=not TINY)  # fmt: skip
s, on_curve, on_line = subspaces.curve_losses(net, likelihood, data.x_train, data.y_train,
                                              w0, theta, w1, num_points=11)  # fmt: skip
print(f"training loss at the middle: curve {on_curve[5]:.3f}, straight line {on_line[5]:.3f}")

nn.utils.vector_to_parameters(collector.mean, net.parameters())  # random subspace around SWA
spaces = {
    "random (K=10)": subspaces.random(net, 10, seed=0),
    "PCA (K=10)": subspaces.pca(collector, rank=10, seed=0),
    "curve (K=2)": subspaces.curve(w0, theta, w1),
}

# %% [markdown]
# ## Four inference methods in each subspace

# %%


def vi(model: SubspaceNet, guide_cls) -> torch.Tensor:
    pyro.clear_param_store()
    guide = guide_cls(model)
    optim = pyro.optim.ClippedAdam({"lr": 0.01, "lrd": 0.1 ** (1 / VI_STEPS)})
    elbo = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1)
    svi = SVI(model, guide, optim, elbo)
    for _ in tqdm(range(VI_STEPS), desc="  SVI", disable=TINY, leave=False, mininterval=0.5):
        svi.step(data.x_train, data.y_train)
    t = Predictive(model, guide=guide, num_samples=DRAWS, return_sites=["t"])(
        data.x_train, data.y_train
    )["t"]
    return t.reshape(-1, model.rank)


def mcmc(model: SubspaceNet, kernel) -> torch.Tensor:
    runner = MCMC(kernel, num_samples=DRAWS, warmup_steps=WARMUP, disable_progbar=TINY)
    runner.run(data.x_train, data.y_train)
    return runner.get_samples()["t"]


methods = {
    "VI": lambda m: vi(m, AutoNormal),
    "VI (flow)": lambda m: vi(m, lambda mm: AutoIAFNormal(mm, hidden_dim=[32])),
    "ESS": lambda m: mcmc(m, EllipticalSliceSampler(m)),
    "NUTS": lambda m: mcmc(m, NUTS(m)),
}
draws = {}
fig, axes = plt.subplots(3, 4, figsize=(16, 10), sharex=True, sharey=True)
print(f"{'subspace':<15}{'method':<11}{'test NLL':>9}{'cover95':>9}")
for row, (space_name, space) in enumerate(spaces.items()):
    model = SubspaceNet(net, space, likelihood, temperature="auto")
    for col, (method_name, run) in enumerate(methods.items()):
        pyro.set_rng_seed(0)
        t = run(model)
        draws[space_name, method_name] = t
        with torch.no_grad():
            f_grid = model.outputs(t, data.grid)[..., 0]
            f_test = model.outputs(t, data.x_test)[..., 0]
        noise = torch.full_like(f_test, 0.01)
        score = metrics.regression_scores(f_test, noise, data.y_test)
        row_text = f"{space_name:<15}{method_name:<11}{score['nll']:>9.3f}"
        print(f"{row_text}{score['coverage95']:>9.3f}", flush=True)
        mu, var = metrics.moment_match(f_grid, torch.full_like(f_grid, 0.01))
        lo, hi = metrics.gaussian_interval(mu, var.sqrt())
        ax = axes[row, col]
        ax.fill_between(data.grid_x, lo, hi, alpha=0.3)
        ax.plot(data.grid_x, mu, lw=1)
        ax.scatter(data.x_train_raw, data.y_train, s=2, color="C3")
        ax.set_title(f"{space_name}, {method_name}", fontsize=9)
fig.tight_layout()
fig.savefig(OUT / "06_subspace_grid.png", dpi=90)
print("wrote", OUT / "06_subspace_grid.png")

# %% [markdown]
# ## The posterior over the curve plane (Figure 2)
# The tempered log posterior on a grid of `t`, computed with the sampler's own likelihood, and
# the ESS draws on top. The curve itself is drawn through `w0`, `θ` and `w1`.

# %%
model = SubspaceNet(net, spaces["curve (K=2)"], likelihood, temperature="auto")
kernel = EllipticalSliceSampler(model)
kernel.setup(0, data.x_train, data.y_train)
curve_t = model.subspace.project(subspaces.bezier(w0, theta, w1, s))
lo, hi = curve_t.min(0).values - 0.5, curve_t.max(0).values + 0.5  # a window around the curve
n_side = 15 if TINY else 80
side1, side2 = torch.linspace(lo[0], hi[0], n_side), torch.linspace(lo[1], hi[1], n_side)
grid_t = torch.cartesian_prod(side1, side2)
log_post = torch.tensor(
    [kernel.log_likelihood({"t": t}) + model.prior().log_prob(t).item() for t in grid_t]
).reshape(n_side, n_side)
fig, ax = plt.subplots(figsize=(7, 5))
top = log_post.max().item()
levels = torch.linspace(top - 40, top, 11).tolist()  # the 40 nats below the mode
contour = ax.contourf(side1, side2, log_post.T, levels=levels, cmap="viridis", extend="min")
fig.colorbar(contour, label="tempered log posterior")
ess_t = draws["curve (K=2)", "ESS"]
ax.scatter(ess_t[:, 0], ess_t[:, 1], s=6, color="white", edgecolor="k", lw=0.3, label="ESS")
ax.plot(curve_t[:, 0], curve_t[:, 1], "r-", label="Bezier curve")
ax.set_xlabel("t1")
ax.set_ylabel("t2")
ax.legend(loc="upper right", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "06_curve_posterior.png", dpi=100)
print("wrote", OUT / "06_curve_posterior.png")
