"""The Gram product ``Σ_n A_nᵀ A_n`` of Jacobian blocks (Subnetwork Inference eqs. 9, 15): one
matrix multiply per block, BLAS ``syrk`` on CPU. Below `subspaces` and `curvature`, which both
accumulate GGNs with it.

Float32 blocks are multiplied in float32 (the hardware's fast path) and their partial sums,
over at most `FLUSH_ROWS` rows each, are added in float64, so the rounding of the sum does not
grow with ``N``; the result then takes the requested dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..linalg import blas_threads, symmetrize_

#: Use BLAS ``syrk`` (half the multiplications of ``Aᵀ A``) through SciPy for CPU blocks.
USE_SYRK = True

#: Rows of float32 blocks summed in float32 by ``syrk`` before the partial sum is added into the
#: float64 total (one ``K × K`` addition per this many rows: about 2% of the ``syrk`` time).
FLUSH_ROWS = 8192

#: CPU blocks of fewer rows are gathered into one ``(K, STAGE_ROWS)`` buffer before a product:
#: a ``syrk`` reads and writes the whole ``K × K`` triangle whatever its rows, so at large ``K``
#: (a subnetwork of 42,438 weights: 3.6 GB of float32 triangle against 20 rows of a 2-image
#: block) a product of few rows is bound by memory traffic, not arithmetic.
STAGE_ROWS = 256


class RootRows:
    """Collects the rows of the GGN's root ``A`` (``Σ_n A_nᵀ A_n = PᵀGP``) while there are at
    most ``limit`` of them: a Laplace posterior over ``K`` weights from fewer than ``K`` rows is
    cheaper by Woodbury's identity than from the ``(K, K)`` precision
    (`FullPosterior._woodbury_`), and needs no ``(K, K)`` GGN. `tap` holds the blocks
    back from `gram_from_blocks` while they fit under ``limit`` (so the GGN is only formed when
    asked for, from ``parts``); past ``limit`` it hands over those held and every later block,
    and keeps nothing (``matrix()`` is ``None``)."""

    def __init__(self, limit: int, points: int | None = None) -> None:
        self.limit, self.count = limit, 0
        #: the number of points the blocks will cover, where known: once the first block shows
        #: ``C`` rows a point, more than ``limit`` rows in all are held back from the start
        #: (holding ``2K/3`` rows to find out would cost ``2/3`` of a ``(K, K)`` matrix)
        self.points = points
        self.parts: list[torch.Tensor] | None = []  # blocks (n, C, K), copied
        self._matrix: torch.Tensor | None = None

    def tap(self, blocks: Iterator[tuple[torch.Tensor, torch.Tensor]]):
        """``blocks`` ``(outputs, A (n, C, K))`` past ``limit`` rows; none before."""
        for out, a in blocks:
            if self.parts is not None and not self.parts and self.points is not None:
                if self.points * a.shape[1] > self.limit:  # the rows will not fit: hold none
                    self.parts = None
            if self.parts is not None:
                self.count += a.shape[0] * a.shape[1]
                if self.count <= self.limit:
                    self.parts.append(a.detach().clone())  # its layout: syrk reads either
                    continue
                held, self.parts = self.parts, None
                for part in held:
                    yield None, part
            yield out, a

    @property
    def kept(self) -> bool:
        """Every row passed is held (at least one, at most ``limit``)."""
        return bool(self.parts)

    def matrix(self) -> torch.Tensor | None:
        """``A`` ``(rows, K)`` (formed once), or ``None`` (no rows, or more than ``limit``)."""
        if not self.parts:
            return None
        if self._matrix is None:
            self._matrix = torch.cat([p.reshape(-1, p.shape[-1]) for p in self.parts])
        return self._matrix


def gram_from_blocks(
    blocks: Iterator[tuple[torch.Tensor, torch.Tensor]],
    diagonal: bool = False,
    total: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """``total + Σ_n A_nᵀ A_n`` (``(K, K)``, exactly symmetric, or its diagonal ``(K,)``) over
    blocks ``(outputs, A (n, C, K))``: one matrix multiply ``Aᵀ A`` per block, ``A`` read as
    ``(n·C, K)`` in whichever row order its memory has (the sum does not depend on it).

    Float32 blocks: ``syrk`` in float32 over at most `FLUSH_ROWS` rows, these partial sums
    accumulated in float64. Returns ``dtype`` (default ``total``'s dtype, else the blocks');
    ``None`` for no blocks and no ``total``."""
    acc = _Accumulator(diagonal)
    with contextlib.ExitStack() as stack:
        for _, a in blocks:
            acc.add(a, stack)
        acc._unstage(stack)
    part = acc.result(dtype or (total.dtype if total is not None else None))
    if part is None:
        return total
    return part if total is None else total + part


class _Accumulator:
    """Running ``Σ AᵀA``: the upper triangle of a ``(K, K)`` part in the blocks' dtype (a
    Fortran-ordered NumPy array filled by ``syrk``, or a torch tensor from ``addmm_`` off CPU);
    for float32 blocks, every `FLUSH_ROWS` rows the part's upper triangle is added into a
    float64 total kept as row blocks of that triangle (``K²/2`` numbers: the size of the
    float32 part, not ``K²``), and the part is reused."""

    #: Rows per block of the float64 upper triangle.
    BLOCK = 64

    def __init__(self, diagonal: bool) -> None:
        self.diagonal = diagonal
        self.part = None  # the running (K, K) part (its upper triangle)
        self.fresh = True  # the next block overwrites ``part`` (beta = 0)
        self.rows = 0  # rows in ``part`` since the last flush
        self.total64: list[torch.Tensor] | torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.device = None
        self.staged: torch.Tensor | None = None  # (K, STAGE_ROWS): rows of small CPU blocks
        self.staged_rows = 0

    def add(self, a: torch.Tensor, stack: contextlib.ExitStack) -> None:
        k = a.shape[-1]
        if a.permute(2, 1, 0).is_contiguous():  # column-major blocks: Aᵀ is a free reshape
            at = a.permute(2, 1, 0).reshape(k, -1)
        else:
            at = a.reshape(-1, k).T
        at = at.detach()
        self.dtype, self.device = at.dtype, at.device
        stage = min(STAGE_ROWS, FLUSH_ROWS)  # a float32 product sums at most FLUSH_ROWS rows
        if self.diagonal or at.device.type != "cpu" or at.shape[1] >= stage:
            self._unstage(stack)  # the rows in their order (the float32 sums' rounding)
            self._product(at, stack)
            return
        if self.staged is not None and self.staged_rows + at.shape[1] > stage:
            self._unstage(stack)
        if self.staged is None:
            self.staged, self.staged_rows = at.new_empty(k, stage), 0
        self.staged[:, self.staged_rows : self.staged_rows + at.shape[1]] = at
        self.staged_rows += at.shape[1]

    def _unstage(self, stack: contextlib.ExitStack) -> None:
        """The product of the staged rows, and an empty stage."""
        if self.staged is not None and self.staged_rows:
            self._product(self.staged[:, : self.staged_rows], stack)
        self.staged, self.staged_rows = None, 0

    def _product(self, at: torch.Tensor, stack: contextlib.ExitStack) -> None:
        """``Σ += at atᵀ`` for ``at`` ``(K, rows)``."""
        if self.diagonal:
            part = at.square().sum(1).double()
            self.total64 = part if self.total64 is None else self.total64.add_(part)
            return
        full = self.rows + at.shape[1] > FLUSH_ROWS
        if full and not self.fresh and self.dtype != torch.float64:
            self._flush()
        if isinstance(self.part, torch.Tensor) or (self.part is None and not _syrk_ok(at)):
            if self.fresh:
                self.part = at @ at.T if self.part is None else torch.mm(at, at.T, out=self.part)
            else:
                self.part.addmm_(at, at.T)
        else:
            if self.part is None:
                stack.enter_context(blas_threads())  # once per accumulation, not per block
            self.part = _syrk(at, self.part, 0.0 if self.fresh else 1.0)
        self.fresh = False
        self.rows += at.shape[1]

    def _part_tensor(self) -> torch.Tensor:
        """The running part as a torch tensor (a view of the NumPy array of ``syrk``)."""
        if isinstance(self.part, torch.Tensor):
            return self.part
        return torch.from_numpy(self.part).to(self.device)

    def _blocks(self, k: int) -> list[tuple[int, int]]:
        return [(s, min(s + self.BLOCK, k)) for s in range(0, k, self.BLOCK)]

    def _flush(self) -> None:
        """Add the part's upper triangle into the float64 row blocks; reuse the part."""
        part = self._part_tensor()
        k = part.shape[0]
        if self.total64 is None:
            f64 = {"dtype": torch.float64, "device": part.device}
            self.total64 = [torch.zeros(e - s, k - s, **f64) for s, e in self._blocks(k)]
        for (s, e), acc in zip(self._blocks(k), self.total64):
            acc.add_(part[s:e, s:])
        self.fresh, self.rows = True, 0

    def result(self, dtype: torch.dtype | None) -> torch.Tensor | None:
        if self.dtype is None:
            return None
        dtype = dtype or self.dtype
        if self.diagonal:
            return self.total64.to(dtype)
        syrk = not isinstance(self.part, torch.Tensor)  # only the upper triangle is filled
        if self.total64 is not None:
            if not self.fresh:
                self._flush()
            out = self._part_tensor()  # reused for the result when the dtype allows
            if out.dtype != dtype:
                out = torch.empty(out.shape, dtype=dtype, device=out.device)
            k = out.shape[0]
            for (s, e), acc in zip(self._blocks(k), self.total64):
                out[s:e, s:].copy_(acc)
            self.total64, syrk = None, True
        else:
            out = self._part_tensor()
            if out.dtype != dtype:
                out = out.to(dtype)
        self.part = None
        out = symmetrize_(out, upper=True if syrk else None)
        return out if out.is_contiguous() else out.T  # symmetric: a Fortran array's transpose


def _syrk_ok(at: torch.Tensor) -> bool:
    return (
        USE_SYRK
        and at.device.type == "cpu"
        and at.dtype in (torch.float32, torch.float64)
        and at.shape[0] >= 64
        and _blas() is not None
    )


def _blas():
    try:
        import threadpoolctl  # noqa: F401
        from scipy.linalg import blas
    except ImportError:  # pragma: no cover - both come with scikit-learn
        return None
    return blas


def _syrk(at: torch.Tensor, upper, beta: float = 1.0):
    """``upper = beta·upper + at atᵀ`` on the upper triangle, ``at`` ``(K, rows)``; ``upper`` a
    Fortran-ordered ``(K, K)`` NumPy array, overwritten (``None``: a new one). The caller sets
    SciPy's BLAS threads (`blas_threads`)."""
    blas = _blas()
    syrk = blas.ssyrk if at.dtype == torch.float32 else blas.dsyrk
    a = at.contiguous().numpy().T  # (rows, K), Fortran-ordered: no copy in the call
    if upper is None:
        return syrk(1.0, a, trans=1)
    return syrk(1.0, a, beta=beta, c=upper, trans=1, overwrite_c=1)
