"""Block Lanczos and the batched GGN product against dense linear algebra.

The dense GGN comes from the full Jacobian by autograd (`test_curvature.dense_ggn`, an
independent computation); eigenpairs are compared with ``torch.linalg.eigh``. Tolerances follow
from the stopping test: a Ritz pair with residual ``r = ‖A y − θ y‖`` has
``|θ − λ| <= r²/gap`` and ``sin∠(y, u) <= r/gap`` (Davis-Kahan), so ``tol = 1e-10`` on
well-separated eigenvalues gives eigenvalues to rounding and vectors to ~1e-9.
"""

import pytest
import torch

from pyro_subspace import subspaces
from pyro_subspace.curvature import (
    block_lanczos_eigh,
    ggn_matrix_product,
    ggn_vector_product,
)
from tests.test_curvature import dense_ggn, make_problem, random_spd


def check_pairs(values, vectors, a, k, value_tol, vector_tol):
    ref_values, ref_vectors = torch.linalg.eigh(a)
    ref_values, ref_vectors = ref_values.flip(0)[:k], ref_vectors.flip(1)[:, :k]
    scale = ref_values.abs().max()
    assert values.shape == (k,) and vectors.shape == (a.shape[0], k)
    assert (values - ref_values).abs().max() <= value_tol * scale
    eye = torch.eye(k, dtype=vectors.dtype)
    assert torch.allclose(vectors.T @ vectors, eye, atol=1e-10)
    assert ((vectors * ref_vectors).sum(0).abs() >= 1 - vector_tol).all()


