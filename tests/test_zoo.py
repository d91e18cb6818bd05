"""Every curvature path on the architectures people use, against dense float64 computations.

Tiny float32 instances of an MLP, a ResNet-style CNN (BatchNorm, in-place ReLU, a skip
connection), an LSTM (float32 on CPU runs mkldnn, which has no forward-mode derivative), a GRU
and a transformer encoder (fused fast path in eval mode). The reference is the dense GGN
``G = Σ_n J_nᵀ H_n J_n`` from full Jacobians of a float64 copy of the network (reverse mode,
one output at a time) and ``H_n = diag(p_n) − p_n p_nᵀ`` (Categorical).

Tolerance: the package works in float32 (eps 6e-8); a few hundred rounded operations per
entry give relative errors near 1e-5, so ``1e-4 · max|reference|`` is used throughout.
"""

import math

import pytest
import torch
from pyro.infer import MCMC
from torch import nn

from pyro_subspace import EllipticalSliceSampler, PatchedNet, SubspaceNet, likelihoods, subspaces
from pyro_subspace.curvature.autodiff import strategy_of
from pyro_subspace.curvature import ggn_diagonal, ggn_vector_product
from pyro_subspace.flat import FlatNet
from pyro_subspace.infer import AutoSubspaceLaplace
from pyro_subspace.subspaces import LastLayerSubspace

N, C, LAM = 6, 2, 1.0
RTOL = 1e-4


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(4, C)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        h = self.relu(h + self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


class Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn, self.head = cell(3, 4, batch_first=True), nn.Linear(4, C)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
        self.embed, self.encoder = nn.Linear(3, 4), nn.TransformerEncoder(layer, 1)
        self.head = nn.Linear(4, C)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


def make(name):
    torch.manual_seed(0)
    if name == "mlp":
        net, x = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, C)), torch.randn(N, 3)
    elif name == "resnet":
        net, x = Res(), torch.randn(N, 2, 4, 4)
        with torch.no_grad():  # non-trivial running statistics
            for _ in range(3):
                net(torch.randn(8, 2, 4, 4) * 2 + 0.5)
    elif name in ("lstm", "gru"):
        net, x = Recurrent(nn.LSTM if name == "lstm" else nn.GRU), torch.randn(N, 4, 3)
    else:
        net, x = Encoder(), torch.randn(N, 4, 3)
    net.eval()
    return net, x, torch.arange(N) % C


def dense_ggn(net, x):
    """``G`` (D, D) float64 from full Jacobians of a float64 copy, and the outputs (N, C)."""
    import copy

    net64 = copy.deepcopy(net).double()
    flat = FlatNet(net64)
    w, x64 = flat.vector(), x.double()
    out = flat(w, x64)
    jac = torch.autograd.functional.jacobian(lambda v: flat(v, x64), w)  # (N, C, D)
    p = out.softmax(-1)
    h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    return torch.einsum("ncd,nce,nef->df", jac, h, jac), out


def close(got, want, what, scale=None):
    """``max|got − want| <= RTOL · scale`` (default ``max|want|``; blocks of ``G`` use
    ``max|G|``: a selected block may be all but zero, e.g. attention's key bias)."""
    err = float((got.double() - want).abs().max())
    scale = float(want.abs().max()) if scale is None else float(scale)
    assert err <= RTOL * scale, f"{what}: error {err:.3g} vs scale {scale:.3g}"


NETS = ["mlp", "resnet", "lstm", "gru", "transformer"]


