"""The output-gradient × input fast path of `jacobians.index_jacobian_blocks` for convolutions
and BatchNorm against brute force.

The oracle: ``torch.func.jacrev`` of the whole flat weight vector, one data point at a time in
eval mode, then indexed at the selected weights (the generic path's definition). Covered:
Conv2d with stride, int/tuple/"same"/"valid" padding, dilation, with and without bias;
Conv1d; grouped and depthwise convolutions; BatchNorm1d on ``(n, C)`` and ``(n, C, L)``,
BatchNorm2d, with running statistics set by a train-mode forward; a selection over every layer
type and a Linear head, one inside a single convolution, every weight; both branches of the
convolutions' cost rule (pairs' products, channel × column matmul) with small product budgets
(several chunks and channel blocks); with and without a Hessian factor. Networks the fast path
must not take (a convolution called twice, a batch reshaped before a convolution, BatchNorm
without running statistics) give the same numbers through the generic path. float64; the
tolerance 1e-10 relative (``max |a − b| / max |b|``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import jacrev

import pyro_subspace.curvature.jacobians as jacobians
from pyro_subspace.flat import FlatNet

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
TOL = 1e-10
N = 7


class Block(nn.Module):
    """A residual block: conv, BatchNorm2d, ReLU, conv, BatchNorm2d, plus a 1×1 shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ConvTwice(nn.Module):
    """One convolution applied twice: its products would sum two calls'."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.head = nn.Linear(2 * 5 * 5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(torch.tanh(self.conv(x)))).flatten(1))


class ConvPairs(nn.Module):
    """Pairs of images ``(B, 2, 2, 5, 5)`` through one convolution as ``(2B, 2, 5, 5)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(2 * 3 * 3 * 3, 3)

    def forward(self, x):
        b = x.shape[0]
        h = torch.tanh(self.bn(self.conv(x.reshape(2 * b, *x.shape[2:]))))
        return self.head(h.reshape(b, -1))


def conv2d_net(bias: bool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=bias),
        nn.ReLU(),
        nn.Conv2d(4, 3, (2, 3), padding="same", dilation=(1, 2), bias=bias),
        nn.Tanh(),
        nn.Conv2d(3, 4, 3, stride=(1, 2), padding=(2, 1), dilation=2, bias=not bias),
        nn.Tanh(),
        nn.Conv2d(4, 2, 1, padding="valid"),
        nn.Flatten(),
        nn.Linear(2 * 5 * 2, 3),
    )


def nets() -> dict:
    """``name: (constructor, input shape of one data point)``."""
    return {
        "conv2d_bias": (lambda: conv2d_net(True), (2, 9, 9)),
        "conv2d_no_bias": (lambda: conv2d_net(False), (2, 9, 9)),
        "conv1d": (
            lambda: nn.Sequential(
                nn.Conv1d(2, 4, 3, padding=1),
                nn.Tanh(),
                nn.Conv1d(4, 3, 4, stride=2, dilation=2, padding="valid", bias=False),
                nn.Tanh(),
                nn.Conv1d(3, 3, 4, padding="same"),
                nn.Flatten(),
                nn.Linear(3 * 3, 2),
            ),
            (2, 12),
        ),
        "groups": (
            lambda: nn.Sequential(
                nn.Conv2d(4, 6, 3, groups=2, padding=1),
                nn.Tanh(),
                nn.Conv2d(6, 6, 3, groups=6, stride=2),  # depthwise
                nn.Tanh(),
                nn.Flatten(1, 2),
                nn.Conv1d(6 * 2, 4, 2, groups=2, bias=False),
                nn.Flatten(),
                nn.Linear(4, 3),
            ),
            (4, 6, 5),
        ),
        "batchnorm1d": (
            lambda: nn.Sequential(
                nn.Conv1d(2, 4, 3),
                nn.BatchNorm1d(4),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(4 * 6, 5),
                nn.BatchNorm1d(5),
                nn.Tanh(),
                nn.Linear(5, 3),
            ),
            (2, 8),
        ),
        "resnet": (
            lambda: nn.Sequential(
                nn.Conv2d(3, 4, 3, 1, 1, bias=False),
                nn.BatchNorm2d(4),
                nn.ReLU(),
                Block(4, 4, 1),
                Block(4, 6, 2),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(6, 4),
            ),
            (3, 8, 8),
        ),
        "conv_twice": (ConvTwice, (2, 5, 5)),
        "conv_pairs": (ConvPairs, (2, 2, 5, 5)),
        "batchnorm_no_stats": (
            lambda: nn.Sequential(
                nn.Conv2d(2, 3, 3),
                nn.BatchNorm2d(3, track_running_stats=False),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(3 * 3 * 3, 3),
            ),
            (2, 5, 5),
        ),
    }


