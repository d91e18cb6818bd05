"""The Gram product ``Σ_n A_nᵀ A_n`` of Jacobian blocks (Subnetwork Inference eqs. 9, 15): one
matrix multiply per block, BLAS ``syrk`` on CPU. Below `subspaces` and `curvature`, which both
accumulate GGNs with it."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ._linalg import blas_threads


def gram_from_blocks(
    blocks: Iterator[tuple[torch.Tensor, torch.Tensor]],
    diagonal: bool = False,
    total: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Accumulate ``Σ_n A_nᵀ A_n`` (``(K, K)``, or its diagonal ``(K,)``) over blocks
    ``(outputs, A (n, C, K))`` onto ``total``: one matrix multiply ``Aᵀ A`` per block, ``A``
    read as ``(n·C, K)`` in whichever row order its memory has (the sum does not depend on it)."""
    upper = None  # a symmetric rank-k update (BLAS syrk) fills only the upper triangle
    for _, a in blocks:
        k = a.shape[-1]
        if a.permute(2, 1, 0).is_contiguous():  # column-major blocks: Aᵀ is a free reshape
            at = a.permute(2, 1, 0).reshape(k, -1)
        else:
            at = a.reshape(-1, k).T
        if diagonal:
            part = at.square().sum(1)
            total = part if total is None else total + part
        elif upper is not None or _syrk_ok(at):
            upper = _syrk(at, upper)
        else:
            total = at @ at.T if total is None else total.addmm_(at, at.T)
    if upper is not None:
        part = torch.from_numpy(upper).to(at.device)
        part = part + part.triu(1).T  # the full symmetric matrix from its upper triangle
        total = part if total is None else total + part
    return total


#: Use BLAS ``syrk`` (half the multiplications of ``Aᵀ A``) through SciPy for CPU blocks.
USE_SYRK = True


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


def _syrk(at: torch.Tensor, upper):
    """``upper += (at atᵀ)`` on the upper triangle, ``at`` ``(K, rows)``; ``upper`` a
    Fortran-ordered ``(K, K)`` NumPy array (``None``: start at zero). SciPy's BLAS runs with
    torch's thread count."""
    blas = _blas()
    syrk = blas.ssyrk if at.dtype == torch.float32 else blas.dsyrk
    a = at.detach().contiguous().numpy().T  # (rows, K), Fortran-ordered: no copy in the call
    with blas_threads():
        if upper is None:
            return syrk(1.0, a, trans=1)
        return syrk(1.0, a, beta=1.0, c=upper, trans=1, overwrite_c=1)
