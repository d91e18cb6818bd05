"""Every subspace kind runs `contracts.subspace.BaseSubspaceTestCase`."""

import pytest
import torch
from contracts.subspace import BaseSubspaceTestCase
from torch import nn

from pyro_subspace import FlatNet, likelihoods, subspaces
from pyro_subspace.subspaces import LastLayerSubspace, Subspace

pytestmark = pytest.mark.usefixtures("one_thread")


class TestDenseSubspace(BaseSubspaceTestCase):
    def create_subspace(self, net):
        w = FlatNet(net).vector()
        gen = torch.Generator().manual_seed(1)
        return Subspace(w, torch.randn(w.numel(), 4, generator=gen, dtype=torch.float64))


class TestRandomSubspace(BaseSubspaceTestCase):
    def create_subspace(self, net):
        return subspaces.random(net, 3, seed=2)


class TestGGNEigenSubspace(BaseSubspaceTestCase):
    """Orthonormal: its Gram is ``I`` although it is a dense kind (Lanczos run once)."""

    _cache: dict = {}

    def create_subspace(self, net):
        if "sub" not in self._cache:
            x = torch.randn(12, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
            self._cache["sub"] = subspaces.ggn_eigen(net, likelihoods.Categorical(), x, 3)
        return self._cache["sub"]


class TestIndexSubspace(BaseSubspaceTestCase):
    def create_subspace(self, net):
        return Subspace(FlatNet(net).vector(), torch.tensor([0, 5, 13, 17, 25]))


class TestLastLayerSubspace(BaseSubspaceTestCase):
    def create_subspace(self, net):
        return LastLayerSubspace(net)


class TestLastLayerSubspaceWithoutBias(BaseSubspaceTestCase):
    def create_net(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3, bias=False)).double()

    def create_subspace(self, net):
        return LastLayerSubspace(net)


class TestKFACEigenSubspace(BaseSubspaceTestCase):
    """`KroneckerSubspace` from `kfac_eigen`: columns ``v ⊗ u`` from several layers' blocks."""

    def create_subspace(self, net):
        x = torch.randn(12, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        return subspaces.kfac_eigen(net, likelihoods.Categorical(), x, 6, eigenvalues="ekfac")


class TestKroneckerSubspace(BaseSubspaceTestCase):
    """A hand-built `KroneckerSubspace`: factors not orthonormal, one block at scattered
    positions (gathered, not sliced), coordinates permuted."""

    def create_subspace(self, net):
        gen = torch.Generator().manual_seed(6)
        blocks = [
            (torch.arange(12), torch.randn(4, 2, generator=gen, dtype=torch.float64),
             torch.randn(3, 2, generator=gen, dtype=torch.float64)),
            (torch.tensor([20, 16, 25, 17]), torch.randn(2, 2, generator=gen, dtype=torch.float64),
             torch.randn(2, 2, generator=gen, dtype=torch.float64)),
        ]  # fmt: skip
        return subspaces.KroneckerSubspace(
            FlatNet(net).vector(), blocks, columns=torch.tensor([3, 0, 2, 1])
        )
