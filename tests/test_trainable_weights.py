"""The flat vector holds the trainable weights only (DESIGN, conventions): a frozen base under
an adapter is read where the network uses it and never copied.

A LoRA-shaped network (a frozen base ``W₀``, ``b₀`` and trainable factors ``B A`` of rank 2,
plus a trainable head): every door that builds on the flat vector (``FlatNet``, the SWA
collector and its PCA subspace, ``subspaces.random``, subnetwork indices, the last layer,
``infer.Laplace`` with ``"all"`` in every structure, ``SubspaceNet``) works on the trainable
weights, with numbers checked against brute-force float64 computations over exactly those, and
a state saved for the all-weights vector of such a network is refused, never misread.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from pyro_subspace import SubspaceNet, infer, likelihoods, subspaces
from pyro_subspace.flat import FlatNet, flat_parameters, num_weights

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
LAM = 0.7


class LoRA(nn.Module):
    """``h = tanh(W₀ x + b₀ + B A x)`` (``W₀``, ``b₀`` frozen), then a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 6).requires_grad_(False)
        self.lora_a = nn.Linear(4, 2, bias=False)
        self.lora_b = nn.Linear(2, 6, bias=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.base(x) + self.lora_b(self.lora_a(x))))


def _problem():
    torch.manual_seed(0)
    net = LoRA().to(F64)
    with torch.no_grad():  # LoRA's B starts at zero; a trained adapter does not
        net.lora_b.weight.normal_()
    x = torch.randn(12, 4, dtype=F64)
    return net, x, torch.randint(0, 3, (12,))


TRAINABLE = 8 + 12 + 18 + 3  # lora_a, lora_b, head weight and bias


def _brute_ggn(net, x):
    """``Σ_n J_nᵀ H_n J_n`` over the trainable weights only (Categorical)."""
    names = [n for n, _ in flat_parameters(net)]
    params = [p.detach() for _, p in flat_parameters(net)]
    theta = torch.cat([p.reshape(-1) for p in params])

    def f(th, xn):
        parts = th.split([p.numel() for p in params])
        return functional_call(net, {n: t.reshape(p.shape) for n, t, p in zip(names, parts, params)}, (xn[None],))[0]

    g = torch.zeros(theta.numel(), theta.numel(), dtype=F64)
    for xn in x:
        j = jacrev(f)(theta, xn)
        p = torch.softmax(f(theta, xn), -1)
        g += j.T @ (torch.diag(p) - torch.outer(p, p)) @ j
    return g


def test_the_flat_vector_is_the_trainable_weights():
    net, x, _ = _problem()
    flat = FlatNet(net)
    assert flat.num_weights == num_weights(net) == TRAINABLE
    assert flat.names == ["lora_a.weight", "lora_b.weight", "head.weight", "head.bias"]
    w = flat.vector()
    torch.testing.assert_close(flat(w, x), net(x), rtol=0, atol=0)
    base = net.base.weight.detach().clone()
    flat.load_vector(torch.zeros_like(w))
    assert torch.equal(net.base.weight, base) and not net.head.weight.any()


def test_everything_frozen_is_refused_naming_requires_grad():
    net, _, _ = _problem()
    net.requires_grad_(False)
    with pytest.raises(ValueError, match="^net: every parameter has requires_grad=False"):
        FlatNet(net)


