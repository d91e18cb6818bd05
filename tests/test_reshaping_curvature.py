"""The curvature contract for networks that reshape their batch, every structure and subset.

A network may give a layer more (or fewer) rows than it has data points: a Bradley–Terry
scorer applied to pairs (``(B, 2, d) → (2B, d) → (B, 2)``), a set network pooling after a
per-element layer, per-token layers on ``(B·L, d)``, a layer applied twice, a batch cut into
rows and joined again, a convolution on a reshaped batch of images. Every fast path that
assumes one row per data point (the ``nn.Linear`` selected-weight Jacobians, the last layer's
closed form, the K-FAC predictive's layer passes) must check that and otherwise take the
general path; K-FAC keeps its factors there, each call's rows being more rows of the sums, as
curvlinops (laplace-torch's default backend) computes them. Each structure against its own
oracle, float64, on a zoo of such networks (``ZOO``):

- ``full`` and ``diag`` (subsets ``"all"``, flat indices, ``"last_layer"``, a dense random
  basis): ``PᵀGP`` and its diagonal, ``G = Σ_n J_nᵀ H_n J_n`` from brute-force ``jacrev``
  Jacobians of each data point alone;
- ``lowrank``: the brute-force GGN's top eigenpairs (the truncation ``U_k diag(l_k) U_kᵀ``);
- ``kron``: the per-layer definition formed by brute force, each data point alone:
  ``A = (1/N) Σ_n Σ_calls Σ_rows a aᵀ / R`` (``R`` a row's locations: a convolution's patches)
  and ``G = Σ_n Σ_calls Σ_rows J_{n,r}ᵀ H_n J_{n,r}`` with ``J_{n,r} = ∂f_n/∂z_r`` at the
  layer's output row ``r``; and laplace-torch's ``KronLaplace`` with the ``CurvlinopsGGN``
  backend (expand; skipped without laplace-torch);
- the GLM predictive's ``J Σ Jᵀ`` of every structure, against brute-force Jacobians of the
  test points and the posterior's own ``Σ``.

Tolerance: ``1e-8`` relative (``max |a − b| / max |b|``) for the exact structures and the
predictive, ``1e-6`` against laplace-torch; float64 rounding gives about ``1e-15``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

from pyro_subspace import infer, likelihoods, subspaces
from pyro_subspace.infer import linearized_moments
from pyro_subspace.subspaces import last_layer_indices

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
B, LAM = 6, 0.5
EXACT = 1e-8
VS_LAPLACE_TORCH = 1e-6


class Pairs(nn.Module):
    """A reward model's scorer on both items of a pair: ``(B, 2, 3) → (2B, 3) → (B, 2)``;
    ``transposed`` orders the rows item-major (``(2, B)``), not pair-major."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        self.score = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x):
        b = x.shape[0]
        if self.transposed:
            return self.score(x.transpose(0, 1).reshape(-1, 3)).reshape(2, b).T
        return self.score(x.reshape(-1, 3)).reshape(b, 2)


class Sets(nn.Module):
    """Deep sets: a per-element layer on ``(B·S, d)``, mean-pooled, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.phi, self.rho = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x):
        b, k, d = x.shape
        return self.rho(torch.tanh(self.phi(x.reshape(b * k, d))).reshape(b, k, -1).mean(1))


class Tokens(nn.Module):
    """A per-token layer on ``(B·L, d)``, the tokens concatenated for the head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.head = nn.Linear(3, 5), nn.Linear(15, 2)

    def forward(self, x):
        b, l, d = x.shape
        return self.head(torch.tanh(self.tok(x.reshape(b * l, d))).reshape(b, -1))


class Twice(nn.Module):
    """One layer applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.layer(torch.tanh(self.layer(x)))))


class RowsAndBack(nn.Module):
    """The batch cut into rows of half width and joined again: ``(B, 4) → (2B, 2) → (B, 6)``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer, self.head = nn.Linear(2, 3), nn.Linear(6, 2)

    def forward(self, x):
        b = x.shape[0]
        return self.head(torch.tanh(self.layer(x.reshape(2 * b, 2))).reshape(b, 6))


