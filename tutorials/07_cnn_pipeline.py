# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # A BatchNorm CNN through the whole pipeline, on one process or several
#
# A ResNet-style CNN (BatchNorm, in-place ReLU, skip connections) on 3x32x32 images, through
# every method of the package: SWA + PCA + elliptical slice sampling with the BatchNorm refresh
# (Subspace Inference), diag-Laplace subnetwork selection + full-covariance Laplace
# (Subnetwork Inference), a K-FAC Laplace over every layer (Ritter et al. 2018; MoLA's
# Algorithm 1), the top GGN eigenpairs by Lanczos, a last-layer mixture of Laplace
# approximations (MoLA) and ECMP patches (Ensemble Model Patching).
#
# Run it as a script (`pyro-subspace tutorial 07`; `PYRO_SUBSPACE_TINY=1` shrinks it), or on
# two processes: `torchrun --nproc_per_node 2 tutorials/07_cnn_pipeline.py`. Under `torchrun`
# each rank holds half the training data (`distributed.shard`) and every full-data sum (the
# likelihood, its gradient, the GGN) is all-reduced, so every rank gets the same numbers as
# one process would. Training (MAP/SWA, the patches) here runs the same steps on every rank
# on all the data (fixed shuffling seeds: without one, each rank would shuffle differently); for data too big for that, wrap the network in
# `DistributedDataParallel`.

# %%
import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pyro
import torch
import torch.distributed as dist
from pyro.infer import MCMC
from torch import nn

from pyro_subspace import (
    EllipticalSliceSampler,
    PatchedNet,
    SubspaceNet,
    distributed,
    fit_map,
    likelihoods,
    subspaces,
)
from pyro_subspace.infer import AutoSubspaceLaplace, Laplace, MixtureOfLaplace

TINY = os.environ.get("PYRO_SUBSPACE_TINY") == "1"
OUT = Path(os.environ.get("PYRO_SUBSPACE_OUT", "out"))
torch.set_num_threads(1)
if "RANK" in os.environ and not dist.is_initialized():  # launched by torchrun
    dist.init_process_group("gloo")
rank, world = distributed.world()
N, WIDTH = (64, 4) if TINY else (512, 16)
EPOCHS, SWA_EPOCHS, DRAWS, SUBNET = (2, 4, 10, 100) if TINY else (10, 10, 100, 1000)


def say(*args):
    if rank == 0:
        print(*args)


# %% [markdown]
# ## The network and synthetic data
# The class depends on the mean brightness of a corner of the red channel.


# %%
class Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1, self.bn1 = (
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.conv2, self.bn2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.skip = nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
        )

    def forward(self, x):
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + self.skip(x))


def make_net():
    w = WIDTH
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
        Block(w, 2 * w, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, 3),
    )  # fmt: skip


gen = torch.Generator().manual_seed(0)
x = torch.randn(N, 3, 32, 32, generator=gen)
y = torch.bucketize(x[:, 0, :8, :8].mean((1, 2)), torch.tensor([-0.05, 0.05]))
x_shard, y_shard = distributed.shard(x), distributed.shard(y)  # all of it on one process
torch.manual_seed(0)
net, lik = make_net(), likelihoods.Categorical()
say(f"{world} process(es); D = {sum(p.numel() for p in net.parameters()):,} weights, N = {N}")
times = {}

# %% [markdown]
# ## SWA + PCA + elliptical slice sampling with the BatchNorm refresh

# %%
start = time.perf_counter()
collector = subspaces.SWACollector(net, max_snapshots=SWA_EPOCHS)
fit_map(net, lik, x, y, epochs=EPOCHS, batch_size=32, lr=0.05, optimizer="sgd",
        collector=collector, swa_epochs=SWA_EPOCHS, swa_lr=0.02, seed=0, progress=False)  # fmt: skip
pca = subspaces.pca(collector, 3)
model = SubspaceNet(net, pca, lik, temperature="auto")
pyro.set_rng_seed(0)
mcmc = MCMC(
    EllipticalSliceSampler(model, recompute_bn=True), DRAWS, DRAWS // 2, disable_progbar=True
)
mcmc.run(x_shard, y_shard)
draws = mcmc.get_samples()["t"]
times["SWA + PCA + ESS"] = time.perf_counter() - start
say("ESS draws in the PCA subspace: mean", draws.mean(0))

# %% [markdown]
# ## Subnetwork selection and a full-covariance Laplace over it

# %%
start = time.perf_counter()
sub = subspaces.subnetwork(net, SUBNET, strategy="diag_laplace", likelihood=lik, x=x_shard)
guide = AutoSubspaceLaplace(SubspaceNet(net, sub, lik), prior_precision=1.0).fit(
    x_shard, y_shard, find_map=False
)
times["subnetwork Laplace"] = time.perf_counter() - start
std = guide.covariance.diagonal().sqrt()
say(
    f"subnetwork Laplace over {SUBNET} weights; evidence {float(guide.log_marginal_likelihood()):.2f}"
)

# %% [markdown]
# ## A K-FAC Laplace over every layer
#
# A full covariance over all `D` weights is `D²` numbers, and a diagonal one ignores every
# correlation. K-FAC keeps one Kronecker-factored block `G ⊗ A` per `Conv2d` and `Linear` layer
# (`G` from the back-propagated output-Hessian factor, `A` from the layer's inputs: one pass
# over the data, summed over the ranks) and the exact GGN diagonal for the BatchNorm
# parameters; the prior is added exactly in each block's eigenbasis, so the evidence and its
# gradient in `λ` cost `O(D)` per step (`prior_structure="layerwise"`: one `λ` per parameter
# tensor). The GLM predictive goes layer by layer, from each layer's inputs and output
# Jacobians, never an `N × O × D` Jacobian; `pred_type="nn"` draws weights and runs the
# network, as Ritter et al.'s KFAC-Laplace predicts.

