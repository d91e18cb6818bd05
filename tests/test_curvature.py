"""Curvature: GGN products, subspace GGN, diagonal and Lanczos against dense brute force."""

import numpy as np
import pytest
import torch
from torch import nn

from pyro_subspace.curvature import (
    ggn_diagonal,
    ggn_in_subspace,
    ggn_vector_product,
    lanczos_eigh,
    output_hessian,
)
from pyro_subspace.flat import FlatNet, eval_mode
from pyro_subspace.likelihoods import Bernoulli, Categorical, Gaussian
from pyro_subspace.subspaces import Subspace

N = 11
CASES = {
    "gaussian_1": (lambda: Gaussian(sigma=0.7), 1),
    "gaussian_2": (lambda: Gaussian(sigma=torch.tensor([0.5, 2.0])), 2),
    "gaussian_learned": (lambda: Gaussian(sigma_init=1.3), 1),
    "heteroscedastic": (lambda: Gaussian(heteroscedastic=True), 2),
    "categorical_3": (lambda: Categorical(), 3),
    "bernoulli": (lambda: Bernoulli(), 1),
}


def make_problem(case, n=N, seed=0):
    make_lik, o = CASES[case]
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, o)).double()
    x = torch.randn(n, 3, dtype=torch.float64)
    return net, make_lik(), x


def target(lik, f):
    """Some valid target for one point with outputs ``f`` (O,); H does not depend on it."""
    if isinstance(lik, Categorical):
        return torch.tensor([1])
    if isinstance(lik, Bernoulli):
        return torch.tensor([1.0], dtype=f.dtype)
    if lik.heteroscedastic or f.numel() == 1:
        return torch.tensor([0.3], dtype=f.dtype)
    return torch.full((1, f.numel()), 0.3, dtype=f.dtype)


def fisher_by_quadrature(lik, f, nodes=20):
    """``E_y[score scoreᵀ]`` for one heteroscedastic point by Gauss-Hermite quadrature (exact)."""
    z, wts = np.polynomial.hermite_e.hermegauss(nodes)
    z, wts = torch.tensor(z), torch.tensor(wts / wts.sum())
    loc, scale = lik.loc_scale(f[None])
    fisher = torch.zeros(2, 2, dtype=f.dtype)
    for zi, wi in zip(z, wts):
        y = (loc + scale * zi).detach()
        score = torch.func.grad(lambda g, y=y: lik.log_prob(g[None], y).sum())(f)
        fisher += wi * torch.outer(score, score)
    return fisher


def hessians_by_autograd(lik, out):
    """Per-point ``−∂² log p / ∂f²`` (``(N, O, O)``), by autograd or quadrature."""
    hs = []
    for f in out:
        if isinstance(lik, Gaussian) and lik.heteroscedastic:
            hs.append(fisher_by_quadrature(lik, f))
            continue
        y = target(lik, f)
        neg_log_p = lambda g, y=y: -lik.log_prob(g[None], y).sum()
        hs.append(torch.autograd.functional.hessian(neg_log_p, f))
    return torch.stack(hs)


def dense_ggn(net, lik, x):
    """``G = Jᵀ blockdiag(H) J`` from the full ``(N·O, D)`` Jacobian."""
    flat = FlatNet(net)
    w = flat.vector()
    with eval_mode(net):
        out = flat(w, x).detach()
        jac = torch.autograd.functional.jacobian(lambda v: flat(v, x).reshape(-1), w)
    h = torch.block_diag(*hessians_by_autograd(lik, out))
    return jac.T @ h @ jac


@pytest.mark.parametrize("case", list(CASES))
def test_output_hessian_matches_autograd(case):
    net, lik, x = make_problem(case)
    out = net(x).detach()
    expected = hessians_by_autograd(lik, out)
    assert torch.allclose(output_hessian(lik, out), expected, rtol=1e-10, atol=1e-12)


def test_heteroscedastic_fisher_closed_form():
    lik = Gaussian(heteroscedastic=True, min_scale=0.01)
    out = torch.tensor([[0.4, -1.2], [-2.0, 0.8]], dtype=torch.float64)
    h = output_hessian(lik, out)
    s = torch.nn.functional.softplus(out[:, 1]) + 0.01
    assert torch.allclose(h[:, 0, 0], 1 / s**2)
    assert torch.allclose(h[:, 1, 1], 2 * torch.sigmoid(out[:, 1]) ** 2 / s**2)
    assert (h[:, 0, 1] == 0).all() and (h[:, 1, 0] == 0).all()


def test_learned_sigma_uses_current_value():
    lik = Gaussian(sigma_init=0.25)
    h = output_hessian(lik, torch.zeros(4, 1, dtype=torch.float64))
    assert torch.allclose(h, torch.full((4, 1, 1), 16.0, dtype=torch.float64))


