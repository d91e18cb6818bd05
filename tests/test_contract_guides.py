"""The Laplace guide over every subspace kind and posterior structure runs
`contracts.guide.BaseGuideTestCase` (and so `PersistenceContract`)."""

import pytest
import torch
from contracts.guide import BaseGuideTestCase

from pyro_subspace import FlatNet, SubspaceNet
from pyro_subspace.infer import AutoSubspaceLaplace, DiagonalLaplace
from pyro_subspace.subspaces import Subspace

pytestmark = pytest.mark.usefixtures("one_thread")


def _subnetwork(net):
    """Three weights of the linear net (two weights and the bias), five of the classifier."""
    d = FlatNet(net).num_weights
    return torch.tensor([0, 1, 3]) if d == 4 else torch.tensor([0, 5, 9, 40, 60])


def _dense(net):
    """A dense basis: scaled unit columns for the linear net (``PᵀGP`` stays diagonal), a random
    ``(D, 4)`` for the classifier."""
    w = FlatNet(net).vector()
    if w.numel() == 4:
        p = torch.zeros(4, 3, dtype=torch.float64)
        p[0, 0], p[1, 1], p[3, 2] = 2.0, 1.0, 0.5
    else:
        p = torch.randn(w.numel(), 4, generator=torch.Generator().manual_seed(2)).double()
    return Subspace(w, p)


class _Subnetwork(BaseGuideTestCase):
    def subset_for(self, net):
        return _subnetwork(net)


class _Dense(BaseGuideTestCase):
    def subset_for(self, net):
        return _dense(net)


class TestLastLayerFull(BaseGuideTestCase):
    subset, structure = "last_layer", "full"


class TestLastLayerDiag(BaseGuideTestCase):
    subset, structure = "last_layer", "diag"


class TestLastLayerLowRank(BaseGuideTestCase):
    subset, structure, rank = "last_layer", "lowrank", 3


class TestAllWeightsFull(BaseGuideTestCase):
    subset, structure = "all", "full"


class TestAllWeightsDiag(BaseGuideTestCase):
    subset, structure = "all", "diag"


class TestAllWeightsLowRank(BaseGuideTestCase):
    """``K = 67`` on the classifier: the eigenpairs come from Lanczos (30 < 67 products)."""

    subset, structure, rank = "all", "lowrank", 3


class TestSubnetworkFull(_Subnetwork):
    structure = "full"


class TestSubnetworkDiag(_Subnetwork):
    structure = "diag"


class TestSubnetworkLowRank(_Subnetwork):
    structure, rank = "lowrank", 3


class TestDenseFull(_Dense):
    structure = "full"


class TestDenseDiag(_Dense):
    structure = "diag"


class TestDenseLowRank(_Dense):
    structure, rank = "lowrank", 3


class TestShiftPriorSubnetwork(_Subnetwork):
    """`AutoSubspaceLaplace` built by hand with the prior ``N(0, λ⁻¹ I)`` centred at the shift."""

    def build(self, net, likelihood):
        w = FlatNet(net).vector()
        model = SubspaceNet(net, Subspace(w, _subnetwork(net)), likelihood, prior_mean="shift")
        return AutoSubspaceLaplace(model, prior_precision=2.0)


class TestDiagonalLaplace(BaseGuideTestCase):
    """The mean-field baseline: the diag structure on all weights."""

    def build(self, net, likelihood):
        return DiagonalLaplace(net, likelihood, prior_precision=2.0).guide

    def linear_fit(self):
        from contracts.guide import SIGMA, linear_problem

        from pyro_subspace import likelihoods

        net, x, y = linear_problem()
        return self.build(net, likelihoods.Gaussian(SIGMA)).fit(x, y, find_map=True), x, y
