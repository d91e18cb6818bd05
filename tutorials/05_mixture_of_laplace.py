# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Mixtures of Laplace approximations over a deep ensemble
#
# Eschenhagen et al. (2021), *Mixtures of Laplace Approximations for Improved Post-Hoc
# Uncertainty in Deep Learning* (MoLA), on a problem small enough to see everything:
#
# 1. train a deep ensemble, `K` networks from different seeds (`train_ensemble`, eq. 3);
# 2. put a last-layer Laplace approximation around each (`MixtureOfLaplace`): the mixture
#    posterior of eq. (7), predicted with the mixture of multi-class probit approximations
#    (eq. 1), checked against Monte Carlo;
# 3. look "far away" from the data, at `δ·x` for growing `δ` (section B.1): a ReLU network's
#    MAP confidence tends to 1, the deep ensemble's too, while the Laplace approximations stay
#    below a bound computed from their covariances (Lemma 1, Theorem 2);
# 4. compare with SWAG and MultiSWAG from the same networks, and try the evidence-based
#    mixture weights the paper discusses (B.2, E.1).
#
# Run it as a script (`python tutorials/05_mixture_of_laplace.py`); `PYRO_SUBSPACE_TINY=1`
# shrinks every setting for a smoke test.

# %%
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import nn

from pyro_subspace import datasets, likelihoods, metrics
from pyro_subspace.infer import (
    DeepEnsemble,
    LastLayerLaplace,
    MixtureOfLaplace,
    MultiSWAG,
    far_away_confidence_bound,
    train_ensemble,
)

