"""Random subspaces (Subspace Inference, appendix C.1)."""

from __future__ import annotations

import torch
from torch import nn

from ..validation import check_int
from ..flat import FlatNet
from .base import Subspace


def random(net: nn.Module, rank: int, seed: int | None = None) -> Subspace:
    """A ``rank``-dimensional random subspace through the network's current weights.

    Paper C.1: draw ``v_1..v_K ~ N(0, I_D)``, rescale each to unit norm, and shift at the current
    weights (typically the SWA solution). With the prior ``t ~ N(0, σ² I_K)`` this induces a
    linear combination of chi-square variables as the prior in weight space.

    Args:
        net: the trained network; its weights ``ŵ`` (shape ``(D,)``) become the shift.
        rank: ``K``, the number of directions, ``1 <= K <= D``.
        seed: seed of the ``torch.Generator`` drawing the directions (``None``: torch's global
            generator, which ``torch.manual_seed`` controls; it is advanced, never re-seeded).

    Returns:
        A dense `Subspace` with basis ``(D, K)`` of unit-norm columns.
    """
    flat = FlatNet(net)
    check_int(rank, "rank", 1, flat.num_weights)
    shift = flat.vector()
    gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
    basis = torch.randn(flat.num_weights, rank, generator=gen, dtype=shift.dtype)
    basis = basis / basis.norm(dim=0, keepdim=True)
    return Subspace(shift, basis.to(shift.device))
