# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Ensemble Model Patching: calibration of a BatchNorm network
#
# Chang et al., *Ensemble Model Patching*, in the small: a BatchNorm MLP on scikit-learn's
# digits, made Bayesian by patching only its BatchNorm affine parameters and its output layer
# with a mixture of `K = 5` components (EMP: one component per layer and draw; ECMP: one per
# weight element). We compare the reliability diagrams of the vanilla network, MC dropout, EMP
# and ECMP, as the paper's Figures 5–6, on the clean test set and on digits rotated by 30°.
#
# 1. `PatchedNet` is a Pyro model with a guide: `SVI(model, model.guide, Adam, Trace_ELBO())`
#    minimises the expected NLL plus the L2 penalty of eq. (7) on the component means;
# 2. `PatchedNet.fit` runs the same objective as a plain torch loop (the paper's "simply enforce
#    L2 regularization"), which is what the training below uses;
# 3. predictions average `S` Monte Carlo draws of the weights (Algorithm 1), vectorised.
#
# Run it as a script (`python tutorials/04_ensemble_patching.py` or `pyro-subspace tutorial 04`);
# `PYRO_SUBSPACE_TINY=1` shrinks every setting for a smoke test.

# %%
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_subspace import PatchedNet, datasets, likelihoods, metrics
from pyro_subspace.infer import TemperatureScaling

# benchmarks/ (in the source checkout, not installed) holds the experiment protocols
ROOT = Path(__file__).resolve().parents[1] if "__file__" in globals() else Path.cwd().parent
sys.path.insert(0, str(ROOT))
from benchmarks.ood import rotated_digits
from benchmarks.protocols import bn_mlp, train_method

TINY = os.environ.get("PYRO_SUBSPACE_TINY") == "1"
OUT = Path(os.environ.get("PYRO_SUBSPACE_OUT", "out"))
OUT.mkdir(parents=True, exist_ok=True)
EPOCHS, S, SVI_STEPS = (6, 10, 5) if TINY else (200, 100, 300)
torch.set_num_threads(1)  # a 64-128-128-10 MLP runs fastest on one thread
torch.manual_seed(0)
pyro.set_rng_seed(0)

# %% [markdown]
# ## The model and its patches
# `patches="auto"` patches every normalisation layer and the output layer (section 3.3). The
# parameter overhead is `2(K-1)N₂` per BatchNorm layer of `N₂` units plus `(K-1)(I+1)O` for the
# output layer: here 27% of a very small network, a fraction of a percent of a ResNet's.

# %%
data = datasets.digits(seed=0)
net = bn_mlp(64, 10, seed=0)
model = PatchedNet(net, likelihoods.Categorical(), mode="ecmp", n_components=5)
print("patched modules:", model.patched_modules, f"overhead {model.overhead:.2f}%")
for s in model.slots:
    print(f"  {s.name:<10} {s.kind:<7} shape {tuple(s.shape)}")

# %% [markdown]
# ## Pyro's own SVI
# The guide samples the assignment `z` from its fixed uniform distribution (the same as the
# model's, so it adds no KL and no gradient) and then the weights: with the default `sigma=0`
# (the paper fixes σ at machine epsilon) a point mass at the drawn component's means, with a
# positive `sigma` a Gaussian draw by reparameterisation; one draw per step, minibatches via
# `num_data`.

# %%
svi = SVI(model, model.guide, pyro.optim.Adam({"lr": 1e-3}), Trace_ELBO())
model.train()
n = data.n_train
for step in range(SVI_STEPS):
    idx = torch.randint(0, n, (128,))
    loss = svi.step(data.x_train[idx], data.y_train[idx], num_data=n)
    if step % max(1, SVI_STEPS // 3) == 0:
        # the ELBO loss carries a constant C (`elbo_constant`: with σ = 0 the prior's
        # normalising terms, with σ > 0 also the entropy of the narrow components)
        print(f"step {step:4d}  (-ELBO - C) / N = {(loss - model.elbo_constant) / n:.3f}")
model.eval()
pred = Predictive(model, guide=model.guide, num_samples=S, parallel=True)(data.x_test)
print("Predictive sites:", {k: tuple(v.shape) for k, v in pred.items() if k in ("obs", "f")})

# %% [markdown]
# ## Four methods, one protocol
# Adam on its default settings for every method, the same prior (vanilla: weight decay `τ/N`).

# %%
trained = {}
for name in ("vanilla", "dropout", "emp", "ecmp"):
    trained[name] = train_method(name, data, epochs=EPOCHS, seed=0)
shifted = rotated_digits(data, 30)
table = {}
probs = {"clean": {}, "rotated 30°": {}}
for name, t in trained.items():
    torch.manual_seed(1)
    probs["clean"][name] = t.probs(data.x_test, S)
    probs["rotated 30°"][name] = t.probs(shifted, S)
    table[name] = metrics.classification_scores(probs["clean"][name], data.y_test)
    r = table[name]
    print(
        f"{name:<8} overhead {t.overhead:6.2f}%  acc {r['acc']:.3f}  NLL {r['nll']:.3f}  "
        f"ECE {100 * r['ece']:.2f}%  MCE {100 * r['mce']:.1f}%"
    )

# %% [markdown]
# ## Reliability diagrams (Figures 5–6)
# Accuracy against confidence in 20 bins; only bins with more than 5 points, the ones ECE and
# MCE use (appendix D.2). A calibrated model follows the diagonal.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4.8))
for ax, (title, by_method) in zip(axes, probs.items()):
    ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    for name, p in by_method.items():
        conf, acc, count = metrics.reliability_diagram_data(p, data.y_test, n_bins=20)
        keep = count > 5
        ece, _ = metrics.calibration_errors(p, data.y_test)
        ax.plot(conf[keep], acc[keep], "o-", ms=4, label=f"{name} (ECE {100 * ece:.1f}%)")
    ax.set_title(f"digits, {title}")
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.legend(loc="upper left", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "04_ensemble_patching.png", dpi=120)
print("wrote", OUT / "04_ensemble_patching.png")

# %% [markdown]
# ## The cheapest baseline: temperature scaling
# Guo et al. (2017) divide the vanilla network's logits by one temperature `T`, fitted as the
# minimiser of the NLL on held-out data (`TemperatureScaling`; convex in `1/T`, solved exactly);
# the predicted classes, hence the accuracy, do not move. It needs data the network was not
# trained on: here the first half of the test set fits `T`, and the second half scores the
# vanilla network with and without it, beside EMP and ECMP on the same points. One temperature
# fitted on clean digits is not refitted under a shift: `benchmarks/ood_digits.py` scores
# "MAP + TS" beside the Laplace methods on rotated digits.

# %%
half = data.x_test.shape[0] // 2
ts = TemperatureScaling(trained["vanilla"].model).fit(data.x_test[:half], data.y_test[:half])
print(f"T* = {float(ts.temperature):.3f}: validation NLL {ts.nll_before:.3f} -> {ts.nll_after:.3f}")
scored = {name: probs["clean"][name][half:] for name in ("vanilla", "emp", "ecmp")}
with torch.no_grad():
    scored["vanilla + TS"] = ts.predict(data.x_test[half:]).probs.float()
for name, p in scored.items():
    r = metrics.classification_scores(p, data.y_test[half:])
    print(f"{name:<13} acc {r['acc']:.3f}  NLL {r['nll']:.3f}  ECE {100 * r['ece']:.2f}%")

# %% [markdown]
# `benchmarks/patches_digits.py` runs this protocol over three seeds, with an explicit
# ensemble, four rotation angles and `S = 1, 20, 100` (Table 7).