def test_a_collector_stores_the_trainable_weights_only():
    net, x, y = _problem()
    collector = subspaces.SWACollector(net, max_snapshots=5)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05)
    base = net.base.weight.detach().clone()
    for _ in range(6):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        collector.collect()
    assert collector.deviation_rows.shape == (5, TRAINABLE)
    snapshot_bytes = collector.deviation_rows[0].numel() * collector.deviation_rows.element_size()
    trainable_bytes = sum(p.numel() * p.element_size() for _, p in flat_parameters(net))
    assert snapshot_bytes == trainable_bytes
    sub = subspaces.pca(collector, rank=3)
    assert sub.shift.shape == (TRAINABLE,) and sub.basis.shape == (TRAINABLE, 3)
    assert torch.equal(net.base.weight, base)
    model = SubspaceNet(net, sub, likelihoods.Categorical())
    t = torch.tensor([0.3, -0.2, 0.1], dtype=F64)
    got = model.outputs(t, x)  # w = ŵ + P t over the trainable weights, the base as it is
    FlatNet(net).load_vector(sub.shift + sub.basis @ t)
    torch.testing.assert_close(got, net(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("structure", ["full", "diag", "kron"])
def test_laplace_over_all_trainable_weights_equals_the_brute_force_ggn(structure):
    net, x, y = _problem()
    ggn = _brute_ggn(net, x)
    la = infer.Laplace(net, likelihoods.Categorical(), "all", structure, prior_precision=LAM).fit(x, y)
    assert la.n_params == TRAINABLE
    if structure == "full":
        torch.testing.assert_close(la.posterior_precision - LAM * torch.eye(TRAINABLE, dtype=F64), ggn, rtol=1e-9, atol=1e-12)
    elif structure == "diag":
        torch.testing.assert_close(la.posterior_precision - LAM, ggn.diagonal(), rtol=1e-9, atol=1e-12)
    else:  # the head (output layer): G = Σ_n H_n, A = mean of its inputs' outer products
        prec = la.guide.posterior.precision() - LAM * torch.eye(TRAINABLE, dtype=F64)
        with torch.no_grad():
            a = torch.tanh(net.base(x) + net.lora_b(net.lora_a(x)))
            p = torch.softmax(net(x), -1)
        g = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).sum(0)
        torch.testing.assert_close(prec[20:38, 20:38], torch.kron(g, a.T @ a / len(x)), rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(prec[38:, 38:], ggn[38:, 38:], rtol=1e-9, atol=1e-12)
        assert prec[20:, :20].abs().max() == 0  # no block couples the layers


def test_indices_and_the_last_layer_are_positions_among_the_trainable_weights():
    net, x, y = _problem()
    assert subspaces.last_layer_indices(net).tolist() == list(range(20, TRAINABLE))
    sub = subspaces.subnetwork(net, strategy="names", names=["lora_b"])
    assert sub.basis.tolist() == list(range(8, 20))
    ggn = _brute_ggn(net, x)
    idx = torch.tensor([0, 9, 25, 40])
    la = infer.Laplace(net, likelihoods.Categorical(), idx, "full", prior_precision=LAM).fit(x, y)
    torch.testing.assert_close(la.posterior_precision - LAM * torch.eye(4, dtype=F64), ggn[idx][:, idx], rtol=1e-9, atol=1e-12)


def test_a_frozen_last_layer_is_refused_naming_it():
    net, _, _ = _problem()
    net.head.requires_grad_(False)
    with pytest.raises(ValueError, match="last layer 'head' has requires_grad=False"):
        subspaces.last_layer_indices(net)


def test_a_state_saved_for_all_weights_of_a_frozen_network_is_refused():
    """Before the flat vector held the trainable weights only, this network's vector had the
    frozen base too (24 + 6 more entries): such a state must not load and be misread."""
    net, _, _ = _problem()
    sub = subspaces.random(net, rank=2, seed=0)
    old = {"shift": torch.zeros(TRAINABLE + 30, dtype=F64), "basis": torch.zeros(TRAINABLE + 30, 2, dtype=F64)}
    with pytest.raises(ValueError, match="state_dict: the saved state is for a flat vector of 71 weights, this network's holds 41"):
        sub.load_state_dict(old)
    collector = subspaces.SWACollector(net)
    state = collector.state_dict()
    state["running_mean"] = torch.zeros(TRAINABLE + 30, dtype=F64)
    with pytest.raises(ValueError, match="state_dict: the saved state is for a flat vector of 71"):
        collector.load_state_dict(state)


def test_the_all_or_nothing_snapshot_copies_the_trainable_weights_only():
    """A fit's snapshot (`transaction`) keeps frozen parameters by reference: its bytes are the
    trainable weights' (no copy of the base), an interrupted fit still restores them, and an
    in-place write into a frozen parameter inside a fit is reported, never left unrestorable."""
    from pyro_subspace.transaction import _Snapshot, transaction

    net, x, y = _problem()
    trainable = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    assert _Snapshot((net,)).nbytes() == trainable
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(KeyboardInterrupt):
        with transaction(net):
            with torch.no_grad():
                net.lora_b.weight.add_(1.0)
            raise KeyboardInterrupt
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    with pytest.raises(RuntimeError, match="frozen parameter"):
        with transaction(net):
            with torch.no_grad():
                net.base.weight.add_(1.0)
