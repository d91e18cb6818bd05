"""Online PCA by frequent directions (Subspace Inference, appendix C.2).

`FrequentDirections` keeps a deterministic ``(ell, D)`` sketch ``B`` of a stream of rows
``a_i`` (e.g. deviations of SGD iterates from their mean) such that, for the matrix ``A`` of all
rows seen, ``0 ≼ AᵀA − BᵀB`` and ``‖AᵀA − BᵀB‖₂ ≤ ‖A‖_F² / ell``: Ghashami, Liberty, Phillips &
Woodruff (2016), "Frequent Directions: Simple and Deterministic Matrix Sketching", SIAM J.
Comput. 45(5), Algorithm 1 and Theorem 1.1 with ``k = 0``. Memory is ``ell·D`` numbers however
many rows are appended; the right singular vectors of ``B`` approximate the principal directions
of ``A``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..validation import positive_int


def _check_int(name: str, value: object) -> int:
    return positive_int(value, name)


class FrequentDirections(nn.Module):
    """Frequent-directions sketch ``B`` (ell, D) of a stream of rows ``a_i`` (D,).

    Rows go into an all-zero row of ``B``. When none is left, ``B`` is shrunk first: with the
    SVD ``B = U Σ Vᵀ`` and ``δ = σ_ell²`` (the smallest squared singular value),
    ``B ← sqrt(max(Σ² − δ, 0)) Vᵀ``, which zeroes at least the last row; then the row is
    inserted. This is Algorithm 1 of Ghashami et al. (2016) with the shrink of each step delayed
    until the space is needed, so ``B`` here is the paper's sketch before its last shrink. Each
    shrink lowers ``‖B‖_F²`` by exactly ``ell·δ`` and ``BᵀB`` by at most ``δ`` in spectral norm,
    hence ``‖AᵀA − BᵀB‖₂ ≤ Σ δ ≤ (‖A‖_F² − ‖B‖_F²) / ell ≤ ‖A‖_F² / ell`` and ``BᵀB ≼ AᵀA``.
    While at most ``ell`` rows have been appended, ``BᵀB = AᵀA`` exactly.

    Args:
        dim: ``D``, the length of each row.
        ell: ``ℓ``, the number of rows of the sketch.
        dtype: dtype of the sketch (SVDs are computed in float64 and cast back).
        device: device of the sketch.

    Attributes:
        n_rows: number of rows appended so far.
        frobenius_sq: ``‖A‖_F²``, the running sum of squared norms of the appended rows.

    The state lives in buffers (``matrix`` = ``B``, ``rows_seen``, ``frobenius_seen``), so the
    sketch moves with ``.to(device)`` and round-trips through ``state_dict`` and
    ``torch.load(weights_only=True)``; appending then continues exactly as before the round trip.

    Example:
        >>> fd = FrequentDirections(dim=3, ell=2)
        >>> for row in torch.eye(3):
        ...     fd.append(row)
        >>> fd.sketch.shape, fd.n_rows, fd.covariance_error_bound
        (torch.Size([2, 3]), 3, 1.5)
    """

    def __init__(
        self,
        dim: int,
        ell: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.dim = _check_int("dim", dim)
        self.ell = _check_int("ell", ell)
        # the sketch B, shape: (ell, D)
        self.register_buffer("matrix", torch.zeros(ell, dim, dtype=dtype, device=device))
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.long, device=device))
        self.register_buffer(
            "frobenius_seen", torch.zeros((), dtype=torch.float64, device=device)
        )  # ‖A‖_F², accumulated in float64

    @property
    def n_rows(self) -> int:
        """Number of rows appended so far."""
        return int(self.rows_seen)

    @property
    def frobenius_sq(self) -> float:
        """``‖A‖_F²`` of all appended rows."""
        return float(self.frobenius_seen)

    def _shrink(self) -> None:
        """``B ← sqrt(max(Σ² − σ_ell², 0)) Vᵀ``; rows beyond ``min(ell, D)`` become zero."""
        b = self.matrix.to(torch.float64)
        _, s, vh = torch.linalg.svd(b, full_matrices=False)  # s: (k,), vh: (k, D), k = min(ell, D)
        delta = s[-1].square() if self.ell <= self.dim else s.new_zeros(())  # σ_ell = 0 if ell > D
        shrunk = torch.zeros_like(b)
        shrunk[: s.shape[0]] = (s.square() - delta).clamp_min(0).sqrt()[:, None] * vh
        self.matrix.copy_(shrunk)

    def append(self, row: torch.Tensor) -> None:
        """Add one row ``a_i`` of shape ``(D,)`` to the sketch (shrinking ``B`` first if full)."""
        if not isinstance(row, torch.Tensor) or row.shape != (self.dim,):
            shape = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
            raise ValueError(f"row: expected a tensor of shape ({self.dim},), got {shape}")
        if not torch.isfinite(row).all():
            raise ValueError("row: contains NaN or inf")
        row = row.to(self.matrix)
        free = (self.matrix == 0).all(dim=1).nonzero()
        if free.numel() == 0:
            self._shrink()
            free = (self.matrix == 0).all(dim=1).nonzero()
        self.matrix[free[0, 0]] = row
        self.rows_seen += 1
        self.frobenius_seen += row.to(torch.float64).square().sum()

    @property
    def sketch(self) -> torch.Tensor:
        """A copy of the sketch ``B``, shape ``(ell, D)``."""
        return self.matrix.clone()

    @property
    def covariance_error_bound(self) -> float:
        """``‖A‖_F² / ell``, the guaranteed bound on ``‖AᵀA − BᵀB‖₂``."""
        return self.frobenius_sq / self.ell

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # A sketch of another shape is a ValueError naming dim and ell, not torch's size mismatch.
        matrix = state_dict.get(prefix + "matrix")
        if isinstance(matrix, torch.Tensor) and matrix.shape != (self.ell, self.dim):
            raise ValueError(
                f"state: expected dim={self.dim}, ell={self.ell}, "
                f"got dim={matrix.shape[-1]}, ell={matrix.shape[0]}"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
