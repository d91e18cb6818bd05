"""Every posterior structure runs `contracts.structure.BaseStructureTestCase`."""

import pytest
import torch
from contracts.structure import BaseStructureTestCase

from pyro_subspace.infer.laplace import DiagonalStructure, FullStructure, LowRankStructure
from pyro_subspace.infer.laplace.lowrank import dense, pack

pytestmark = pytest.mark.usefixtures("one_thread")


class TestFullStructure(BaseStructureTestCase):
    def create_structure(self, k):
        return FullStructure

    def from_dense(self, c):
        return c

    def reference_curvature(self, c):
        return c

    def to_dense(self, buffer):
        return buffer


class TestDiagonalStructure(BaseStructureTestCase):
    def create_structure(self, k):
        return DiagonalStructure

    def from_dense(self, c):
        return c.diagonal().clone()

    def reference_curvature(self, c):
        return torch.diag(c.diagonal())

    def to_dense(self, buffer):
        return torch.diag(buffer)


class TestLowRankStructure(BaseStructureTestCase):
    """``k = 2`` of ``K = 6``: ``C̃ = U diag(l) Uᵀ`` from the top-2 eigenpairs of ``C``."""

    rank = 2

    def create_structure(self, k):
        return LowRankStructure(self.rank, k)

    def from_dense(self, c):
        values, vectors = torch.linalg.eigh(c)
        values, vectors = values.flip(0)[: self.rank], vectors.flip(1)[:, : self.rank]
        return pack(torch.zeros(c.shape[0], dtype=c.dtype), vectors, values)

    def reference_curvature(self, c):
        return dense(self.from_dense(c))

    def to_dense(self, buffer):
        return dense(buffer)


class TestLowRankStructureOfFullRank(TestLowRankStructure):
    """``k = K``: the full structure (up to rounding)."""

    rank = 6


class TestLowRankStructureByLanczos(TestLowRankStructure):
    """All 27 weights, ``k = 2``: the default 24 Lanczos iterations are fewer than ``K``, so the
    eigenpairs come from Lanczos on the GGN-vector product, accurate to ~1e-6 relative (its
    invariant-subspace rule, `curvature.lanczos`)."""

    curvature_rtol = 1e-6
    curvature_indices = torch.arange(27)

    def create_structure(self, k):
        structure = LowRankStructure(self.rank, k)
        if k > 6:
            assert structure.lanczos_iterations(k) < k
        return structure
