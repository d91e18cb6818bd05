"""What curvature needs of a subspace: Jacobian blocks ``J_n P`` and their Gram sum.

`JacobianBlockSource` is the base class through which `ggn_in_subspace` and
`subspace_jacobians` reach a subspace kind without knowing it: `subspaces.Subspace` derives
from it and each kind (dense, index, last layer) implements the blocks its own way. So
``curvature`` sits below ``subspaces`` and imports nothing from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


class JacobianBlockSource:
    """A source of blocks ``(outputs (n, O), J_n P (n, O, K))`` of a network's outputs and their
    Jacobian in ``K`` coordinates.

    Attributes:
        dim: ``D``, the number of weights of the network the coordinates map into.
    """

    dim: int

    def jacobian_blocks(
        self,
        flat,
        x: torch.Tensor,
        w: torch.Tensor,
        chunk_size: int | None = 1024,
        factor: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Blocks of ``n`` rows of ``x``: outputs at the flat weights ``w`` and ``J_n P`` (with
        ``factor``: ``L_nᵀ J_n P``, the rows of the GGN's root)."""
        raise NotImplementedError

    def ggn_sum(
        self, flat, x, w, chunk_size, factor, diagonal=False, total=None, dtype=None, rows=None
    ) -> torch.Tensor | None:
        """``total + Σ_n (L_nᵀ J_n P)ᵀ (L_nᵀ J_n P)`` (its diagonal with ``diagonal``)."""
        raise NotImplementedError


__all__ = ["JacobianBlockSource"]