@pytest.mark.parametrize("case", ["categorical_3", "gaussian_2"])
def test_ggn_matrix_product_equals_dense_and_vector_products(case):
    net, lik, x = make_problem(case)
    g = dense_ggn(net, lik, x)
    v = torch.randn(g.shape[0], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = ggn_matrix_product(net, lik, x, v, chunk_size=4)  # several chunks
    torch.testing.assert_close(out, g @ v, rtol=1e-10, atol=1e-12)
    cols = torch.stack([ggn_vector_product(net, lik, x, c) for c in v.T], 1)
    torch.testing.assert_close(out, cols, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("block_size", [1, 3, 5])
def test_block_lanczos_on_the_ggn_equals_dense_eigh(block_size):
    """Categorical GGN, D = 38 of rank <= N (O - 1) = 22: top 5 to rounding."""
    net, lik, x = make_problem("categorical_3")
    g = dense_ggn(net, lik, x)
    d = g.shape[0]
    values, vectors, used = block_lanczos_eigh(
        lambda v: ggn_matrix_product(net, lik, x, v),
        d,
        5,
        block_size=block_size,
        num_iter=d,
        tol=1e-10,
    )
    ref = torch.linalg.eigvalsh(g).flip(0)
    gap = float((ref[:5] - ref[1:6]).min() / ref[0])
    assert gap > 1e-3  # well separated: the bounds above apply
    check_pairs(values, vectors, g, 5, 1e-12, 1e-12 / gap**2 + 1e-10)
    assert used <= d


def test_block_lanczos_meets_its_residual_tolerance_on_random_spd():
    a = random_spd(80, 10.0 * 0.8 ** torch.arange(80, dtype=torch.float64), seed=3)
    for tol in (1e-4, 1e-10):
        values, vectors, used = block_lanczos_eigh(
            lambda v: a @ v, 80, 6, block_size=3, num_iter=80, tol=tol
        )
        residual = (a @ vectors - vectors * values).norm(dim=0)
        assert (residual <= tol * values.abs()).all()  # the stopping test, checked densely
        assert used < 80  # stopped early
    check_pairs(values, vectors, a, 6, 1e-13, 1e-13)  # sin² ~ (r/gap)² ~ 1e-19: rounding


def test_block_lanczos_exact_at_full_budget_and_rank_deficient():
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(30, 30, generator=gen, dtype=torch.float64)
    wishart = m @ m.T / 30
    values, vectors, used = block_lanczos_eigh(
        lambda v: wishart @ v, 30, 4, block_size=4, num_iter=30
    )
    assert used == 30
    check_pairs(values, vectors, wishart, 4, 1e-12, 1e-8)
    lam = torch.zeros(20, dtype=torch.float64)
    lam[:3] = torch.tensor([5.0, 2.0, 1.0])
    a = random_spd(20, lam, seed=5)  # rank 3 < k = 6: dead columns replaced by random ones
    values, vectors, _ = block_lanczos_eigh(lambda v: a @ v, 20, 6, block_size=4, tol=1e-10)
    assert torch.allclose(values[:3], lam[:3], rtol=1e-10)
    assert values[3:].abs().max() < 1e-10
    assert torch.allclose(vectors.T @ vectors, torch.eye(6, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(a @ vectors, vectors * values, atol=1e-9)


def test_block_lanczos_zero_and_identity():
    values, vectors, _ = block_lanczos_eigh(lambda v: 0 * v, 8, 2, tol=1e-8)
    assert (values == 0).all()
    assert torch.allclose(vectors.T @ vectors, torch.eye(2, dtype=torch.float64))
    values, vectors, _ = block_lanczos_eigh(lambda v: 3 * v, 8, 3, block_size=2, tol=1e-8)
    assert torch.allclose(values, torch.full((3,), 3.0, dtype=torch.float64))
    assert torch.allclose(vectors.T @ vectors, torch.eye(3, dtype=torch.float64))


def test_ggn_eigen_block_equals_dense_eigh():
    net, lik, x = make_problem("categorical_3")
    g = dense_ggn(net, lik, x)
    sub = subspaces.ggn_eigen(net, lik, x, 4, block_size=3, tol=1e-10)
    check_pairs(sub.eigenvalues, sub.basis, g, 4, 1e-12, 1e-8)


def test_block_lanczos_validation():
    a = torch.eye(5, dtype=torch.float64)
    with pytest.raises(TypeError, match="matmat"):
        block_lanczos_eigh(a, 5, 2)
    with pytest.raises(ValueError, match="block_size"):
        block_lanczos_eigh(lambda v: a @ v, 5, 2, block_size=0)
    with pytest.raises(ValueError, match="tol"):
        block_lanczos_eigh(lambda v: a @ v, 5, 2, tol=-1.0)
    with pytest.raises(ValueError, match="matmat: must return shape"):
        block_lanczos_eigh(lambda v: v[:, :1], 5, 2)
    net, lik, x = make_problem("gaussian_1")
    with pytest.raises(ValueError, match="v: expected shape"):
        ggn_matrix_product(net, lik, x, torch.zeros(3, 2, dtype=torch.float64))


def test_block_product_streams_a_dataset_like_tensors():
    """``G V`` over a ``TensorDataset`` (streamed chunks) equals the in-memory product."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from pyro_subspace import likelihoods
    from pyro_subspace.curvature import ggn_matrix_product

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x = torch.randn(25, 3, dtype=torch.float64)
    d = sum(p.numel() for p in net.parameters())
    v = torch.randn(d, 3, dtype=torch.float64)
    lik = likelihoods.Categorical()
    want = ggn_matrix_product(net, lik, x, v, chunk_size=7)
    got = ggn_matrix_product(net, lik, TensorDataset(x, torch.zeros(25)), v, chunk_size=7)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


class LastStepLSTM(torch.nn.Module):
    """An LSTM 3 -> 5 read at its last step, then a Linear 5 -> 4 (fused kernels: no forward AD)."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(3, 5, batch_first=True)
        self.out = torch.nn.Linear(5, 4)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


def test_block_product_on_an_lstm_equals_single_vector_products():
    """Forward AD has no rule for the fused LSTM kernel: the block product falls back (as the
    single-vector product does) and its columns equal single-vector products ``G v_j``."""

    from pyro_subspace import likelihoods
    from pyro_subspace.curvature import ggn_matrix_product, ggn_vector_product

    torch.manual_seed(0)
    net, x = LastStepLSTM(), torch.randn(7, 6, 3)
    v = torch.randn(sum(p.numel() for p in net.parameters()), 3)
    lik = likelihoods.Categorical()
    got = ggn_matrix_product(net, lik, x, v, chunk_size=4)
    cols = [ggn_vector_product(net, lik, x, v[:, j], chunk_size=4) for j in range(3)]
    want = torch.stack(cols, 1)
    # float32: a few hundred rounded operations per entry
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_ggn_eigen_single_vector_tol_on_a_conv_bn_net_equals_dense(monkeypatch):
    """``block_size=1`` with ``tol``: single ``G v`` products of the cached operator (never the
    batched one), stopping early (thick-restart Lanczos); on a float64 CNN with BatchNorm and in-place ReLU the pairs meet the residual test
    against the dense GGN, and a loose ``tol`` uses fewer products than the budget."""
    import sys

    from pyro_subspace.likelihoods import Categorical
    from tests.test_curvature import _ConvBN

    torch.manual_seed(0)
    net = _ConvBN().double()
    net(torch.randn(16, 2, 5, 5, dtype=torch.float64) * 2 + 0.5)  # running statistics
    net.eval()
    lik, x = Categorical(), torch.randn(6, 2, 5, 5, dtype=torch.float64)
    g = dense_ggn(net, lik, x)
    module = sys.modules["pyro_subspace.subspaces.ggn_eigen"]
    calls = []

    class Counted(module.GGNOperator):
        def matvec(self, v):
            calls.append(v.shape)
            return super().matvec(v)

        def matmat(self, v):  # must not be used
            raise AssertionError("the batched product was used with block_size=1")

    monkeypatch.setattr(module, "GGNOperator", Counted)
    sub = subspaces.ggn_eigen(net, lik, x, 3, tol=1e-10, num_iter=g.shape[0])
    check_pairs(sub.eigenvalues, sub.basis, g, 3, 1e-12, 1e-8)
    residual = (g @ sub.basis - sub.basis * sub.eigenvalues).norm(dim=0)
    assert (residual <= 1e-10 * sub.eigenvalues).all()
    calls.clear()
    loose = subspaces.ggn_eigen(net, lik, x, 3, tol=1e-3, num_iter=20)
    assert len(calls) < 20 and all(shape == (g.shape[0],) for shape in calls)
    residual = (g @ loose.basis - loose.basis * loose.eigenvalues).norm(dim=0)
    assert (residual <= 1e-3 * loose.eigenvalues).all()