TINY = os.environ.get("PYRO_SUBSPACE_TINY") == "1"
OUT = Path(os.environ.get("PYRO_SUBSPACE_OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
K = 3 if TINY else 5
EPOCHS, SWA_EPOCHS = (30, 4) if TINY else (300, 20)
torch.manual_seed(0)

# %% [markdown]
# ## Data and an ensemble of ReLU networks
# Three Gaussian blobs in the plane. The networks have no biases, the setting of the paper's
# analysis (B.1): a bias-free ReLU network is positively homogeneous, `f(δx) = δ f(x)`, so its
# logits grow linearly along every ray and its MAP confidence tends to 1. Weight decay `wd` on
# the mean loss of `N` points is the Gaussian prior `N(0, (N·wd)⁻¹ I)`, whose MAP the
# networks are; the Laplace approximations use that same prior.

# %%
n = 150
centres = torch.tensor([[2.0, 0.0], [-1.0, 1.7], [-1.0, -1.7]])
y = torch.arange(n) % 3
x = centres[y] + 0.7 * torch.randn(n, 2)
weight_decay = 5e-3
prior_precision = n * weight_decay


def make_net():
    return nn.Sequential(
        nn.Linear(2, 32, bias=False), nn.ReLU(), nn.Linear(32, 32, bias=False), nn.ReLU(),
        nn.Linear(32, 3, bias=False),
    )  # fmt: skip


lik = likelihoods.Categorical()
ensemble = train_ensemble(
    make_net, lik, x, y, n_members=K, collector=True, swa_epochs=SWA_EPOCHS, swa_lr=0.01,
    epochs=EPOCHS, lr=0.01, weight_decay=weight_decay, batch_size=32,
)  # fmt: skip
print("final training losses:", [round(h[EPOCHS - 1], 3) for h in ensemble.losses])

# %% [markdown]
# ## MAP, deep ensemble, LLLA and MoLA
# Every predictor answers `predict(x)` with a `torch.distributions.Categorical` (`.probs` `(N, C)`); `components(x)`
# gives the mixture weights and each component's probabilities. MoLA's default predictive is
# the probit mixture of eq. (1); `method="mc"` averages the softmax over draws of each
# component's Gaussian over the logits, `method="sample"` over weight draws pushed through the
# network (eq. 4).

# %%
methods = {
    "MAP": DeepEnsemble(ensemble.nets[:1], lik),
    "DE": DeepEnsemble(ensemble.nets, lik),
    "LLLA": LastLayerLaplace(ensemble.nets[0], lik, prior_precision=prior_precision).fit(x, y),
    "MoLA": MixtureOfLaplace(ensemble.nets, lik, prior_precision=prior_precision).fit(x, y),
    "MultiSWAG": MultiSWAG(ensemble.collectors, lik, num_samples=30),
}
x_test = centres[torch.arange(60) % 3] + 0.7 * torch.randn(60, 2)
y_test = torch.arange(60) % 3
for name, method in methods.items():
    p = method.predict(x_test).probs
    print(f"{name:>9}: accuracy {metrics.accuracy(p, y_test):.3f}, NLL "
          f"{metrics.categorical_nll(p, y_test):.3f}, MMC {metrics.mmc(p):.3f}")  # fmt: skip
mola = methods["MoLA"]
probit, mc = mola.predict(x_test).probs, mola.predict(x_test, method="mc", num_samples=2000).probs
print("largest |probit − Monte Carlo| on the test points:", float((probit - mc).abs().max()))

# %% [markdown]
# ## Far away from the data
# Scale test inputs by `δ` and watch the mean maximum probability. Lemma 1 (one Gaussian) and
# Theorem 2 (the mixture) bound the limit: with `μ_(i)`, `Σ_(i)` the posterior mean and
# covariance of row `i` of the last weight matrix, `b_i = ‖μ_(i)‖ / √(π/8 · λ_min(Σ_(i)))` and
# the confidence stays below `Σ_k π_k max_c 1 / (1 + Σ_{i≠c} exp(−(b_i + b_c)))`.

# %%
deltas = torch.logspace(-1, 4, 11 if TINY else 26)
directions = torch.randn(200, 2)
names = ("MAP", "DE", "MultiSWAG", "LLLA", "MoLA")
conf = {
    name: [metrics.mmc(methods[name].predict(d * directions).probs) for d in deltas] for name in names
}
bounds = {name: far_away_confidence_bound(methods[name]) for name in ("LLLA", "MoLA")}
for name, values in conf.items():
    print(f"{name:>9}: MMC at δ = {deltas[-1]:.0e}: {values[-1]:.4f}")
print("bounds (B.1):", {k: round(v, 4) for k, v in bounds.items()})

fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
ax = axes[0]
styles = {"MAP": "k-", "DE": "C0-", "MultiSWAG": "C2-", "LLLA": "C1-", "MoLA": "C3-"}
for name, values in conf.items():
    ax.plot(deltas, values, styles[name], label=name, lw=2)
for name, colour in (("LLLA", "C1"), ("MoLA", "C3")):
    ax.axhline(bounds[name], color=colour, ls="--", lw=1, label=f"{name} bound (B.1)")
ax.set_xscale("log")
ax.set_xlabel("δ (inputs δ·x)")
ax.set_ylabel("mean max probability")
ax.set_title("Far-away confidence (MoLA B.1)")
ax.legend(fontsize=8, loc="lower right")

# the confidence over the plane, MoLA vs the deep ensemble
grid = torch.linspace(-12, 12, 60 if TINY else 150)
gx, gy = torch.meshgrid(grid, grid, indexing="xy")
plane = torch.stack([gx.reshape(-1), gy.reshape(-1)], 1)
gap = (methods["DE"].predict(plane).probs - methods["MoLA"].predict(plane).probs).max(-1).values
ax = axes[1]
mesh = ax.contourf(gx, gy, methods["MoLA"].predict(plane).probs.max(-1).values.reshape(gx.shape),
                   levels=torch.linspace(1 / 3, 1, 15).tolist(), cmap="viridis")  # fmt: skip
ax.scatter(x[:, 0], x[:, 1], c=y, cmap="tab10", s=8, edgecolors="white", linewidths=0.3)
fig.colorbar(mesh, ax=ax, label="MoLA max probability")
ax.set_title("MoLA confidence over the plane")
fig.tight_layout()
path = OUT / "mixture_of_laplace_far_away.png"
fig.savefig(path, dpi=120)
print("saved", path, "; mean (DE − MoLA) confidence on the plane:", float(gap.mean()))

# %% [markdown]
# ## Mixture weights from the evidence
# Weighting each member by its Laplace marginal likelihood (`weights="evidence"`) is the model
# selection view of E.1: `π_k = p(D | M_k) / Σ_j p(D | M_j)`. When the evidences differ by
# many nats, as the paper reports for its networks, the weights collapse onto one member and
# MoLA becomes LLLA around it; that is why the paper uses uniform weights. Small networks on an
# easy problem can have nearly equal evidences, and then the weights stay close to uniform.

# %%
mola_ev = MixtureOfLaplace(ensemble.nets, lik, weights="evidence", prior_precision=prior_precision)
mola_ev.fit(x, y)
print("log evidences:", [round(v, 1) for v in mola_ev.log_evidences.tolist()])
print("evidence weights:", [round(v, 3) for v in mola_ev.weights.tolist()])

# %% [markdown]
# ## Out-of-distribution digits
# The same recipe on scikit-learn's 8x8 digits, uniform-noise images as OOD inputs; see
# `benchmarks/ood_digits.py` for the full comparison (five seeds, six OOD sets, the rotation
# shift curve). Here the prior precision is tuned as in the paper's Appendix F: the smallest
# `λ` whose mean validation confidence reaches the ensemble's validation accuracy minus 0.01.

# %%
digits = datasets.digits(seed=0)
x_tr, y_tr = digits.x_train[:1200], digits.y_train[:1200]
x_val, y_val = digits.x_train[1200:], digits.y_train[1200:]
gen = torch.Generator().manual_seed(0)  # uniform raw pixels, as benchmarks/ood.py's "noise"
noise = (16.0 * torch.rand(digits.x_test.shape, generator=gen) - digits.x_mean) / digits.x_std
digit_nets = train_ensemble(
    lambda: nn.Sequential(nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10)), lik, x_tr, y_tr,
    n_members=K, epochs=5 if TINY else 60, lr=1e-3, weight_decay=5e-4, batch_size=64,
).nets  # fmt: skip
de = DeepEnsemble(digit_nets, lik)
mola_digits = MixtureOfLaplace(digit_nets, lik, prior_precision=1200 * 5e-4).fit(x_tr, y_tr)
mola_digits.optimize_prior_precision("confidence", x_val, y_val)
print(f"tuned λ = {mola_digits.prior_precision:.3g}")
for name, method in (("DE", de), ("MoLA", mola_digits)):
    p_in, p_out = method.predict(digits.x_test).probs, method.predict(noise).probs
    print(f"{name:>5}: test accuracy {metrics.accuracy(p_in, digits.y_test):.3f}, "
          f"noise MMC {metrics.mmc(p_out):.3f}, AUROC {metrics.ood_auroc(p_in, p_out):.3f}")  # fmt: skip