FAST = ["conv2d_bias", "conv2d_no_bias", "conv1d", "groups", "batchnorm1d", "resnet"]
FALLBACK = ["conv_twice", "conv_pairs", "batchnorm_no_stats"]


def setup(name: str):
    torch.manual_seed(0)
    make, shape = nets()[name]
    net = make().double()
    gen = torch.Generator().manual_seed(1)
    net.train()  # non-trivial running statistics, then eval mode
    with torch.no_grad():
        net(torch.randn(16, *shape, generator=gen, dtype=F64) * 1.5 + 0.5)
    net.eval()
    flat = FlatNet(net)
    w = flat.vector() + 0.3 * torch.randn(flat.num_weights, generator=gen, dtype=F64)
    x = torch.randn(N, *shape, generator=gen, dtype=F64)
    return flat, w, x, gen


def brute_force(flat: FlatNet, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``∂f(x_n)/∂w`` ``(N, O, D)``: ``jacrev`` of the flat vector, one data point alone."""
    return torch.stack([jacrev(lambda v, r=r: flat(v, r[None]).reshape(-1))(w) for r in x])


def factor(out: torch.Tensor) -> torch.Tensor:
    """A fixed ``L (n, O, C)`` depending on the outputs (C = O + 1 columns)."""
    p = torch.softmax(out, -1)
    return torch.cat([torch.diag_embed(p.sqrt()), p[..., None] ** 2], -1)


def selection(name: str, flat: FlatNet, gen: torch.Generator) -> torch.Tensor:
    d = flat.num_weights
    if name == "random":
        return torch.randperm(d, generator=gen)[: max(1, d // 3)]
    if name == "all":
        return torch.arange(d)
    # only inside the first (multi-channel) convolution's weight, unsorted
    offsets = torch.tensor([0, *flat.numels]).cumsum(0)
    first = next(t for t, s in enumerate(flat.shapes) if len(s) >= 3)
    size = flat.numels[first]
    local = torch.randperm(size, generator=gen)[: max(1, size // 4)]
    return offsets[first] + local


def run(flat, x, idx, w, with_factor, chunk_size=3):
    lf = factor if with_factor else None
    blocks = list(jacobians.index_jacobian_blocks(flat, x, idx, chunk_size, w, lf))
    return torch.cat([o for o, _ in blocks]), torch.cat([j for _, j in blocks])


def expected(flat, w, x, idx, with_factor):
    dense = brute_force(flat, w, x)[..., idx]
    if not with_factor:
        return dense
    with torch.no_grad():
        lf = factor(flat(w, x))
    return torch.einsum("noc,nok->nck", lf, dense)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("which", ["random", "all", "one_conv"])
@pytest.mark.parametrize("with_factor", [False, True])
def test_fast_layers_equal_brute_force(name, which, with_factor):
    flat, w, x, gen = setup(name)
    idx = selection(which, flat, gen)
    plan, rest = jacobians.linear_plan(flat, idx)
    assert rest.numel() == 0 and plan  # every selected weight takes the fast path
    out, jac = run(flat, x, idx, w, with_factor)
    with torch.no_grad():
        assert rel(out, flat(w, x)) <= TOL
    assert rel(jac, expected(flat, w, x, idx, with_factor)) <= TOL


@pytest.mark.parametrize("ratio", [0, 10**9])  # always the pairs' products; always the matmul
@pytest.mark.parametrize("budget", [7, 10**9])  # many chunks and channel blocks; one each
def test_both_branches_of_the_cost_rule(ratio, budget, monkeypatch):
    monkeypatch.setattr(jacobians, "MATMUL_RATIO", ratio)
    monkeypatch.setattr(jacobians, "PRODUCT_NUMBERS", budget)
    for name in ["conv2d_bias", "groups", "resnet"]:
        flat, w, x, gen = setup(name)
        idx = selection("random", flat, gen)
        out, jac = run(flat, x, idx, w, True, chunk_size=4)
        assert rel(jac, expected(flat, w, x, idx, True)) <= TOL


def test_the_generic_path_agrees_with_the_fast_one():
    """`selected_jacobians` (vmap of jacrev through only the touched tensors) on the same
    columns: the two paths of one call agree."""
    flat, w, x, gen = setup("resnet")
    idx = selection("random", flat, gen)
    _, jac = run(flat, x, idx, w, False)
    _, generic = jacobians.selected_jacobians(flat, w, idx)
    assert rel(jac, generic(x)) <= TOL


@pytest.mark.parametrize("name", FALLBACK)
@pytest.mark.parametrize("with_factor", [False, True])
def test_networks_off_the_fast_path_stay_right(name, with_factor):
    flat, w, x, gen = setup(name)
    idx = selection("all", flat, gen)
    plan, rest = jacobians.linear_plan(flat, idx)
    if name == "batchnorm_no_stats":  # batch statistics: rows interact, the generic path
        bn = flat.net[1]
        assert "1" not in plan and rest.numel() == bn.weight.numel() + bn.bias.numel()
    # planned layers, but this forward does not fit: called twice, 2B rows, or a BatchNorm
    # normalising by the batch (its rows interact: the other layers' products would be wrong)
    assert plan and jacobians.linear_index_jacobians(flat, plan, w, x) is None
    out, jac = run(flat, x, idx, w, with_factor)
    if name == "batchnorm_no_stats":  # its outputs depend on the rows evaluated together
        want = brute_force(flat, w, x)[..., idx]  # (the Jacobians on each row alone)
        if with_factor:  # the factor at the outputs the blocks came with
            want = torch.einsum("noc,nok->nck", factor(out), want)
        assert rel(jac, want) <= TOL
        return
    with torch.no_grad():
        assert rel(out, flat(w, x).reshape(out.shape)) <= TOL
    assert rel(jac, expected(flat, w, x, idx, with_factor)) <= TOL


def test_batchnorm_in_training_mode_is_not_taken():
    """Called directly on a network in training mode, BatchNorm normalises by the batch: the
    fast path declines (`index_jacobian_blocks` itself always works in eval mode)."""
    flat, w, x, gen = setup("resnet")
    plan, _ = jacobians.linear_plan(flat, selection("all", flat, gen))
    flat.net.train()
    try:
        assert jacobians.linear_index_jacobians(flat, plan, w, x) is None
    finally:
        flat.net.eval()


def test_mixed_selection_with_generic_layers():
    """Fast columns (conv, BatchNorm, Linear) and generic ones (a circular-padded convolution,
    a GroupNorm, two Linear layers sharing a weight) in one shuffled selection: each lands in
    its own column."""
    torch.manual_seed(0)
    first, second = nn.Linear(6, 6), nn.Linear(6, 6, bias=False)
    second.weight = first.weight  # one parameter, two modules
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular"),
        nn.GroupNorm(1, 3),
        nn.Tanh(),
        nn.Conv2d(3, 2, 3),
        nn.Flatten(),
        nn.Linear(2 * 3 * 3, 6),
        nn.Tanh(),
        first,
        nn.Tanh(),
        second,
        nn.Linear(6, 3),
    ).double()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        net(torch.randn(16, 2, 5, 5, generator=gen, dtype=F64) + 1)
    net.eval()
    flat = FlatNet(net)
    w = flat.vector() + 0.3 * torch.randn(flat.num_weights, generator=gen, dtype=F64)
    x = torch.randn(N, 2, 5, 5, generator=gen, dtype=F64)
    idx = torch.randperm(flat.num_weights, generator=gen)[:120]
    plan, rest = jacobians.linear_plan(flat, idx)
    assert set(plan) == {"0", "1", "6", "8", "10", "13"}  # not 3, 4, 12
    assert (plan["10"][2] == 6).all()  # its own bias only, not the shared weight
    assert rest.numel()
    assert jacobians.linear_index_jacobians(flat, plan, w, x) is not None
    for with_factor in (False, True):
        _, jac = run(flat, x, idx, w, with_factor)
        assert rel(jac, expected(flat, w, x, idx, with_factor)) <= TOL
