"""`Subspace`: an affine subspace ``w = ŵ + P t`` of a network's flat weight space.

Subspace Inference (Izmailov et al., 2019), eq. (1): ``S = {w | w = ŵ + P t}`` with the shift
``ŵ`` of shape ``(D,)`` and the basis ``P`` of shape ``(D, K)``. One interface, several kinds:

- `DenseSubspace` (``kind="dense"``): a dense ``(D, K)`` basis (random, PCA, curve, GGN-eigen);
- `IndexSubspace` (``kind="index"``): ``K`` unit columns ``e_i`` given by flat indices (a
  subnetwork), never materialised as a ``(D, K)`` matrix;
- `LastLayerSubspace` (``kind="last_layer"``, in `last_layer.py`): the weights and bias of a final
  ``nn.Linear``, whose Jacobian comes from the penultimate features in one forward pass.

Each kind knows its Gram matrix ``PᵀP`` (`gram`) and how to produce Jacobian blocks ``J_n P``
(`jacobian_blocks`); every curvature and predictive computation goes through these, so no code
outside this package asks which kind it holds. ``Subspace(shift, basis)`` builds the dense or
index kind from the basis's dtype.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..curvature.blocks import JacobianBlockSource
from ..flat import FlatNet, check_saved_length, flush_subnormal_
from ..curvature.gram import RootRows, gram_from_blocks
from ..curvature.jacobians import Blocks, Factor, dense_jacobian_blocks, index_jacobian_blocks, weighted


class Subspace(nn.Module, JacobianBlockSource):
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
    #: ``"dense"``, ``"index"`` or ``"last_layer"``.
    kind: str = "dense"

    def __new__(cls, *args: object, **kwargs: object) -> Subspace:
        if cls is Subspace:  # pick the kind from the basis
            basis = args[1] if len(args) > 1 else kwargs.get("basis")
            index = isinstance(basis, torch.Tensor) and not basis.is_floating_point()
            cls = IndexSubspace if index else DenseSubspace
        return super().__new__(cls)

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
        if (self.kind == "dense") != basis.is_floating_point():
            raise TypeError(
                f"basis: a {type(self).__name__} needs "
                f"{'a dense float' if self.kind == 'dense' else 'an integer index'} basis"
            )
        self.register_buffer("shift", shift.detach().clone())
        self.register_buffer("basis", basis.detach().clone())
        # an SVD of snapshots that never moved a weight (a dead unit) leaves subnormal entries in
        # its directions (the toy benchmark's PCA basis: 18%), and every w = ŵ + P t and Pᵀ g
        # then runs many times more slowly; their values are below finfo.tiny
        flush_subnormal_(self.shift, self.basis)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # type: ignore[override]
        check_saved_length("state_dict", state_dict.get(prefix + "shift"), self.shift.shape[0])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def rank(self) -> int:
        """``K``, the number of coordinates ``t``."""
        return self.basis.shape[-1]

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
        return self._direction(t)

    def weights(self, t: torch.Tensor) -> torch.Tensor:
        """``ŵ + P t``: map coordinates ``(..., K)`` to flat weights ``(..., D)`` (eq. 1).

        ``t`` is cast (differentiably) to the subspace's dtype, e.g. float32 draws of a flow
        guide for a float64 network.
        """
        self._check_t(t)
        return self._weights(t.to(self.shift.dtype))

    def transpose_apply(self, v: torch.Tensor) -> torch.Tensor:
        """``Pᵀ v``: map a weight-space vector ``(..., D)`` to ``(..., K)``."""
        if v.shape[-1] != self.dim:
            raise ValueError(f"v: expected shape (..., {self.dim}), got {tuple(v.shape)}")
        return self._transpose_apply(v)

    def project(self, w: torch.Tensor) -> torch.Tensor:
        """Least-squares coordinates ``t`` of weights ``(..., D)``: ``argmin_t ‖ŵ + P t − w‖``.

        Dense bases are solved with ``torch.linalg.lstsq``; index bases read off the entries.
        Returns shape ``(..., K)``.
        """
        return self._project(w - self.shift)

    def origin(self) -> torch.Tensor:
        """Coordinates ``t₀ = −(PᵀP)⁻¹ Pᵀ ŵ`` ``(K,)`` (float64) of the point of the subspace
        nearest to zero weights: the mean of the weight prior ``w ~ N(0, λ⁻¹ I)`` restricted to
        the subspace (its precision is ``λ PᵀP``, see `gram`)."""
        return -torch.linalg.solve(self.gram(), self.transpose_apply(self.shift).double())

    #: True when ``PᵀP = I`` by construction (index kinds), so it is never formed.
    gram_is_identity: bool = False

    def gram(self) -> torch.Tensor:
        """``PᵀP`` ``(K, K)``, float64."""
        basis = self.dense_basis().double()
        return basis.T @ basis

    def jacobian_blocks(
        self,
        flat: FlatNet,
        x: torch.Tensor,
        w: torch.Tensor,
        chunk_size: int | None = 1024,
        factor: Factor = None,
    ) -> Blocks:
        """Blocks ``(outputs (n, O), J_n P (n, O, K))`` at the flat weights ``w`` ``(D,)``,
        detached, in ``w``'s dtype; never the full ``(N·O, D)`` Jacobian. ``chunk_size``
        bounds the rows per block (``None``: the memory budget of `jacobians`). With
        ``factor`` (``outputs -> L (n, O, C)``, e.g. ``H_n = L_n L_nᵀ``) the blocks hold
        ``L_nᵀ J_n P`` ``(n, C, K)`` instead, which the GGN needs."""
        raise NotImplementedError

    def ggn_sum(
        self,
        flat: FlatNet,
        x: torch.Tensor,
        w: torch.Tensor,
        chunk_size: int | None,
        factor: Factor,
        diagonal: bool = False,
        total: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        rows: RootRows | None = None,
    ) -> torch.Tensor | None:
        """``total + Σ_n (J_n P)ᵀ H_n (J_n P)`` over the rows of ``x`` (``(K, K)``, or its
        diagonal ``(K,)``; ``None`` for no rows), ``H_n = L_n L_nᵀ`` with ``L = factor(outputs)``
        (Subnetwork Inference eqs. 9, 15): ``Σ AᵀA`` over the blocks ``A = L_nᵀ J_n P``
        (`gram.gram_from_blocks`: float32 products summed in float64), in ``dtype`` (default
        ``total``'s, else ``w``'s); exactly symmetric (overrides must keep that). ``rows`` (a
        `gram.RootRows`) holds the blocks ``A`` back while they fit under its limit (then
        ``None`` is returned for no other blocks and no ``total``); overrides that do not form
        ``A`` leave it empty."""
        blocks = self.jacobian_blocks(flat, x, w, chunk_size, factor)
        if rows is not None:
            blocks = rows.tap(blocks)
        return gram_from_blocks(blocks, diagonal, total, dtype)

    def dense_basis(self) -> torch.Tensor:
        """The basis as a dense ``(D, K)`` matrix (materialises index selections: use sparingly)."""
        raise NotImplementedError

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
        return f"D={self.dim}, K={self.rank}, basis={self.kind}"


class DenseSubspace(Subspace):
    """A subspace with a dense ``(D, K)`` basis: random, PCA, curve, GGN-eigen."""

    kind = "dense"

    def _direction(self, t: torch.Tensor) -> torch.Tensor:
        return t @ self.basis.T

    def _weights(self, t: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.shift, t.reshape(-1, self.rank), self.basis.T).reshape(
            *t.shape[:-1], self.dim
        )

    def _transpose_apply(self, v: torch.Tensor) -> torch.Tensor:
        return v @ self.basis

    def _project(self, r: torch.Tensor) -> torch.Tensor:
        flat = r.reshape(-1, self.dim).T  # shape: (D, B)
        sol = torch.linalg.lstsq(self.basis, flat).solution  # shape: (K, B)
        return sol.T.reshape(*r.shape[:-1], self.rank)

    def dense_basis(self) -> torch.Tensor:
        return self.basis

    def jacobian_blocks(self, flat, x, w, chunk_size=1024, factor=None) -> Blocks:
        """``K`` forward-mode passes (``jvp``) per chunk of rows."""
        return weighted(dense_jacobian_blocks(flat, x, self.basis, chunk_size, w), factor)


class IndexSubspace(Subspace):
    """A subnetwork: the basis is ``K`` distinct flat indices, its columns the unit vectors."""

    kind = "index"
    gram_is_identity = True

    def buffers_replaced_only(self) -> tuple[str, ...]:
        """The index basis is fixed at construction (`transaction.REPLACED_ONLY`)."""
        return ("basis",)

    @property
    def rank(self) -> int:
        return self.basis.shape[0]

    def _direction(self, t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(*t.shape[:-1], self.dim).index_add(-1, self.basis, t)

    def _weights(self, t: torch.Tensor) -> torch.Tensor:
        return self.shift.expand(*t.shape[:-1], self.dim).index_add(-1, self.basis, t)

    def _transpose_apply(self, v: torch.Tensor) -> torch.Tensor:
        return v[..., self.basis]

    def _project(self, r: torch.Tensor) -> torch.Tensor:
        return self._transpose_apply(r)

    def origin(self) -> torch.Tensor:
        return -self.shift[self.basis].double()

    def gram(self) -> torch.Tensor:
        return torch.eye(self.rank, dtype=torch.float64, device=self.shift.device)

    def dense_basis(self) -> torch.Tensor:
        eye = torch.zeros(self.dim, self.rank, dtype=self.shift.dtype, device=self.shift.device)
        eye[self.basis, torch.arange(self.rank, device=self.basis.device)] = 1.0
        return eye

    def jacobian_blocks(self, flat, x, w, chunk_size=1024, factor=None) -> Blocks:
        """Selected ``nn.Linear`` weights: output-gradient × input products; any others:
        per-sample Jacobians through only the parameter tensors holding them."""
        return index_jacobian_blocks(flat, x, self.basis, chunk_size, w, factor)
