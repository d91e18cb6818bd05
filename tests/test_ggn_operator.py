"""`GGNOperator` (graphs built once) and the one-pass dual-number `ggn_vector_product` against
the dense GGN from the full autograd Jacobian (`test_curvature.dense_ggn`, independent)."""

import pytest
import torch

from pyro_subspace import likelihoods
from pyro_subspace.curvature import GGNOperator, ggn_matrix_product, ggn_vector_product
from tests.test_curvature import CASES, dense_ggn, make_problem


@pytest.mark.parametrize("case", list(CASES))
def test_operator_products_equal_the_dense_ggn(case):
    net, lik, x = make_problem(case)
    g = dense_ggn(net, lik, x)
    v = torch.randn(g.shape[0], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    op = GGNOperator(net, lik, x, chunk_size=4)  # three chunks, all cached
    assert op.cached_rows == op.total_rows == x.shape[0] and op.cached_bytes > 0
    torch.testing.assert_close(op.matvec(v[:, 0]), g @ v[:, 0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.matmat(v), g @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.matmat(v[:, :1]), g @ v[:, :1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op(v[:, 1]), g @ v[:, 1], rtol=1e-10, atol=1e-12)
    assert op.products == 1 + 4 + 1 + 1
    # the stateless products agree too (dual-number pass; b = 1 dispatches to it)
    torch.testing.assert_close(
        ggn_vector_product(net, lik, x, v[:, 2]), g @ v[:, 2], rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(
        ggn_matrix_product(net, lik, x, v[:, 3:]), g @ v[:, 3:], rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("budget", [0, 1])
def test_rows_beyond_the_cache_budget_are_recomputed(budget):
    """Budget 0: nothing cached; 1 byte: only the first chunk (the budget is checked before
    each chunk). Products still equal the dense GGN."""
    net, lik, x = make_problem("categorical_3")
    g = dense_ggn(net, lik, x)
    v = torch.randn(g.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    op = GGNOperator(net, lik, x, chunk_size=4, max_cached_bytes=budget)
    assert op.cached_rows == (0 if budget == 0 else 4) and op.total_rows == 11
    torch.testing.assert_close(op.matmat(v), g @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.matvec(v[:, 0]), g @ v[:, 0], rtol=1e-10, atol=1e-12)


def test_operator_at_other_weights():
    net, lik, x = make_problem("gaussian_1")
    w = torch.cat([p.detach().reshape(-1) for p in net.parameters()]) * 0.5
    v = torch.randn(w.numel(), dtype=torch.float64)
    op = GGNOperator(net, lik, x, w=w)
    torch.testing.assert_close(
        op.matvec(v), ggn_vector_product(net, lik, x, v, w=w), rtol=1e-12, atol=1e-13
    )


def test_operator_on_an_lstm_equals_single_vector_products():
    """Fused LSTM kernels: the operator retries with plain kernels (or recomputes); float32."""

    from tests.test_block_lanczos import LastStepLSTM

    torch.manual_seed(0)
    net, x = LastStepLSTM(), torch.randn(7, 6, 3)
    lik = likelihoods.Categorical()
    v = torch.randn(sum(p.numel() for p in net.parameters()), 3)
    want = torch.stack([ggn_vector_product(net, lik, x, c, chunk_size=4) for c in v.T], 1)
    op = GGNOperator(net, lik, x, chunk_size=4)
    scale = float(want.abs().max())
    assert float((op.matmat(v) - want).abs().max()) <= 1e-5 * scale
    assert float((op.matvec(v[:, 0]) - want[:, 0]).abs().max()) <= 1e-5 * scale


def test_operator_bad_input():
    net, lik, x = make_problem("gaussian_1")
    op = GGNOperator(net, lik, x)
    with pytest.raises(ValueError, match="v:"):
        op.matvec(torch.zeros(op.dim + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="v:"):
        op.matmat(torch.zeros(op.dim, dtype=torch.float64))
    with pytest.raises(TypeError, match="v:"):
        op.matvec([0.0] * op.dim)
    with pytest.raises(ValueError, match="v:"):
        op.matvec(torch.full((op.dim,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="max_cached_bytes"):
        GGNOperator(net, lik, x, max_cached_bytes=-1)
    with pytest.raises(TypeError, match="likelihood"):
        GGNOperator(net, object(), x)
