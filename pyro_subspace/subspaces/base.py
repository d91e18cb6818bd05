"""`Subspace`: an affine subspace ``w = ŵ + P t`` of a network's flat weight space.

Subspace Inference (Izmailov et al., 2019), eq. (1): ``S = {w | w = ŵ + P t}`` with the shift
``ŵ`` of shape ``(D,)`` and the basis ``P`` of shape ``(D, K)``. The basis is stored either dense
(random, PCA, curve and GGN-eigen subspaces) or as an index selection (a subnetwork: ``K`` unit
columns ``e_i``, never materialised as a ``(D, K)`` matrix).
"""

from __future__ import annotations

import os

import torch
from torch import nn


class Subspace(nn.Module):
    """An affine subspace ``w = shift + basis @ t`` of the flat weight space.

    Args:
        shift: the point ``ŵ`` the subspace passes through, shape ``(D,)``.
        basis: either a dense floating-point basis ``P`` of shape ``(D, K)``, or a 1-D integer
            tensor of ``K`` distinct flat indices in ``[0, D)`` (a subnetwork: the columns of
            ``P`` are the unit vectors ``e_i``).

    Being an ``nn.Module``, a subspace moves with ``.to(device)``/``.to(dtype)`` (indices stay
    integer), and round-trips through `save`/`load` (``torch.save`` of its state).

    Example:
        >>> sub = Subspace(torch.zeros(5), torch.tensor([0, 3]))   # a 2-weight subnetwork
        >>> sub.weights(torch.tensor([1.0, 2.0]))
        tensor([1., 0., 0., 2., 0.])
    """

    shift: torch.Tensor
    basis: torch.Tensor

    def __init__(self, shift: torch.Tensor, basis: torch.Tensor) -> None:
        super().__init__()
        if not isinstance(shift, torch.Tensor) or not shift.is_floating_point():
            raise TypeError(f"shift: expected a floating-point tensor of shape (D,), got {shift!r}")
        if shift.dim() != 1:
            raise ValueError(f"shift: expected shape (D,), got {tuple(shift.shape)}")
        if not torch.isfinite(shift).all():
            raise ValueError("shift: contains NaN or inf")
        if not isinstance(basis, torch.Tensor):
            raise TypeError(f"basis: expected a tensor, got {type(basis).__name__}")
        d = shift.shape[0]
        if basis.is_floating_point():
            if basis.dim() != 2 or basis.shape[0] != d or basis.shape[1] < 1:
                raise ValueError(
                    f"basis: expected a dense basis of shape (D, K) = ({d}, K>=1), "
                    f"got {tuple(basis.shape)}"
                )
            if not torch.isfinite(basis).all():
                raise ValueError("basis: contains NaN or inf")
            basis = basis.to(shift)
        elif basis.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            if basis.dim() != 1 or basis.numel() < 1:
                raise ValueError(
                    f"basis: index selections must be 1-D with K>=1 entries, got {tuple(basis.shape)}"
                )
            basis = basis.long().to(shift.device)
            if basis.min() < 0 or basis.max() >= d:
                raise ValueError(
                    f"basis: indices must lie in [0, {d}), got [{basis.min()}, {basis.max()}]"
                )
            if basis.unique().numel() != basis.numel():
                raise ValueError("basis: indices must be distinct")
        else:
            raise TypeError(
                f"basis: expected a float (D, K) or integer (K,) tensor, got {basis.dtype}"
            )
        self.register_buffer("shift", shift.detach().clone())
        self.register_buffer("basis", basis.detach().clone())

    @property
    def is_index(self) -> bool:
        """True when the basis is an index selection (a subnetwork)."""
        return not self.basis.is_floating_point()

    @property
    def rank(self) -> int:
        """``K``, the number of coordinates ``t``."""
        return self.basis.shape[-1] if not self.is_index else self.basis.shape[0]

    @property
    def dim(self) -> int:
        """``D``, the length of the flat weight vector."""
        return self.shift.shape[0]

    def _check_t(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"t: expected a tensor of shape (..., {self.rank}), got {type(t).__name__}"
            )
        if t.dim() == 0 or t.shape[-1] != self.rank:
            raise ValueError(f"t: expected shape (..., {self.rank}), got {tuple(t.shape)}")

    def direction(self, t: torch.Tensor) -> torch.Tensor:
        """``P t``: map coordinates ``(..., K)`` to a weight-space direction ``(..., D)``."""
        self._check_t(t)
        if self.is_index:
            out = t.new_zeros(*t.shape[:-1], self.dim)
            return out.index_add(-1, self.basis, t)
        return t @ self.basis.T

    def weights(self, t: torch.Tensor) -> torch.Tensor:
        """``ŵ + P t``: map coordinates ``(..., K)`` to flat weights ``(..., D)`` (eq. 1).

        ``t`` is cast (differentiably) to the subspace's dtype, e.g. float32 draws of a flow
        guide for a float64 network.
        """
        self._check_t(t)
        t = t.to(self.shift.dtype)
        if self.is_index:
            w = self.shift.expand(*t.shape[:-1], self.dim)
            return w.index_add(-1, self.basis, t)
        return torch.addmm(self.shift, t.reshape(-1, self.rank), self.basis.T).reshape(
            *t.shape[:-1], self.dim
        )

    def transpose_apply(self, v: torch.Tensor) -> torch.Tensor:
        """``Pᵀ v``: map a weight-space vector ``(..., D)`` to ``(..., K)``."""
        if v.shape[-1] != self.dim:
            raise ValueError(f"v: expected shape (..., {self.dim}), got {tuple(v.shape)}")
        if self.is_index:
            return v[..., self.basis]
        return v @ self.basis

    def project(self, w: torch.Tensor) -> torch.Tensor:
        """Least-squares coordinates ``t`` of weights ``(..., D)``: ``argmin_t ‖ŵ + P t − w‖``.

        Dense bases are solved with ``torch.linalg.lstsq``; index bases read off the entries.
        Returns shape ``(..., K)``.
        """
        r = w - self.shift
        if self.is_index:
            return self.transpose_apply(r)
        flat = r.reshape(-1, self.dim).T  # shape: (D, B)
        sol = torch.linalg.lstsq(self.basis, flat).solution  # shape: (K, B)
        return sol.T.reshape(*w.shape[:-1], self.rank)

    def dense_basis(self) -> torch.Tensor:
        """The basis as a dense ``(D, K)`` matrix (materialises index selections: use sparingly)."""
        if not self.is_index:
            return self.basis
        eye = torch.zeros(self.dim, self.rank, dtype=self.shift.dtype, device=self.shift.device)
        eye[self.basis, torch.arange(self.rank, device=self.basis.device)] = 1.0
        return eye

    def save(self, path: str | os.PathLike) -> None:
        """Write the subspace to ``path`` with ``torch.save`` (plain tensors only)."""
        torch.save({"shift": self.shift, "basis": self.basis}, path)

    @classmethod
    def load(
        cls, path: str | os.PathLike, map_location: str | torch.device | None = None
    ) -> Subspace:
        """Read a subspace written by `save` (``torch.load`` with ``weights_only=True``)."""
        state = torch.load(path, map_location=map_location, weights_only=True)
        return cls(state["shift"], state["basis"])

    def extra_repr(self) -> str:
        kind = "index" if self.is_index else "dense"
        return f"D={self.dim}, K={self.rank}, basis={kind}"
