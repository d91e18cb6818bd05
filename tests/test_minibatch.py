"""The shared minibatch loop against a hand-written loop with the same permutations."""

import pytest
import torch

from pyro_subspace.minibatch import (
    foreach_option,
    fused_option,
    minibatch_loop,
    shuffle_generator,
)


def least_squares(n=23, d=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return x, x @ torch.arange(1.0, d + 1, dtype=torch.float64)


def test_sgd_steps_equal_a_hand_written_loop_over_the_same_permutations():
    x, y = least_squares()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    seen = []
    history = minibatch_loop(
        lambda idx: ((x[idx] @ w - y[idx]) ** 2).mean(),
        23,
        epochs=3,
        batch_size=5,
        generator=shuffle_generator(7),
        optimizer=torch.optim.SGD([w], lr=0.05),
        on_epoch=lambda epoch, loss: seen.append((epoch, loss)),
    )
    gen, v, expected = torch.Generator().manual_seed(7), torch.zeros(3, dtype=torch.float64), []
    for _ in range(3):
        order, total = torch.randperm(23, generator=gen), 0.0
        for start in range(0, 23, 5):
            i = order[start : start + 5]
            r = x[i] @ v - y[i]
            total += float((r**2).mean()) * len(i)
            v = v - 0.05 * 2 * x[i].T @ r / len(i)  # the gradient of the minibatch mean, by hand
        expected.append(total / 23)
    torch.testing.assert_close(w.detach(), v, rtol=1e-12, atol=1e-12)
    assert history == pytest.approx(expected, rel=1e-12)
    assert seen == [(k, h) for k, h in enumerate(history)]


def test_small_last_batches_are_skipped_and_batch_means_recorded():
    sizes = []

    def step(idx):
        sizes.append(len(idx))
        return float(len(idx))

    history = minibatch_loop(
        step, 11, epochs=2, batch_size=5, min_batch_size=2, epoch_loss="batches"
    )
    assert sizes == [5, 5] * 2 and history == [5.0, 5.0]  # the batch of one point skipped
    sizes.clear()
    minibatch_loop(step, 1, epochs=1, batch_size=5, min_batch_size=2)  # N = 1: still one step
    assert sizes == [1]


def test_seedless_order_follows_the_global_generator_and_divergence_raises():
    # issue 12: no generator -> seeded by one draw of the global one (never re-seeded)
    torch.manual_seed(3)
    torch.randint(0, 2**62, (), dtype=torch.int64)
    expected = torch.rand(2)
    orders = []
    for _ in range(2):
        torch.manual_seed(3)
        seen = []
        minibatch_loop(lambda idx: seen.append(idx) or 0.0, 10, epochs=2, batch_size=3)
        orders.append(torch.cat(seen))
        assert torch.equal(torch.rand(2), expected)  # advanced by exactly that one draw
    assert torch.equal(orders[0], orders[1])
    with pytest.raises(FloatingPointError, match="demo: the loss became nan at epoch 1"):
        minibatch_loop(lambda idx: float("nan"), 4, epochs=1, desc="demo")
    with pytest.raises(ValueError, match="epoch_loss"):
        minibatch_loop(lambda idx: 0.0, 4, epochs=1, epoch_loss="sum")


def test_the_optimiser_state_and_parameters_lose_their_subnormals_after_an_epoch():
    """`flush_optimizer_subnormals` (run by the loop after each epoch): Adam's moments and the
    parameters keep their normal entries exactly and have no subnormal one left."""
    from pyro_subspace.minibatch import flush_optimizer_subnormals

    tiny = torch.finfo(torch.float32).tiny
    p = torch.nn.Parameter(torch.tensor([1.0, tiny / 2, -3.0]))
    opt = torch.optim.Adam([p], lr=1e-3)
    p.grad = torch.tensor([1.0, 0.0, tiny / 4])
    opt.step()
    state = opt.state[p]
    state["exp_avg_sq"][0] = tiny / 16
    before = {k: v.clone() for k, v in state.items()}
    flush_optimizer_subnormals(opt)
    for t in (p.detach(), state["exp_avg"], state["exp_avg_sq"]):
        assert int(((t != 0) & (t.abs() < tiny)).sum()) == 0
    normal = before["exp_avg"].abs() >= tiny
    assert torch.equal(state["exp_avg"][normal], before["exp_avg"][normal])
    assert float(p[1]) == 0.0 and float(p[0]) != 0.0 and torch.equal(state["step"], before["step"])


def test_the_loop_flushes_every_flush_steps_steps_and_after_the_last_epoch(monkeypatch):
    """The flush runs at the end of the epoch that reaches `FLUSH_STEPS` steps since the last
    one, and after the last epoch whatever the count (so a finished fit has no subnormal)."""
    from pyro_subspace import minibatch

    calls = []
    monkeypatch.setattr(minibatch, "FLUSH_STEPS", 5)
    monkeypatch.setattr(minibatch, "flush_optimizer_subnormals", lambda opt: calls.append(opt))
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    ends = []

    def run(epochs):
        calls.clear()
        ends.clear()
        minibatch.minibatch_loop(
            lambda idx: (p * idx.float()).sum(), 4, epochs=epochs, batch_size=2, optimizer=opt,
            on_epoch=lambda epoch, loss: ends.append(len(calls)),
        )  # fmt: skip
        return len(calls), list(ends)

    # 2 steps an epoch: flushed after epochs 3 and 6 (of 6), before their on_epoch
    assert run(6) == (2, [0, 0, 1, 1, 1, 2])
    assert run(1) == (1, [1])


def test_fused_option_only_where_every_tensor_takes_the_fused_kernel():
    """`fused_option` asks for PyTorch's fused optimiser kernel only when every parameter is a
    floating-point tensor on CPU or CUDA (an integer or a meta tensor, or none: the default),
    and the fused Adam and SGD steps equal the default ones to float64 rounding."""
    t = torch.zeros(3, requires_grad=True)
    assert fused_option([t]) == {"fused": True}
    assert fused_option([{"params": [t]}, {"params": [t.detach().double()]}]) == {"fused": True}
    assert fused_option([t, torch.zeros(3, dtype=torch.int64)]) == {}
    assert fused_option([torch.zeros(3, device="meta")]) == {}
    assert fused_option([]) == {}
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(30)]
    for make in (
        lambda ps, kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, **kw),
        lambda ps, kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw),
    ):
        start = torch.randn(5, 4, generator=g, dtype=torch.float64)
        ps = [start.clone().requires_grad_(), start.clone().requires_grad_()]
        opts = [make([ps[0]], {}), make([ps[1]], fused_option([ps[1]]))]
        for grad in grads:
            for p, opt in zip(ps, opts):
                p.grad = grad.clone()
                opt.step()
        torch.testing.assert_close(ps[1], ps[0], rtol=1e-13, atol=1e-15)
        assert not torch.equal(ps[0], start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_foreach_option_gives_the_default_kernels_numbers_bit_for_bit(dtype):
    """`foreach_option` asks for the multi-tensor kernels under the same condition as
    `fused_option`, and on CPU their Adam (weight decay) and SGD (momentum) steps over several
    tensors in two groups (as `fit_map`'s weights and likelihood parameters) are the default
    per-tensor steps exactly (the same kernels, called from C++): what lets `fit_map` use them
    and keep a user's loop's trajectory."""
    t = torch.zeros(3, requires_grad=True)
    assert foreach_option([t]) == {"foreach": True}
    assert foreach_option([t, torch.zeros(3, dtype=torch.int64)]) == {}
    assert foreach_option([torch.zeros(3, device="meta")]) == {}
    assert foreach_option([]) == {}
    g = torch.Generator().manual_seed(1)
    shapes = [(5, 4), (4,), (3, 5), (1,)]
    grads = [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(30)]
    for make in (
        lambda ps, kw: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, **kw),
        lambda ps, kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1, **kw),
    ):
        start = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
        runs = []
        for kernel in ({"foreach": False}, foreach_option(start)):
            ps = [p.clone().requires_grad_() for p in start]
            opt = make([{"params": ps[:3]}, {"params": ps[3:], "weight_decay": 0.0}], kernel)
            for grad in grads:
                for p, gr in zip(ps, grad):
                    p.grad = gr.clone()
                opt.step()
            runs.append(ps)
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        assert not torch.equal(runs[0][0], start[0])
