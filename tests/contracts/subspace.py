"""`BaseSubspaceTestCase`: the contract of a subspace kind (subspaces/base.py).

Every kind is checked against its own dense basis ``P`` ``(D, K)`` (`dense_basis`) with dense
linear algebra, and its Jacobian blocks against ``torch.autograd.functional.jacobian`` of the
network's outputs with respect to the coordinates ``t``.
"""

from __future__ import annotations

import torch
from torch import nn

from pyro_subspace import FlatNet, SubspaceNet, likelihoods
from pyro_subspace.flat import eval_mode

N = 9


class BaseSubspaceTestCase:
    """Subclasses define `create_subspace` (and may change `create_net`)."""

    def create_net(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()

    def create_subspace(self, net: nn.Module):
        raise NotImplementedError

    # ------------------------------------------------------------------ fixtures

    def setup_method(self, method) -> None:
        self.net = self.create_net()
        self.sub = self.create_subspace(self.net)
        self.p = self.sub.dense_basis().double()
        gen = torch.Generator().manual_seed(3)
        self.t = 0.3 * torch.randn(self.sub.rank, generator=gen, dtype=torch.float64)
        self.x = torch.randn(N, 3, generator=gen, dtype=torch.float64)

    # ------------------------------------------------------------------ the affine map

    def test_dense_basis_shape_and_rank(self):
        d = sum(p.numel() for p in self.net.parameters())
        assert self.p.shape == (d, self.sub.rank) and self.sub.dim == d
        assert torch.linalg.matrix_rank(self.p) == self.sub.rank

    def test_weights_direction_and_transpose_match_the_dense_basis(self):
        gen = torch.Generator().manual_seed(4)
        t = torch.randn(2, 3, self.sub.rank, generator=gen, dtype=torch.float64)
        v = torch.randn(5, self.sub.dim, generator=gen, dtype=torch.float64)
        assert torch.allclose(self.sub.weights(t), self.sub.shift + t @ self.p.T, rtol=1e-12)
        assert torch.allclose(self.sub.direction(t), t @ self.p.T, rtol=1e-12)
        assert torch.allclose(self.sub.transpose_apply(v), v @ self.p, rtol=1e-12)
        assert torch.allclose(self.sub.project(self.sub.weights(t)), t, rtol=1e-8, atol=1e-10)

    def test_gram_is_the_dense_basis_product(self):
        gram = self.sub.gram()
        assert gram.dtype == torch.float64
        assert torch.allclose(gram, self.p.T @ self.p, rtol=1e-12, atol=1e-14)
        if self.sub.gram_is_identity:
            assert torch.equal(self.p.T @ self.p, torch.eye(self.sub.rank, dtype=torch.float64))

    def test_origin_is_the_point_nearest_zero_weights(self):
        expected = torch.linalg.lstsq(self.p, -self.sub.shift.double()[:, None]).solution[:, 0]
        assert torch.allclose(self.sub.origin(), expected, rtol=1e-9, atol=1e-12)

    # ------------------------------------------------------------------ Jacobians

    def dense_jacobian(self) -> torch.Tensor:
        """``∂f(x, ŵ + P t)/∂t`` ``(N, O, K)`` by autograd."""
        flat = FlatNet(self.net)
        with eval_mode(self.net):
            return torch.autograd.functional.jacobian(
                lambda t: flat(self.sub.weights(t), self.x), self.t
            )

    def test_jacobian_blocks_match_autograd(self):
        expected = self.dense_jacobian()
        flat = FlatNet(self.net, batch_strategy="loop")
        w = self.sub.weights(self.t).detach()
        with eval_mode(self.net):
            f = flat(w, self.x)
        for chunk in (4, None):
            blocks = list(self.sub.jacobian_blocks(flat, self.x, w, chunk))
            if chunk is not None:
                assert all(b[0].shape[0] <= chunk for b in blocks)
            out = torch.cat([b[0] for b in blocks])
            jp = torch.cat([b[1] for b in blocks])
            assert torch.allclose(out, f, rtol=1e-12)
            assert jp.shape == expected.shape
            assert torch.allclose(jp, expected, rtol=1e-10, atol=1e-12)

    def test_evaluator_ggn_is_the_dense_jt_h_j(self):
        lik = likelihoods.Categorical()
        model = SubspaceNet(self.net, self.sub, lik)
        y = torch.zeros(N, dtype=torch.long)  # the GGN does not depend on the targets
        ev = model.evaluator(self.x, y, chunk_size=4)
        j = self.dense_jacobian()
        w = self.sub.weights(self.t).detach()
        with eval_mode(self.net):
            h = lik.output_hessian(FlatNet(self.net)(w, self.x))
        expected = torch.einsum("nok,nop,npj->kj", j, h, j)
        assert torch.allclose(ev.ggn(self.t), expected, rtol=1e-10, atol=1e-12)
        assert torch.allclose(
            ev.ggn(self.t, diagonal=True), expected.diagonal(), rtol=1e-10, atol=1e-12
        )
