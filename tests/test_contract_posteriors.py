"""Every `Posterior` runs `contracts.posterior.BasePosteriorTestCase`."""

import pytest
import torch
from contracts.posterior import TEMPERATURE, BasePosteriorTestCase, K, assert_fit_statistics
from torch import nn

from pyro_subspace import FlatNet, SubspaceNet, likelihoods
from pyro_subspace.curvature import kfac
from pyro_subspace.flat import eval_mode
from pyro_subspace.subspaces import Subspace
from pyro_subspace.infer.laplace import all_weights
from pyro_subspace.infer.laplace.posteriors import (
    DiagonalPosterior,
    FullPosterior,
    FunctionalPosterior,
    KronPosterior,
    LowRankPosterior,
)

pytestmark = pytest.mark.usefixtures("one_thread")


class TestFullPosterior(BasePosteriorTestCase):
    keeps_dense_prior = True

    def create_posterior(self, k):
        return FullPosterior(k)

    def reference_curvature(self, c):
        return c


class TestFullPosteriorFloat32Buffers(TestFullPosterior):
    """A float32 network's full posterior: float32 buffers, float64 answers within float32's
    rounding of a well-conditioned ``Σ⁻¹`` (cond < 1e2 here: 1e-5 relative); ``λ = 0.01``
    (cond ~1e4: float32 loses ~1e-3) is left out of the sweep."""

    sweep_lambdas = (1.0, 30.0)
    #: the GGN in float32 products (float64 sums): float32 rounding
    curvature_rtol = 1e-6

    def create_posterior(self, k):
        return FullPosterior(k, dtype=torch.float32)

    @pytest.fixture(autouse=True)
    def _float32_tolerances(self, monkeypatch):
        close = torch.testing.assert_close

        def loose(actual, expected, *args, **kwargs):
            kwargs.update(rtol=max(kwargs.get("rtol") or 0, 2e-5), atol=max(kwargs.get("atol") or 0, 2e-6))
            return close(actual.double(), expected.double(), *args, **kwargs)

        monkeypatch.setattr(torch.testing, "assert_close", loose)
        monkeypatch.setattr(pytest, "approx", _approx(pytest.approx))


def _approx(approx):
    return lambda expected, rel=None, abs=None: approx(expected, rel=max(rel or 0, 2e-5), abs=abs)


class TestDiagonalPosterior(BasePosteriorTestCase):
    def create_posterior(self, k):
        return DiagonalPosterior(k)

    def reference_curvature(self, c):
        return torch.diag(c.diagonal())


class TestLowRankPosterior(BasePosteriorTestCase):
    """``k = 2`` of ``K = 6``: ``C̃ = U diag(l) Uᵀ`` from the top-2 eigenpairs of ``C``."""

    rank = 2

    def create_posterior(self, k):
        return LowRankPosterior(k, rank=self.rank)

    def reference_curvature(self, c):
        values, vectors = torch.linalg.eigh(c)
        values, vectors = values.flip(0)[: self.rank], vectors.flip(1)[:, : self.rank]
        return (vectors * values) @ vectors.T