@pytest.mark.parametrize("case", list(CASES))
def test_ggn_products_match_dense(case):
    net, lik, x = make_problem(case)
    g = dense_ggn(net, lik, x)
    d = g.shape[0]
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(d, generator=gen, dtype=torch.float64)
    basis = torch.randn(d, 4, generator=gen, dtype=torch.float64)
    idx = torch.tensor([0, 7, 19, d - 1, 21])  # first layer, first bias, last layer
    zero = torch.zeros(d, dtype=torch.float64)
    dense_sub, index_sub = Subspace(zero, basis), Subspace(zero, idx)
    results = {}
    for chunk in (3, 10_000):
        results[chunk] = (
            ggn_vector_product(net, lik, x, v, chunk_size=chunk),
            ggn_in_subspace(net, lik, x, dense_sub, chunk_size=chunk),
            ggn_in_subspace(net, lik, x, index_sub, chunk_size=chunk),
            ggn_diagonal(net, lik, x, chunk_size=chunk),
        )
    gv, pgp, sub, diag = results[3]
    tol = {"rtol": 1e-10, "atol": 1e-10}
    assert torch.allclose(gv, g @ v, **tol)
    assert torch.allclose(pgp, basis.T @ g @ basis, **tol)
    assert torch.allclose(sub, g[idx][:, idx], **tol)
    assert torch.allclose(diag, g.diagonal(), **tol)
    assert (diag >= 0).all()
    for small, large in zip(results[3], results[10_000]):
        assert torch.allclose(small, large, rtol=1e-12, atol=1e-13)


def test_default_weights_and_explicit_weights_agree():
    net, lik, x = make_problem("categorical_3")
    flat = FlatNet(net)
    w = flat.vector() + 0.1
    v = torch.randn(flat.num_weights, dtype=torch.float64)
    sub = Subspace(torch.zeros(flat.num_weights), torch.tensor([2, 30]))
    got = (
        ggn_vector_product(net, lik, x, v, w=w),
        ggn_in_subspace(net, lik, x, sub, w=w),
        ggn_diagonal(net, lik, x, w=w),
    )
    flat.load_vector(w)
    g = dense_ggn(net, lik, x)
    assert torch.allclose(got[0], g @ v)
    assert torch.allclose(got[1], g[[2, 30]][:, [2, 30]])
    assert torch.allclose(got[2], g.diagonal())


def test_batchnorm_net_runs_in_eval_mode_and_restores_training():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double()
    net(torch.randn(32, 3, dtype=torch.float64) * 2 + 1)  # non-trivial running statistics
    lik, x = Categorical(), torch.randn(6, 3, dtype=torch.float64)
    g = dense_ggn(net, lik, x)
    d = g.shape[0]
    v = torch.randn(d, dtype=torch.float64)
    assert torch.allclose(ggn_vector_product(net, lik, x, v), g @ v)
    assert torch.allclose(ggn_diagonal(net, lik, x), g.diagonal())
    idx = torch.tensor([1, 13, 20])
    assert torch.allclose(
        ggn_in_subspace(net, lik, x, Subspace(torch.zeros(d), idx)), g[idx][:, idx]
    )
    assert net.training and net[1].training


