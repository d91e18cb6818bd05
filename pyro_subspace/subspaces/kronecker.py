"""`KroneckerSubspace`: a subspace whose basis columns are Kronecker products ``v ⊗ u``.

A column of the basis lives in one block of the flat weight vector (a layer's weight, laid out
row-major as a ``(q, p)`` matrix, e.g. ``(out, in)`` or a ``Conv2d``'s
``(out, in·kh·kw)``), and inside it is the outer product ``v uᵀ`` of a left factor ``v``
``(q,)`` and a right factor ``u`` ``(p,)``: ``vec(v uᵀ) = v ⊗ u`` in row-major order. K-FAC's
eigenvectors have this form (`kfac_eigen`): the block ``G ⊗ A`` has eigenvectors
``v_i ⊗ u_j`` (``G v_i = μ_i v_i``, ``A u_j = λ_j u_j``). Only the factors are stored, so memory
is ``O(K · Σ (q + p))`` instead of the ``D × K`` of a dense basis; ``P t``, ``Pᵀ v`` and the
Gram matrix are formed per block from the factors:

- ``P t``: in block ``b``, ``V_b diag(t_b) U_bᵀ`` ``(q, p)``, flattened into its positions;
- ``Pᵀ v``: ``t_k = v_kᵀ M_b u_k`` with ``M_b`` the block's entries of ``v`` as ``(q, p)``;
- ``PᵀP``: ``(v_kᵀ v_l)(u_kᵀ u_l)`` within a block, zero across blocks (disjoint positions).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from .. import batch as batching
from ..curvature.jacobians import Blocks, dense_jacobian_blocks, weighted
from ..flat import check_saved_length
from .base import Subspace

#: At most this many numbers of tangent directions ``(g, D)`` formed at once for the Jacobian
#: blocks (`KroneckerSubspace.jacobian_blocks`): ``g = TANGENT_NUMBERS // D`` columns per pass
#: (2**24 numbers, 128 MiB in float64), so the ``(D, K)`` basis is never held whole.
TANGENT_NUMBERS = 2**24

#: the buffers besides ``shift`` (all fixed at construction; their shapes depend on the basis)
_BUFFERS = ("index", "shapes", "left", "right", "columns", "eigenvalues")


def _is_range(index: torch.Tensor) -> bool:
    """Whether ``index`` is ``start, start + 1, ...`` (a layer's weight in the flat vector)."""
    start = int(index[0])
    return torch.equal(index, torch.arange(start, start + index.numel(), device=index.device))


class KroneckerSubspace(Subspace):
    """``w = ŵ + P t`` with columns ``p_k = v_k ⊗ u_k`` stored as their factors.

    Args:
        shift: the point ``ŵ`` ``(D,)``.
        blocks: a list of ``(index, left, right)``, one per block of weights: ``index``
            ``(q·p,)`` the distinct flat positions of the block's entries in row-major
            ``(q, p)`` order, ``left`` ``(q, r)`` and ``right`` ``(p, r)`` the factors of the
            block's ``r >= 1`` columns (column ``j`` is ``left[:, j] ⊗ right[:, j]``). Blocks
            must not share positions.
        columns: ``(K,)`` the coordinate of each stored column (the blocks' columns in order), a
            permutation of ``0..K-1``; default in order.
        eigenvalues: optional ``(K,)`` values carried along in coordinate order (`kfac_eigen`:
            the K-FAC or EK-FAC eigenvalues); default an empty buffer.

    Buffers: ``shift`` ``(D,)``, ``shapes`` ``(B, 4)`` (``q, p, r`` and the first position per
    block, ``-1`` where its positions are not one contiguous range), ``index`` the positions of
    those other blocks only (an augmented ``[W | b]`` or GPT-2 ``Conv1D`` block), ``left``
    ``(Σ q·r,)``, ``right`` ``(Σ p·r,)`` (each block's factors flattened row-major), ``columns``
    ``(K,)``, ``eigenvalues`` ``(K,)`` or ``(0,)``. `save`/`load` and
    ``load_state_dict`` take a subspace of any rank on the same ``D``.

    Example:
        >>> v, u = torch.tensor([[0.6], [0.8]]), torch.tensor([[1.0], [0.0], [0.0]])
        >>> sub = KroneckerSubspace(torch.zeros(7), [(torch.arange(6), v, u)])
        >>> sub.weights(torch.tensor([2.0]))
        tensor([1.2000, 0.0000, 0.0000, 1.6000, 0.0000, 0.0000, 0.0000])
    """

    kind = "kron"
    index: torch.Tensor
    shapes: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor
    columns: torch.Tensor
    eigenvalues: torch.Tensor

    def __init__(
        self,
        shift: torch.Tensor,
        blocks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        *,
        columns: torch.Tensor | None = None,
        eigenvalues: torch.Tensor | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if not isinstance(shift, torch.Tensor) or not shift.is_floating_point():
            raise TypeError(f"shift: expected a floating-point tensor of shape (D,), got {shift!r}")
        if shift.dim() != 1:
            raise ValueError(f"shift: expected shape (D,), got {tuple(shift.shape)}")
        if not torch.isfinite(shift).all():
            raise ValueError("shift: contains NaN or inf")
        if isinstance(blocks, (str, torch.Tensor)) or not isinstance(blocks, Sequence) or not blocks:
            raise TypeError("blocks: expected a non-empty list of (index, left, right) tensors")
        d = shift.shape[0]
        index, shapes, left, right = [], [], [], []
        for b, block in enumerate(blocks):
            if not isinstance(block, (tuple, list)) or len(block) != 3:
                raise TypeError(f"blocks[{b}]: expected a tuple (index, left, right)")
            idx, v, u = block
            if not all(isinstance(t, torch.Tensor) for t in block):
                raise TypeError(f"blocks[{b}]: index, left and right must be tensors")
            if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
                raise TypeError(f"blocks[{b}]: index must hold integer flat positions")
            if not (v.is_floating_point() and u.is_floating_point()):
                raise TypeError(f"blocks[{b}]: left and right must be floating-point")
            if v.dim() != 2 or u.dim() != 2 or v.shape[1] != u.shape[1] or v.shape[1] < 1:
                raise ValueError(
                    f"blocks[{b}]: expected left (q, r) and right (p, r) with r >= 1, got "
                    f"{tuple(v.shape)} and {tuple(u.shape)}"
                )
            q, r = v.shape
            p = u.shape[0]
            if idx.dim() != 1 or idx.numel() != q * p:
                raise ValueError(
                    f"blocks[{b}]: index must hold q·p = {q * p} positions, got {tuple(idx.shape)}"
                )
            if not (torch.isfinite(v).all() and torch.isfinite(u).all()):
                raise ValueError(f"blocks[{b}]: left or right contains NaN or inf")
            index.append(idx.long().to(shift.device))
            shapes.append((q, p, r))
            left.append(v.detach().to(shift).reshape(-1))
            right.append(u.detach().to(shift).reshape(-1))
        every = torch.cat(index)
        if every.min() < 0 or every.max() >= d:
            raise ValueError(
                f"blocks: positions must lie in [0, {d}), got [{every.min()}, {every.max()}]"
            )
        if every.unique().numel() != every.numel():
            raise ValueError("blocks: positions must be distinct (within and across blocks)")
        # a block at one contiguous range of positions (a layer's weight) keeps only its start
        starts = [int(i[0]) if _is_range(i) else -1 for i in index]
        explicit = [i for i, a in zip(index, starts) if a < 0]
        index_t = torch.cat(explicit) if explicit else every.new_zeros(0)
        shapes = [(q, p, r, a) for (q, p, r), a in zip(shapes, starts)]
        k = sum(r for _, _, r, _ in shapes)
        if columns is None:
            columns = torch.arange(k)
        if (
            not isinstance(columns, torch.Tensor)
            or columns.is_floating_point()
            or columns.shape != (k,)
            or not torch.equal(columns.sort().values.cpu(), torch.arange(k))
        ):
            raise ValueError(f"columns: expected a permutation of 0..{k - 1} (a (K,) int tensor)")
        if eigenvalues is None:
            eigenvalues = shift.new_zeros(0)
        if not isinstance(eigenvalues, torch.Tensor) or eigenvalues.shape not in ((k,), (0,)):
            raise ValueError(f"eigenvalues: expected a tensor of shape ({k},) or None")
        self.register_buffer("shift", shift.detach().clone())
        self.register_buffer("index", index_t)
        self.register_buffer("shapes", torch.tensor(shapes, dtype=torch.long, device=shift.device))
        self.register_buffer("left", torch.cat(left))
        self.register_buffer("right", torch.cat(right))
        self.register_buffer("columns", columns.long().to(shift.device))
        self.register_buffer("eigenvalues", eigenvalues.detach().to(shift).clone())
        self._plan()

    def _plan(self) -> None:
        """Python offsets of each block's explicit positions, factors and columns (from
        ``shapes``), and the start of its positions where they are one contiguous range
        (sliced, not gathered)."""
        plan, i0, l0, r0, c0 = [], 0, 0, 0, 0
        for q, p, r, start in self.shapes.tolist():
            plan.append((i0, q, p, r, l0, r0, c0, start if start >= 0 else None))
            i0 += 0 if start >= 0 else q * p
            l0, r0, c0 = l0 + q * r, r0 + p * r, c0 + r
        self._blocks = plan
        self._coordinate_of_stored = None

    def buffers_replaced_only(self) -> tuple[str, ...]:
        """The basis buffers are fixed at construction (`transaction.REPLACED_ONLY`)."""
        return ("index", "shapes", "left", "right", "columns")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:  # type: ignore[override]
        check_saved_length("state_dict", state_dict.get(prefix + "shift"), self.shift.shape[0])
        for name in _BUFFERS:  # a basis of another rank or layout: take its shapes
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor) and saved.shape != self._buffers[name].shape:
                self._buffers[name] = self._buffers[name].new_empty(saved.shape)
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)
        self._plan()

    @property
    def rank(self) -> int:
        return self.columns.shape[0]

    # ------------------------------------------------------------------ per-block factors

    def _factors(self):
        """``(i0, q, p, start, V (q, r), U (p, r), c0, r)`` per block: views of the buffers."""
        for i0, q, p, r, l0, r0, c0, start in self._blocks:
            v = self.left[l0 : l0 + q * r].view(q, r)
            u = self.right[r0 : r0 + p * r].view(p, r)
            yield i0, q, p, start, v, u, c0, r

    def _stored_order(self) -> torch.Tensor:
        """``(K,)``: for each coordinate, its stored column (the inverse of ``columns``)."""
        return torch.argsort(self.columns)

    def _direction(self, t: torch.Tensor) -> torch.Tensor:
        batch = t.shape[:-1]
        ts = t[..., self.columns]  # stored order
        out = t.new_zeros(*batch, self.dim)
        for i0, q, p, start, v, u, c0, r in self._factors():
            tb = ts[..., c0 : c0 + r]  # shape: (..., r)
            m = (tb[..., None, :] * v) @ u.T  # V diag(t_b) Uᵀ, shape: (..., q, p)
            m = m.reshape(*batch, q * p)
            if start is not None:
                out[..., start : start + q * p] = m
            else:
                out = out.index_copy(-1, self.index[i0 : i0 + q * p], m)
        return out

    def _weights(self, t: torch.Tensor) -> torch.Tensor:
        return self.shift + self._direction(t)

    def _transpose_apply(self, v: torch.Tensor) -> torch.Tensor:
        batch = v.shape[:-1]
        parts = []
        for i0, q, p, start, left, right, _, _ in self._factors():
            if start is not None:
                vb = v[..., start : start + q * p]
            else:
                vb = v.index_select(-1, self.index[i0 : i0 + q * p])
            vb = vb.reshape(*batch, q, p)
            parts.append(((vb @ right) * left).sum(-2))  # v_kᵀ M u_k, shape: (..., r)
        stored = torch.cat(parts, -1)
        return stored[..., self._stored_order()]

    def _project(self, r: torch.Tensor) -> torch.Tensor:
        rhs = self._transpose_apply(r).double().reshape(-1, self.rank).T  # shape: (K, B)
        sol = torch.linalg.solve(self.gram(), rhs)
        return sol.T.reshape(*r.shape[:-1], self.rank).to(r.dtype)

    def gram(self) -> torch.Tensor:
        """``PᵀP`` ``(K, K)`` float64 from the factors: ``(v_kᵀ v_l)(u_kᵀ u_l)`` within a block,
        zero across blocks; the identity to rounding for `kfac_eigen`'s orthonormal factors."""
        k = self.rank
        stored = torch.zeros(k, k, dtype=torch.float64, device=self.shift.device)
        for _, _, _, _, v, u, c0, r in self._factors():
            v, u = v.double(), u.double()
            stored[c0 : c0 + r, c0 : c0 + r] = (v.T @ v) * (u.T @ u)
        order = self._stored_order()
        return stored[order[:, None], order[None, :]]

    def dense_basis(self) -> torch.Tensor:
        """The ``(D, K)`` basis (materialised: for tests and small networks)."""
        eye = torch.eye(self.rank, dtype=self.shift.dtype, device=self.shift.device)
        return self._direction(eye).T

    def jacobian_blocks(self, flat, x, w, chunk_size=1024, factor=None) -> Blocks:
        """``J_n P`` by ``vmap`` over ``jvp`` s (as a dense basis), the tangent directions
        formed from the factors for at most ``TANGENT_NUMBERS // D`` columns at a time."""
        return weighted(self._jacobians(flat, x, w, chunk_size), factor)

    def _jacobians(self, flat, x, w, chunk_size) -> Blocks:
        step = max(1, TANGENT_NUMBERS // self.dim)
        eye = torch.eye(self.rank, dtype=self.shift.dtype, device=self.shift.device)
        if step >= self.rank:
            yield from dense_jacobian_blocks(flat, x, self._direction(eye).T, chunk_size, w)
            return
        for xc in batching.split(x, chunk_size or 1024):
            n, parts, out = batching.rows(xc), [], None
            for a in range(0, self.rank, step):
                basis = self._direction(eye[a : a + step]).T  # shape: (D, g)
                for out, jp in dense_jacobian_blocks(flat, xc, basis, n, w):
                    parts.append(jp)
            yield out, torch.cat(parts, -1)

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | os.PathLike) -> None:
        """Write the subspace's buffers to ``path`` with ``torch.save`` (plain tensors only)."""
        torch.save({name: getattr(self, name) for name in ("shift",) + _BUFFERS}, path)

    @classmethod
    def load(
        cls, path: str | os.PathLike, map_location: str | torch.device | None = None
    ) -> KroneckerSubspace:
        """Read a subspace written by `save` (``torch.load`` with ``weights_only=True``)."""
        state = torch.load(path, map_location=map_location, weights_only=True)
        return cls.from_buffers(**state)

    @classmethod
    def from_buffers(
        cls,
        shift: torch.Tensor,
        index: torch.Tensor,
        shapes: torch.Tensor,
        left: torch.Tensor,
        right: torch.Tensor,
        columns: torch.Tensor,
        eigenvalues: torch.Tensor | None = None,
    ) -> KroneckerSubspace:
        """A subspace from its buffers (as `save` writes them), checked as the constructor."""
        blocks, i0, l0, r0 = [], 0, 0, 0
        if shapes.dim() != 2 or shapes.shape[1] != 4:
            raise ValueError(f"shapes: expected (B, 4), got {tuple(shapes.shape)}")
        for q, p, r, start in shapes.tolist():
            if start >= 0:
                positions = torch.arange(start, start + q * p, device=index.device)
            else:
                positions, i0 = index[i0 : i0 + q * p], i0 + q * p
            blocks.append(
                (positions, left[l0 : l0 + q * r].reshape(q, r), right[r0 : r0 + p * r].reshape(p, r))
            )
            l0, r0 = l0 + q * r, r0 + p * r
        if i0 != index.numel() or l0 != left.numel() or r0 != right.numel():
            raise ValueError("shapes: do not match the lengths of index, left and right")
        return cls(shift, blocks, columns=columns, eigenvalues=eigenvalues)

    def extra_repr(self) -> str:
        return f"D={self.dim}, K={self.rank}, basis=kron, blocks={len(self._blocks)}"