@pytest.mark.parametrize("name", NETS)
def test_curvature_paths_match_dense(name):
    net, x, y = make(name)
    lik = likelihoods.Categorical()
    g, out = dense_ggn(net, x)
    d = g.shape[0]
    v = torch.randn(d)
    close(ggn_vector_product(net, lik, x, v), g @ v.double(), "G v")
    diag = ggn_diagonal(net, lik, x)
    close(diag, g.diagonal(), "diag(G)")
    if name in ("lstm", "transformer"):  # forward AD is unsupported there: a fallback ran
        assert strategy_of(net) != "forward"

    # subnetwork selection (largest diagonal-Laplace variances) and subnetwork Laplace
    sub = subspaces.subnetwork(net, 8, strategy="diag_laplace", likelihood=lik, x=x)
    var = 1 / (g.diagonal() + LAM)
    assert float(var[sub.basis].min()) >= float(var.sort().values[-8]) * (1 - RTOL)
    guide = AutoSubspaceLaplace(SubspaceNet(net, sub, lik), prior_precision=LAM)
    guide.fit(x, y, find_map=False)
    close(guide.ggn, g[sub.basis][:, sub.basis], "subnetwork PᵀGP", g.abs().max())

    # last-layer Laplace
    last = LastLayerSubspace(net)
    guide = AutoSubspaceLaplace(SubspaceNet(net, last, lik), prior_precision=LAM)
    guide.fit(x, y, find_map=False)
    close(guide.ggn, g[last.basis][:, last.basis], "last-layer PᵀGP", g.abs().max())

    # a dense subspace (K forward-mode products per chunk, or their fallback)
    rand = subspaces.random(net, 3, seed=0)
    model = SubspaceNet(net, rand, lik)
    p = rand.basis.double()
    close(model.evaluator(x, y).ggn(torch.zeros(3)), p.T @ g @ p, "dense PᵀGP")

    # Lanczos top eigenpairs (num_iter = D: exact up to rounding)
    eig = subspaces.ggn_eigen(net, lik, x, 2, num_iter=d)
    want = torch.linalg.eigvalsh(g).flip(0)[:2]
    close(eig.eigenvalues, want, "GGN eigenvalues")
    u = eig.basis.double()
    residual = (g @ u - u * eig.eigenvalues.double()).abs().max()
    assert residual <= RTOL * 10 * want[0], residual  # vectors: 10x looser (small gaps)

    # the elliptical slice sampler's likelihood, and a short chain
    t = torch.tensor([0.3, -0.2, 0.1])
    logp = torch.log_softmax(_out64(net, rand, t, x), -1)[torch.arange(N), y].sum()
    close(torch.tensor(model.evaluator(x, y).log_likelihood(t)), logp, "log p")
    kernel = EllipticalSliceSampler(model, recompute_bn=name == "resnet")
    mcmc = MCMC(kernel, 4, 0, disable_progbar=True)
    mcmc.run(x, y)
    assert torch.isfinite(mcmc.get_samples()["t"]).all()


def _out64(net, sub, t, x):
    import copy

    net64 = copy.deepcopy(net).double()
    return FlatNet(net64)(sub.weights(t).double(), x.double())


@pytest.mark.parametrize("name", NETS)
def test_patched_net_draws_match_a_loop(name):
    net, x, y = make(name)
    model = PatchedNet(net, likelihoods.Categorical(), mode="ecmp", n_components=2, seed=0)
    model.eval()
    draws = model.sample_weights(3)
    weights = {s.name: draws[s.site] for s in model.slots}
    with torch.no_grad():
        batched = model.outputs(weights, x)
        looped = [model.outputs({k: v[i] for k, v in weights.items()}, x) for i in range(3)]
    looped = torch.stack(looped)
    close(batched, looped.double(), "PatchedNet outputs")
    # one full-batch epoch = one Adam step: every mean moves by at most lr (Adam's first step is
    # lr·g/(|g| + eps) per coordinate), and the ones with a gradient move by about lr
    before = {k: v.detach().clone() for k, v in model.means().items()}
    hist = model.fit(x, y, epochs=1, batch_size=N, lr=1e-3)
    assert len(hist) == 1 and math.isfinite(hist[0])
    moved = torch.cat([(v.detach() - before[k]).abs().flatten() for k, v in model.means().items()])
    # float32: θ + Δ and its difference round by up to 2 eps·|θ|
    slack = 2 * torch.finfo(torch.float32).eps * max(float(v.abs().max()) for v in before.values())
    assert 0.9e-3 < float(moved.max()) <= 1e-3 + slack
