"""`GGNOperator` (graphs built once) and the one-pass dual-number `ggn_vector_product` against
the dense GGN from the full autograd Jacobian (`test_curvature.dense_ggn`, independent)."""

import pytest
import torch
from torch import nn

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
    """Budget 0 or 1 byte: nothing cached (no graph fits in one byte). Products still equal
    the dense GGN."""
    net, lik, x = make_problem("categorical_3")
    g = dense_ggn(net, lik, x)
    v = torch.randn(g.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    op = GGNOperator(net, lik, x, chunk_size=4, max_cached_bytes=budget)
    assert op.cache and op.cached_rows == op.cached_bytes == 0 and op.total_rows == 11
    torch.testing.assert_close(op.matmat(v), g @ v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.matvec(v[:, 0]), g @ v[:, 0], rtol=1e-10, atol=1e-12)


def _stateless(net, lik, x, v, chunk_size):
    return torch.stack([ggn_vector_product(net, lik, x, c, chunk_size=chunk_size) for c in v.T], 1)


def _small_cnn():
    """A BatchNorm CNN without in-place ops, float64, eval mode (running statistics moved)."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 4, 3, 2, 1),
        nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    ).double()  # fmt: skip
    with torch.no_grad():
        net(torch.randn(16, 2, 6, 6, dtype=torch.float64))  # training mode: BN statistics
    return net.eval(), likelihoods.Categorical(), torch.randn(13, 2, 6, 6, dtype=torch.float64)


def _held_by(op, graph) -> int:
    """Bytes a cached graph holds, found independently of the operator's saved-tensor hooks: a
    walk over the autograd nodes of ``out`` and ``g = Jᵀu`` reading every ``_saved_*`` tensor,
    plus the tensors kept beside them; each storage once, those held anyway left out."""
    xc, _, out, u, g, hess = graph
    sizes, seen, stack = {}, set(), [out.grad_fn, g.grad_fn]

    def add(t):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in op._held:
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(t, (list, tuple)):
            for item in t:
                add(item)

    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                add(getattr(node, name))
        stack.extend(fn for fn, _ in node.next_functions)
    for t in (xc, out, u, g, hess):
        add(t)
    return sum(sizes.values())


@pytest.mark.parametrize("problem", ["mlp", "cnn"])
def test_the_budget_holds_strictly(problem):
    """A budget of one chunk's graph and a half: the old check (before each chunk's build)
    cached two whole chunks, over the budget; now the second chunk is split, a cached part and
    a stateless rest, and ``cached_bytes`` (the bytes the graphs hold, checked by a walk over
    their nodes) stays within it."""
    net, lik, x = make_problem("categorical_3", n=13) if problem == "mlp" else _small_cnn()
    full = GGNOperator(net, lik, x, chunk_size=4, cache=True)
    assert full.cached_rows == full.total_rows == 13 and len(full._graphs) == 4
    one = GGNOperator(net, lik, x[:4], chunk_size=4, cache=True).cached_bytes
    assert 0 < one < full.cached_bytes <= 4 * one
    budget = int(1.5 * one)
    op = GGNOperator(net, lik, x, chunk_size=4, max_cached_bytes=budget, cache=True)
    assert 0 < op.cached_bytes <= budget and 4 < op.cached_rows < 8
    assert op.cached_bytes == sum(_held_by(op, graph) for graph in op._graphs)
    v = torch.randn(op.dim, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = _stateless(net, lik, x, v, 4)
    torch.testing.assert_close(op.matmat(v), want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(op.matvec(v[:, 0]), want[:, 0], rtol=1e-10, atol=1e-12)
    for budget in (one - 1, one, 2 * one + 1, 3 * one):  # every budget holds
        op = GGNOperator(net, lik, x, chunk_size=4, max_cached_bytes=budget, cache=True)
        assert op.cached_bytes <= budget and (op.cached_rows >= 4) == (budget >= one)


def test_the_rule_caches_an_mlp_not_a_cnn_and_both_paths_agree():
    """``cache=None``: an MLP is cached, a convolutional net (BatchNorm, no in-place ops) is
    not; ``cache=True``/``False`` force either path, with the same products to 1e-10."""
    for problem in ("mlp", "cnn"):
        net, lik, x = make_problem("categorical_3") if problem == "mlp" else _small_cnn()
        v = torch.randn(
            sum(p.numel() for p in net.parameters()), 2, dtype=torch.float64,
            generator=torch.Generator().manual_seed(4),
        )  # fmt: skip
        want = _stateless(net, lik, x, v, 5)
        auto = GGNOperator(net, lik, x, chunk_size=5)
        ops = {True: GGNOperator(net, lik, x, chunk_size=5, cache=True), False: auto}
        if problem == "mlp":
            assert auto.cache and auto.cached_rows == auto.total_rows
            assert "no convolution" in auto.reason
            ops[False] = GGNOperator(net, lik, x, chunk_size=5, cache=False)
        else:
            assert not auto.cache and "convolution" in auto.reason
        assert ops[True].cache and ops[True].cached_rows == ops[True].total_rows
        assert not ops[False].cache and ops[False].cached_bytes == ops[False].cached_rows == 0
        for op in ops.values():
            torch.testing.assert_close(op.matvec(v[:, 0]), want[:, 0], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(op.matmat(v), want, rtol=1e-10, atol=1e-12)


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
    for bad in ("yes", 1, 0, 1.0):
        with pytest.raises(TypeError, match="cache"):
            GGNOperator(net, lik, x, cache=bad)
    with pytest.raises(TypeError, match="likelihood"):
        GGNOperator(net, object(), x)