class ConvPairs(nn.Module):
    """A convolution on pairs of images: ``(B, 2, 1, 4, 4) → (2B, 1, 4, 4)`` (5-D inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(1, 2, 3), nn.Linear(16, 2)

    def forward(self, x):
        b = x.shape[0]
        return self.head(torch.tanh(self.conv(x.reshape(2 * b, 1, 4, 4))).reshape(b, -1))


ZOO = {
    "pairs": (Pairs, (B, 2, 3)),
    "pairs_item_major": (lambda: Pairs(transposed=True), (B, 2, 3)),
    "sets": (Sets, (B, 3, 3)),
    "tokens": (Tokens, (B, 3, 3)),
    "twice": (Twice, (B, 4)),
    "rows_and_back": (RowsAndBack, (B, 4)),
    "conv_pairs": (ConvPairs, (B, 2, 1, 4, 4)),
}


def _problem(name: str):
    """``(net, x, y, x_test)``, float64, the targets classes of the net's outputs."""
    torch.manual_seed(1)
    make, shape = ZOO[name]
    net = make().to(F64)
    x, x_test = torch.randn(shape, dtype=F64), torch.randn(shape, dtype=F64)
    with torch.no_grad():
        classes = net(x).shape[1]
    return net, x, torch.randint(0, classes, (shape[0],)), x_test