class _ConvBN(nn.Module):
    """Conv + BatchNorm + in-place ReLU + skip + Linear head (the ResNet pattern), tiny."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.skip, self.relu = nn.Conv2d(2, 3, 1, bias=False), nn.ReLU(inplace=True)
        self.head = nn.Linear(3, 4)

    def forward(self, x):
        h = self.relu(self.bn(self.conv(x)) + self.skip(x))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_ggn_diagonal_on_a_conv_bn_net_matches_dense(chunk_size):
    """The factored, per-parameter diagonal (jacobians.factored_square_sums) on a CNN with
    BatchNorm (eval mode, non-trivial statistics) and in-place ReLU equals ``diag`` of the
    dense ``Jᵀ H J`` in float64, for one block, blocks of one row and uneven blocks."""
    torch.manual_seed(0)
    net = _ConvBN().double()
    net(torch.randn(16, 2, 5, 5, dtype=torch.float64) * 2 + 0.5)  # running statistics
    net.eval()
    for lik in (Categorical(), Gaussian(sigma=torch.tensor([0.5, 1.0, 2.0, 0.7]))):
        x = torch.randn(7, 2, 5, 5, dtype=torch.float64)
        want = dense_ggn(net, lik, x).diagonal()
        got = ggn_diagonal(net, lik, x, chunk_size)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12 * float(want.abs().max()))


def random_spd(dim, eigenvalues, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64)).Q
    return q @ torch.diag(eigenvalues) @ q.T


def assert_top_eigenpairs(values, vectors, a, k):
    ref_values, ref_vectors = torch.linalg.eigh(a)
    ref_values, ref_vectors = ref_values.flip(0)[:k], ref_vectors.flip(1)[:, :k]
    assert values.shape == (k,) and vectors.shape == (a.shape[0], k)
    assert torch.allclose(values, ref_values, rtol=1e-8, atol=1e-10)
    assert ((vectors * ref_vectors).sum(0).abs() > 1 - 1e-6).all()


def test_lanczos_matches_eigh_on_random_spd():
    a = random_spd(60, 10.0 * 0.7 ** torch.arange(60, dtype=torch.float64), seed=3)
    values, vectors = lanczos_eigh(lambda v: a @ v, dim=60, k=5)  # default num_iter = 30
    assert_top_eigenpairs(values, vectors, a, 5)
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(60, 60, generator=gen, dtype=torch.float64)
    wishart = m @ m.T / 60 + torch.eye(60, dtype=torch.float64)
    values, vectors = lanczos_eigh(lambda v: wishart @ v, dim=60, k=5, num_iter=60)
    assert_top_eigenpairs(values, vectors, wishart, 5)
    again = lanczos_eigh(lambda v: wishart @ v, dim=60, k=5, num_iter=60)
    assert torch.equal(again[0], values) and torch.equal(again[1], vectors)


def test_lanczos_on_the_ggn():
    net, lik, x = make_problem("categorical_3")
    g = dense_ggn(net, lik, x)
    values, vectors = lanczos_eigh(lambda v: ggn_vector_product(net, lik, x, v), g.shape[0], 5)
    assert_top_eigenpairs(values, vectors, g, 5)


def test_lanczos_rank_deficient_restarts():
    # rank 3 < k = 6: Lanczos stops early and restarts on the deflated null space
    lam = torch.zeros(20, dtype=torch.float64)
    lam[:3] = torch.tensor([5.0, 2.0, 1.0])
    a = random_spd(20, lam, seed=5)
    values, vectors = lanczos_eigh(lambda v: a @ v, dim=20, k=6)
    assert torch.allclose(values[:3], lam[:3], rtol=1e-8)
    assert values[3:].abs().max() < 1e-8
    assert torch.allclose(vectors.T @ vectors, torch.eye(6, dtype=torch.float64), atol=1e-8)
    assert torch.allclose(a @ vectors, vectors * values, atol=1e-8)


def test_lanczos_zero_identity_and_one_dimensional():
    values, vectors = lanczos_eigh(lambda v: 0 * v, dim=8, k=2)
    assert (values == 0).all()
    assert torch.allclose(vectors.T @ vectors, torch.eye(2, dtype=torch.float64))
    values, vectors = lanczos_eigh(lambda v: 3 * v, dim=8, k=3)
    assert torch.allclose(values, torch.full((3,), 3.0, dtype=torch.float64))
    assert torch.allclose(vectors.T @ vectors, torch.eye(3, dtype=torch.float64))
    values, vectors = lanczos_eigh(lambda v: 2 * v, dim=1, k=1)
    assert torch.allclose(values, torch.tensor([2.0], dtype=torch.float64))
    assert torch.allclose(vectors, torch.ones(1, 1, dtype=torch.float64))


def test_ggn_validation_errors():
    net, lik, x = make_problem("gaussian_1")
    d = FlatNet(net).num_weights
    v = torch.zeros(d, dtype=torch.float64)
    with pytest.raises(TypeError, match="likelihood"):
        ggn_vector_product(net, object(), x, v)
    with pytest.raises(TypeError, match="net"):
        ggn_diagonal("net", lik, x)
    with pytest.raises(ValueError, match="v:"):
        ggn_vector_product(net, lik, x, torch.zeros(d + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="v:"):
        ggn_vector_product(net, lik, x, torch.full((d,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="x:"):
        ggn_diagonal(net, lik, x[:0])
    with pytest.raises(ValueError, match="chunk_size"):
        ggn_vector_product(net, lik, x, v, chunk_size=0)
    with pytest.raises(ValueError, match="w:"):
        ggn_diagonal(net, lik, x, w=torch.zeros(d + 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="subspace"):
        ggn_in_subspace(net, lik, x, Subspace(torch.zeros(d + 1), torch.tensor([0])))
    with pytest.raises(TypeError, match="subspace"):
        ggn_in_subspace(net, lik, x, torch.tensor([0]))
    with pytest.raises(ValueError, match="outputs"):
        ggn_diagonal(net, Categorical(), x)  # one output is not enough logits
    with pytest.raises(ValueError, match="outputs"):
        output_hessian(lik, torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="outputs"):
        output_hessian(Gaussian(sigma=torch.tensor([1.0, 2.0])), torch.zeros(3, 3))


def test_lanczos_validation_errors():
    a = torch.eye(5, dtype=torch.float64)
    with pytest.raises(TypeError, match="matvec"):
        lanczos_eigh(a, dim=5, k=2)
    with pytest.raises(ValueError, match="k:"):
        lanczos_eigh(lambda v: a @ v, dim=5, k=6)
    with pytest.raises(ValueError, match="num_iter"):
        lanczos_eigh(lambda v: a @ v, dim=5, k=3, num_iter=2)
    with pytest.raises(TypeError, match="dim"):
        lanczos_eigh(lambda v: a @ v, dim=5.0, k=2)
    with pytest.raises(ValueError, match="matvec"):
        lanczos_eigh(lambda v: v[:3], dim=5, k=2)
    with pytest.raises(ValueError, match="matvec"):
        lanczos_eigh(lambda v: v * float("nan"), dim=5, k=2)
    with pytest.raises(TypeError, match="dtype"):
        lanczos_eigh(lambda v: a @ v, dim=5, k=2, dtype=torch.int64)