# %%
start = time.perf_counter()
kron = Laplace(net, lik, "all", "kron", prior_precision=1.0).fit(x_shard, y_shard)
kron.optimize_prior_precision(method="marglik", prior_structure="layerwise")
probs_glm = kron(x[:64], link_approx="probit")
probs_nn = kron(x[:64], pred_type="nn", n_samples=8 if TINY else 64,
                generator=torch.Generator().manual_seed(0))  # fmt: skip
times["all-layer K-FAC Laplace"] = time.perf_counter() - start
say(
    f"K-FAC over all {kron.n_params:,} weights in {len(kron.guide.posterior.blocks())} blocks; "
    f"evidence {float(kron.log_marginal_likelihood()):.2f}; mean confidence "
    f"GLM {float(probs_glm.max(-1).values.mean()):.3f}, sampled {float(probs_nn.max(-1).values.mean()):.3f}"
)

# %% [markdown]
# ## Top GGN eigenpairs (Lanczos) and a last-layer mixture of Laplace approximations

# %%
start = time.perf_counter()
eig = subspaces.ggn_eigen(net, lik, x_shard, 5 if TINY else 20, num_iter=20 if TINY else None)
times["GGN eigenpairs"] = time.perf_counter() - start
start = time.perf_counter()
torch.manual_seed(1)
second = make_net()
fit_map(
    second,
    lik,
    x,
    y,
    epochs=EPOCHS,
    batch_size=32,
    lr=0.05,
    optimizer="sgd",
    seed=1,
    progress=False,
)
mola = MixtureOfLaplace([net, second], lik).fit(x_shard, y_shard)
times["last-layer MoLA"] = time.perf_counter() - start
say("GGN eigenvalues:", eig.eigenvalues)
say("MoLA member log-evidences:", mola.log_evidences)

# %% [markdown]
# ## A curvature subspace from K-FAC's Kronecker eigenbasis
#
# Lanczos needs tens of GGN-vector products, each a forward and two backward passes over the
# data. K-FAC's block `G ⊗ A` of a layer has the eigenvectors `v_i ⊗ u_j` with eigenvalues
# `μ_i λ_j` (`G v_i = μ_i v_i`, `A u_j = λ_j u_j`), so one K-FAC pass and an eigendecomposition
# of each small factor give the top directions of the block-diagonal approximation, across
# layers (`subspaces.kfac_eigen`). They are stored as their Kronecker factors, not as a `D × K`
# matrix. `eigenvalues="ekfac"` re-estimates each direction's eigenvalue on the exact GGN,
# `pᵀ G p` (EK-FAC, George et al. 2018): with orthonormal columns their sum is `tr(QᵀGQ)`, the
# GGN mass the subspace captures, to compare with the sum of the top Lanczos eigenvalues.
# Elliptical slice sampling (and every guide) runs in it as in any other subspace.

# %%
start = time.perf_counter()
keig = subspaces.kfac_eigen(net, lik, x_shard, eig.rank, eigenvalues="ekfac")
times["K-FAC eigenbasis"] = time.perf_counter() - start
stored = keig.left.numel() + keig.right.numel()  # the Kronecker factors of its columns
captured = float(keig.eigenvalues.sum() / eig.eigenvalues.sum())
say(
    f"K-FAC eigenbasis: {keig.rank} columns, factors of {stored:,} numbers (a dense basis: "
    f"{keig.dim * keig.rank:,}); {100 * captured:.0f}% of the top-{eig.rank} GGN eigenvalue mass"
)
pyro.set_rng_seed(0)
mcmc_k = MCMC(
    EllipticalSliceSampler(SubspaceNet(net, keig, lik, temperature="auto"), recompute_bn=True),
    DRAWS // 2, DRAWS // 4, disable_progbar=True,
)  # fmt: skip
mcmc_k.run(x_shard, y_shard)
say("ESS draws in the K-FAC eigenbasis: std", mcmc_k.get_samples()["t"].std(0))

# %% [markdown]
# ## ECMP patches on the BatchNorm and output layers

# %%
start = time.perf_counter()
patched = PatchedNet(net, lik, mode="ecmp", n_components=5, init="copy")
patched.fit(x, y, epochs=1 if TINY else 5, batch_size=32, seed=0)
accuracy = float((patched.predictive_mean(x, 10).argmax(-1) == y).double().mean())
times["ECMP patches"] = time.perf_counter() - start
say(f"ECMP training accuracy {accuracy:.2f}")

# %% [markdown]
# ## Where the time went

# %%
if rank == 0:
    OUT.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].barh(list(times), list(times.values()))
    axes[0].set_xlabel("seconds")
    axes[0].set_title(f"{world} process(es), N = {N}")
    axes[1].semilogy(eig.eigenvalues.detach().numpy(), "o-", label="Lanczos")
    axes[1].semilogy(keig.eigenvalues.detach().numpy(), "s-", label="K-FAC basis (EK-FAC)")
    axes[1].legend()
    axes[1].set_title("top GGN eigenvalues")
    axes[2].hist(std.numpy(), bins=20)
    axes[2].set_title(f"subnetwork posterior std ({SUBNET} weights)")
    fig.tight_layout()
    fig.savefig(OUT / "07_cnn_pipeline.png", dpi=80)
    print(f"wrote {OUT / '07_cnn_pipeline.png'}")
if dist.is_initialized():
    dist.destroy_process_group()
