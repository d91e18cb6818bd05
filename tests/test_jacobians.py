"""The selected-column Jacobians of a subnetwork (`jacobians.index_jacobian_blocks`) against the
dense autograd Jacobian, gathered: Linear layers with and without bias (the output-gradient ×
input fast path), a BatchNorm net (fast path for its Linear weights, generic for the BatchNorm
ones), a Conv net (generic fallback), a layer called twice; and the GGN Gram in a subspace
against ``Σ_n J_nᵀ H_n J_n`` built from those dense Jacobians. All float64; the two sides
differ only by rounding (a few ulps of the entries), so the tolerance is 1e-12.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyro_subspace.curvature.gram as gram_module
import pyro_subspace.curvature.jacobians as jacobians
from pyro_subspace import likelihoods
from pyro_subspace.curvature import ggn_in_subspace, output_hessian
from pyro_subspace.flat import FlatNet
from pyro_subspace.subspaces import Subspace

pytestmark = pytest.mark.usefixtures("one_thread")


class Twice(nn.Module):
    """One Linear applied twice (shared weights): the fast path must not be used."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def nets():
    torch.manual_seed(0)
    return {
        "bias": nn.Sequential(
            nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)
        ),
        "no_bias": nn.Sequential(
            nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 3, bias=False)
        ),
        "one_output": nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1)),
        "inplace": nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)),
        "batchnorm": nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)),
        "conv": nn.Sequential(
            nn.Unflatten(1, (1, 4)), nn.Conv1d(1, 2, 2), nn.Tanh(), nn.Flatten(), nn.Linear(6, 3)
        ),
        "twice": Twice(),
    }


def dense_jacobian(flat, w, x):
    """``∂f(x_n)/∂w`` ``(N, O, D)``, one autograd Jacobian per row (brute force)."""
    rows = [
        torch.autograd.functional.jacobian(lambda v, n=n: flat(v, x[n : n + 1]).reshape(-1), w)
        for n in range(x.shape[0])
    ]
    return torch.stack(rows)


def setup(name):
    net = nets()[name].double()
    if name == "batchnorm":  # non-trivial running statistics, then eval mode
        net.train()
        with torch.no_grad():
            net(torch.randn(32, 4, dtype=torch.float64) * 2 + 1)
    net.eval()
    flat = FlatNet(net)
    gen = torch.Generator().manual_seed(1)
    w = flat.vector() + 0.3 * torch.randn(flat.num_weights, generator=gen, dtype=torch.float64)
    x = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    return net, flat, w, x, gen


@pytest.mark.parametrize("name", list(nets()))
@pytest.mark.parametrize("selection", ["random", "all"])
def test_selected_columns_equal_the_dense_jacobian(name, selection):
    net, flat, w, x, gen = setup(name)
    d = flat.num_weights
    idx = torch.randperm(d, generator=gen)[: d // 2] if selection == "random" else torch.arange(d)
    blocks = list(jacobians.index_jacobian_blocks(flat, x, idx, 3, w))  # 3 rows: several blocks
    out = torch.cat([o for o, _ in blocks])
    jac = torch.cat([j for _, j in blocks])
    dense = dense_jacobian(flat, w, x)
    with torch.no_grad():
        assert torch.allclose(out, flat(w, x).reshape(out.shape), rtol=0, atol=1e-12)
    scale = dense.abs().max()
    assert (jac - dense[..., idx]).abs().max() <= 1e-12 * scale
    plan, rest = jacobians.linear_plan(flat, idx)
    linear = {"bias", "no_bias", "one_output", "inplace"}
    if name in linear:  # every selected weight takes the fast path
        assert rest.numel() == 0 and plan
    if name == "twice":  # the planned layer is called twice: no fast columns for this forward
        assert jacobians.linear_index_jacobians(flat, plan, w, x) is None


@pytest.mark.parametrize("name", ["bias", "batchnorm", "conv"])
@pytest.mark.parametrize("syrk", [True, False])
def test_subnetwork_ggn_equals_dense_sum(name, syrk, monkeypatch):
    """``Pᵀ G P`` of a subnetwork = ``Σ_n J_n[:, idx]ᵀ H_n J_n[:, idx]`` (Categorical ``H``)."""
    monkeypatch.setattr(gram_module, "USE_SYRK", syrk)
    net, flat, w, x, gen = setup(name)
    idx = torch.randperm(flat.num_weights, generator=gen)[:70].sort().values
    lik = likelihoods.Categorical()
    got = ggn_in_subspace(net, lik, x, Subspace(w, idx), chunk_size=3, w=w)
    j = dense_jacobian(flat, w, x)[..., idx]
    with torch.no_grad():
        h = output_hessian(lik, flat(w, x))
    want = torch.einsum("nok,nop,npj->kj", j, h, j)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


@pytest.mark.parametrize("lik", [likelihoods.Categorical(), likelihoods.Gaussian(sigma=0.7)])
@pytest.mark.parametrize("bias", [True, False])
def test_last_layer_closed_form_ggn_equals_the_generic_sum(lik, bias):
    """`LastLayerSubspace.ggn_sum` (``Σ_n H_n ⊗ φ̃ φ̃ᵀ``) = the generic ``Σ AᵀA`` over the same
    weights as an index subspace (full matrix and diagonal)."""
    from pyro_subspace.subspaces import LastLayerSubspace

    torch.manual_seed(0)
    o = 3 if isinstance(lik, likelihoods.Categorical) else 2
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, o, bias=bias)).double().eval()
    flat = FlatNet(net)
    w = flat.vector()
    x = torch.randn(11, 4, dtype=torch.float64)
    last = LastLayerSubspace(net)
    index = Subspace(w, last.basis)
    for diagonal in (False, True):
        got = last.ggn_sum(flat, x, w, 4, lik.hessian_factor, diagonal)
        want = gram_module.gram_from_blocks(
            index.jacobian_blocks(flat, x, w, 4, lik.hessian_factor), diagonal
        )
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-12 * want.abs().max()