def _functional(net: nn.Module):
    """``(θ (D,), f(θ, x_n) (O,))``: the network of one data point at flat weights."""
    names = [n for n, _ in net.named_parameters()]
    params = [p.detach() for p in net.parameters()]
    theta = torch.cat([p.reshape(-1) for p in params])

    def f(th: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        parts = th.split([p.numel() for p in params])
        weights = {n: t.reshape(p.shape) for n, t, p in zip(names, parts, params)}
        return functional_call(net, weights, (xn[None],))[0]

    return theta, f


def _softmax_hessian(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits, -1)
    return torch.diag(p) - torch.outer(p, p)


def _jacobians(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``∂f(x_n)/∂θ`` ``(N, O, D)``, each data point alone (``jacrev``)."""
    theta, f = _functional(net)
    return torch.stack([jacrev(f)(theta, xn) for xn in x])


def _ggn(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``G = Σ_n J_nᵀ H_n J_n`` ``(D, D)`` (Categorical)."""
    theta, f = _functional(net)
    jac = _jacobians(net, x)
    hess = torch.stack([_softmax_hessian(f(theta, xn)) for xn in x])
    return torch.einsum("nod,nop,npe->de", jac, hess, jac)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _fit(net, x, y, subset, structure, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback, no resize: silence is the contract
        la = infer.Laplace(
            net, likelihoods.Categorical(), subset, structure, prior_precision=LAM, **kwargs
        )
        la.fit(x, y)
    return la


def _basis(subset, net: nn.Module) -> torch.Tensor:
    """``P`` ``(D, K)`` of a subset, as a dense matrix."""
    d = sum(p.numel() for p in net.parameters())
    if isinstance(subset, torch.Tensor):
        return torch.eye(d, dtype=F64)[:, subset]
    if subset == "last_layer":
        return torch.eye(d, dtype=F64)[:, last_layer_indices(net)]
    return torch.eye(d, dtype=F64)


def _subsets(net: nn.Module):
    d = sum(p.numel() for p in net.parameters())
    return {"all": "all", "indices": torch.tensor([0, 3, d // 2, d - 3, d - 1]),
            "last_layer": "last_layer"}  # fmt: skip


@pytest.mark.parametrize("subset_name", ["all", "indices", "last_layer"])
@pytest.mark.parametrize("name", list(ZOO))
def test_full_and_diag_equal_the_brute_force_ggn(name, subset_name):
    net, x, y, _ = _problem(name)
    subset = _subsets(net)[subset_name]
    p = _basis(subset, net)
    ggn = p.T @ _ggn(net, x) @ p
    eye = torch.eye(p.shape[1], dtype=F64)
    full = _fit(net, x, y, subset, "full").posterior_precision
    assert _rel(full - LAM * eye, ggn) < EXACT
    diag = _fit(net, x, y, subset, "diag").posterior_precision
    assert _rel(diag - LAM, ggn.diagonal()) < EXACT


@pytest.mark.parametrize("name", list(ZOO))
def test_a_dense_subspace_gets_the_projected_ggn(name):
    net, x, y, _ = _problem(name)
    sub = subspaces.random(net, rank=4, seed=0)
    p = sub.basis.to(F64)
    la = _fit(net, x, y, sub, "full")
    assert _rel(la.posterior_precision - LAM * p.T @ p, p.T @ _ggn(net, x) @ p) < EXACT


@pytest.mark.parametrize("name", list(ZOO))
def test_lowrank_keeps_the_brute_force_ggn_top_eigenpairs(name):
    net, x, y, _ = _problem(name)
    ggn = _ggn(net, x)
    k = 3
    vals, vecs = torch.linalg.eigh(ggn)
    vals, vecs = vals.flip(0), vecs.flip(1)
    assert vals[k - 1] - vals[k] > 1e-3 * vals[0]  # a gap: the top-k span is well defined
    vals, vecs = vals[:k], vecs[:, :k]
    truncated = vecs @ torch.diag(vals) @ vecs.T
    la = _fit(net, x, y, "all", "lowrank", rank=k)
    assert _rel(la.guide.posterior.curvature(), truncated) < EXACT


def _layer_factors(net: nn.Module, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{layer: (A, G)}`` of every Linear and Conv2d by the per-layer definition (expand),
    each data point run alone: ``A = (1/N) Σ Σ_calls Σ_rows a aᵀ / R``,
    ``G = Σ_n Σ_calls Σ_rows J_{n,r}ᵀ H_n J_{n,r}``."""
    layers = {n: m for n, m in net.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    sums = {n: [0.0, 0.0] for n in layers}
    for xn in x:
        calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

        def hook(name):
            def keep(module, inp, out):
                calls.append((name, inp[0].detach(), out))  # in the graph: ∂f/∂z by autograd

            return keep

        handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
        try:
            f = net(xn[None])[0]
        finally:
            for h in handles:
                h.remove()
        hess = _softmax_hessian(f.detach())
        for name, a, z in calls:
            m = layers[name]
            rows = [torch.autograd.grad(f[o], z, retain_graph=True)[0] for o in range(len(f))]
            jz = torch.stack(rows)  # (O, *z): ∂f_n/∂z
            if isinstance(m, nn.Conv2d):
                u = F.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride)  # (m, P, R)
                r = u.shape[2]
                a_rows = u.transpose(1, 2).reshape(-1, u.shape[1])
                jz = jz.flatten(3).permute(0, 1, 3, 2).reshape(len(f), -1, m.out_channels)
            else:
                r = a[0, ..., 0].numel()
                a_rows = a.reshape(-1, a.shape[-1])
                jz = jz.reshape(len(f), -1, m.out_features)
            sums[name][0] = sums[name][0] + a_rows.T @ a_rows / r / len(x)
            sums[name][1] = sums[name][1] + torch.einsum("orq,op,prs->qs", jz, hess, jz)
    return {n: (a, g) for n, (a, g) in sums.items()}


@pytest.mark.parametrize("name", list(ZOO))
def test_kron_equals_the_per_layer_definition(name):
    net, x, y, _ = _problem(name)
    factors = _layer_factors(net, x)
    d = sum(p.numel() for p in net.parameters())
    expected = torch.zeros(d, d, dtype=F64)
    offsets, start = {}, 0
    for pname, p in net.named_parameters():
        offsets[pname] = (start, start + p.numel())
        start += p.numel()
    for layer, (a, g) in factors.items():
        w0, w1 = offsets[f"{layer}.weight"]
        b0, b1 = offsets[f"{layer}.bias"]
        expected[w0:w1, w0:w1] = torch.kron(g.contiguous(), a.contiguous())
        expected[b0:b1, b0:b1] = g
    la = _fit(net, x, y, "all", "kron")
    assert _rel(la.guide.posterior.precision() - LAM * torch.eye(d, dtype=F64), expected) < EXACT


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("name", list(ZOO))
def test_kron_equals_laplace_torch_curvlinops_expand(name, subset):
    laplace = pytest.importorskip("laplace", reason="laplace-torch is a comparison only")
    from laplace.curvature import CurvlinopsGGN
    from torch.utils.data import DataLoader, TensorDataset

    net, x, y, _ = _problem(name)
    ours = _fit(net, x, y, subset, "kron").guide.posterior.precision()
    theirs = laplace.Laplace(
        net, "classification", subset_of_weights=subset, hessian_structure="kron",
        backend=CurvlinopsGGN, prior_precision=LAM,
    )  # fmt: skip
    theirs.fit(DataLoader(TensorDataset(x, y), batch_size=len(x)))
    assert _rel(ours, theirs.posterior_precision.to_matrix()) < VS_LAPLACE_TORCH


@pytest.mark.parametrize("structure", ["full", "diag", "lowrank", "kron"])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("name", list(ZOO))
def test_the_predictive_is_the_brute_force_linearisation(name, subset, structure):
    net, x, y, x_test = _problem(name)
    la = _fit(net, x, y, subset, structure)
    p = _basis(subset, net)
    jp = _jacobians(net, x_test) @ p  # (N, O, K)
    sigma = torch.linalg.inv(la.guide.posterior.precision().to(F64))
    f_mean, f_cov = linearized_moments(la.guide, x_test)
    with torch.no_grad():
        assert _rel(f_mean, net(x_test)) < EXACT
    assert _rel(f_cov, jp @ sigma @ jp.mT) < EXACT