class TestKronPosterior(BasePosteriorTestCase):
    """``nn.Linear(2, 2)`` with a bias on 9 points, Categorical likelihood at ``T = 2``:
    ``K = 6`` coordinates in two Kronecker blocks (the weight, ``G ⊗ A`` with ``(2, 2)``
    factors, and the bias, ``G_b``); ``C̃`` is `curvature.kfac`'s dense blocks. One ``λ`` per
    parameter tensor (a per-weight ``λ`` is refused by this structure)."""

    per_coordinate = (0.5, 0.5, 0.5, 0.5, 2.0, 2.0)

    def create_posterior(self, k):
        return KronPosterior(k)

    def prior(self, kind):
        if kind == "dense_gram":
            pytest.skip("kron: index subspaces of whole parameter tensors only (PᵀP = I)")
        return super().prior(kind)

    def fit_posterior(self, post, seed=0):
        gen = torch.Generator().manual_seed(seed)
        net = nn.Linear(2, 2).double()
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        x = torch.randn(9, 2, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 2, (9,), generator=gen)
        lik = likelihoods.Categorical()
        model = SubspaceNet(net, all_weights(net), lik, temperature=TEMPERATURE)
        post.fit_curvature(model.evaluator(x, y), torch.zeros(K, dtype=torch.float64))
        return kfac(net, lik, x, dtype=torch.float64).to_dense()

    def test_curvature_is_the_dense_ggn_of_the_subspace(self):
        """Where K-FAC is exact, on one data point, the ``nn.Linear`` blocks of an MLP equal the
        exact GGN's (brute-force ``Jᵀ H J``) per parameter tensor; the cross blocks are 0."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()  # D = 27
        flat = FlatNet(net)
        lik = likelihoods.Categorical()
        model = SubspaceNet(net, all_weights(net), lik)
        x = torch.randn(1, 2, dtype=torch.float64)
        y = torch.tensor([2])
        post = self.create_posterior(model.rank)
        stats = post.fit_curvature(model.evaluator(x, y), torch.zeros(27).double())
        assert stats is not None  # K-FAC's forward pass gives the evidence's statistics
        w = flat.vector()
        with eval_mode(net):
            j = torch.autograd.functional.jacobian(lambda ww: flat(ww, x), w)
            h = lik.output_hessian(flat(w, x))
            assert_fit_statistics(stats, flat(w, x), y)
        ggn = torch.einsum("nok,nop,npj->kj", j, h, j)
        owner = torch.cat([torch.full((p.numel(),), i) for i, p in enumerate(net.parameters())])
        same = owner[:, None] == owner[None, :]
        torch.testing.assert_close(post.curvature(), ggn * same, rtol=1e-10, atol=1e-12)


class TestFunctionalPosterior(BasePosteriorTestCase):
    """``"gp"`` on all ``N`` points (``n_subset=None``: the effective prior is ``Λ₀``): an
    ``nn.Linear(2, 2)`` with a bias (``K = 6``) on 9 points, Gaussian likelihood ``σ = 0.5`` at
    ``T = 2``. Its ``C̃ = Σ_n J_nᵀ diag(h_n) J_n`` is the exact GGN here (a Gaussian's output
    Hessian ``I/σ²`` is diagonal); `covariance`, `draw`, `log_det` are the push-through of the
    ``(18, 18)`` kernel."""

    def create_posterior(self, k):
        return FunctionalPosterior(k)

    def fit_posterior(self, post, seed=0):
        gen = torch.Generator().manual_seed(seed)
        net = nn.Linear(2, 2).double()
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        x = torch.randn(9, 2, generator=gen, dtype=torch.float64)
        y = torch.randn(9, 2, generator=gen, dtype=torch.float64)
        model = SubspaceNet(net, all_weights(net), likelihoods.Gaussian(sigma=0.5), temperature=TEMPERATURE)
        post.fit_curvature(model.evaluator(x, y), torch.zeros(K, dtype=torch.float64))
        flat = FlatNet(net)
        with eval_mode(net):
            j = torch.autograd.functional.jacobian(lambda ww: flat(ww, x), flat.vector())
        return torch.einsum("nok,nol->kl", j, j) / 0.25

    def test_curvature_is_the_dense_ggn_of_the_subspace(self):
        """``C̃ = Σ_n J_nᵀ diag(H_n) J_n``: the diagonal of each output Hessian (laplace-torch's
        GP view, Immer et al. 2021 A.2.1), from autograd Jacobians, on the base test's
        Categorical problem (whose ``H_n = diag(p) − ppᵀ`` is not diagonal)."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()  # D = 27
        flat = FlatNet(net)
        sub = Subspace(flat.vector(), self.curvature_indices)
        lik = likelihoods.Categorical()
        model = SubspaceNet(net, sub, lik)
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(8, 2, generator=gen, dtype=torch.float64)
        t = 0.2 * torch.randn(sub.rank, generator=gen, dtype=torch.float64)
        y = torch.randint(3, (8,), generator=gen)
        post = self.create_posterior(sub.rank)
        assert post.fit_curvature(model.evaluator(x, y, chunk_size=3), t) is None
        with eval_mode(net):
            j = torch.autograd.functional.jacobian(lambda tt: flat(sub.weights(tt), x), t)
            h = lik.output_hessian(flat(sub.weights(t), x)).diagonal(dim1=-2, dim2=-1)
        c = torch.einsum("nok,no,noj->kj", j, h, j)
        torch.testing.assert_close(post.curvature(), c, rtol=1e-10, atol=1e-10 * float(c.norm()))
        assert float(post.temperature) == 1.0
