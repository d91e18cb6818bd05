"""Small linear-algebra helpers shared by the likelihoods and the Laplace posteriors.

The one place where a Cholesky factor is repaired with a stated jitter (never a silent NaN).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .validation import positive_int

#: Jitters tried, as multiples of the mean diagonal, before a factorisation gives up.
JITTERS = (0.0, 1e-10, 1e-8, 1e-6)


def cholesky(a: torch.Tensor, what: str) -> torch.Tensor:
    """Cholesky factor of ``a`` ``(..., K, K)``; on failure retries with ``jitter · mean(diag)``
    added (``1e-10, 1e-8, 1e-6``), warning with a ``RuntimeWarning``; beyond that raises
    ``torch.linalg.LinAlgError`` naming the matrix ``what``."""
    scale = a.diagonal(dim1=-2, dim2=-1).abs().mean(-1, keepdim=True).clamp_min(1e-300)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for jitter in JITTERS:
        shifted = a + (jitter * scale)[..., None] * eye if jitter else a
        chol, info = torch.linalg.cholesky_ex(shifted)
        if not bool(info.any()):
            if jitter:
                warnings.warn(
                    f"{what}: not positive definite; added {jitter:g} x mean diagonal",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return chol
    raise torch.linalg.LinAlgError(f"{what}: not positive definite even with jitter 1e-6")


def precision_to_scale_tril(precision: torch.Tensor) -> torch.Tensor:
    """Lower-triangular ``L`` with ``L Lᵀ = precision⁻¹``: one Cholesky factor of the
    index-reversed precision and one triangular solve, so the inverse is never factorised a
    second time (which can fail for an ill-conditioned precision). On an idle 2-core CPU it
    costs 0.8 s at ``K`` = 2,700, 1.6x the ``cholesky_inverse`` + second-Cholesky route."""
    flipped = cholesky(precision.flip(-2, -1), "posterior precision")
    l_inv = flipped.flip(-2, -1).mT  # lower triangular, l_inv.mT @ l_inv = precision
    lapack = _lapack(l_inv)
    if lapack is not None:  # LAPACK trtri: K³/3 multiplications, a third of a solve against I
        trtri = lapack.strtri if l_inv.dtype == torch.float32 else lapack.dtrtri
        upper = l_inv.contiguous().numpy().T  # Fortran view of l_invᵀ (upper): no copy
        with blas_threads():
            inv, info = trtri(upper, lower=0)
        if info == 0:
            return torch.from_numpy(inv.T.copy()).tril_()
    eye = torch.eye(precision.shape[-1], dtype=precision.dtype, device=precision.device)
    return torch.linalg.solve_triangular(l_inv, eye, upper=False)


def tril_outer(scale_tril: torch.Tensor) -> torch.Tensor:
    """``S Sᵀ`` ``(K, K)`` of a lower-triangular ``S`` (a covariance from its scale): LAPACK
    ``lauum`` on the index-reversed factor on CPU (``K³/3`` multiplications instead of the
    ``K³`` of a general product), a matrix product elsewhere."""
    lapack = _lapack(scale_tril)
    if lapack is not None:
        lauum = lapack.slauum if scale_tril.dtype == torch.float32 else lapack.dlauum
        # With J the index reversal, M = (J S J)ᵀ is lower triangular; read in Fortran order
        # from the C-ordered J S J without a copy. lauum(lower) gives Mᵀ M = J S Sᵀ J on the
        # lower triangle (Fortran), i.e. the upper triangle of the C-ordered result.
        m = scale_tril.flip(-2, -1).numpy().T
        with blas_threads():
            out, info = lauum(m, lower=1)
        if info == 0:
            full = torch.from_numpy(out.T.copy()).triu_()
            return (full + full.triu(1).mT).flip(-2, -1)
    return scale_tril @ scale_tril.mT


def symmetrize_(a: torch.Tensor, upper: bool | None = None, block: int = 256) -> torch.Tensor:
    """Make the square ``a`` ``(K, K)`` symmetric in place and return it: ``upper=True`` copies
    the upper triangle onto the lower, ``False`` the lower onto the upper, ``None`` averages
    ``(a + aᵀ)/2``. Temporaries are ``block`` rows at most, never ``K × K``."""
    k = a.shape[-1]
    for s in range(0, k, block):
        e = min(s + block, k)
        low, up, diag = a[e:, s:e], a[s:e, e:], a[s:e, s:e]
        if upper is None:
            mean = (low + up.T) / 2
            low.copy_(mean)
            up.copy_(mean.T)
            diag.copy_((diag + diag.T) / 2)
        elif upper:
            low.copy_(up.T)
            diag.copy_(diag.triu() + diag.triu(1).T)
        else:
            up.copy_(low.T)
            diag.copy_(diag.tril() + diag.tril(-1).T)
    return a


def reverse_(a: torch.Tensor, block: int = 1 << 16) -> torch.Tensor:
    """Reverse both indices of a contiguous square ``a`` in place (``J a J`` with ``J`` the
    index reversal: the flat buffer read backwards); temporaries of ``block`` numbers."""
    flat = a.view(-1)
    n = flat.numel()
    if a.device.type == "cpu" and a.dtype in (torch.float32, torch.float64):
        # NumPy's reversed copies: 20x faster than torch's flip of a slice (1.0 s at K = 8,000)
        arr = flat.detach().numpy()
        buf = np.empty(min(block, n // 2), dtype=arr.dtype)
        for s in range(0, n // 2, block):
            e = min(s + block, n // 2)
            head, tail, saved = arr[s:e], arr[n - e : n - s], buf[: e - s]
            np.copyto(saved, head)
            np.copyto(head, tail[::-1])
            np.copyto(tail, saved[::-1])
        return a
    for s in range(0, n // 2, block):
        e = min(s + block, n // 2)
        head, tail = flat[s:e], flat[n - e : n - s]
        saved = head.clone()
        head.copy_(tail.flip(0))
        tail.copy_(saved.flip(0))
    return a


#: `posterior_factors_` refuses a float32 precision whose Cholesky factor has a diagonal ratio
#: above ``√`` this (a lower bound on its condition number, so float32 rounding could exceed
#: about ``1e-3`` relative); the caller then factorises it in float64.
FLOAT32_MAX_CONDITION = 1e4


def posterior_factors_(
    precision: torch.Tensor, scale_tril: torch.Tensor, covariance: torch.Tensor
) -> bool:
    """Write ``L`` (lower triangular, ``L Lᵀ = precision⁻¹``) into ``scale_tril`` and
    ``precision⁻¹`` into ``covariance``, in place, in their dtype (float32 or float64), with no
    ``K × K`` temporary: LAPACK ``potrf`` of the index-reversed precision ``J P J = M Mᵀ``,
    ``trtri`` (``M⁻¹``), ``lauum`` (``M⁻ᵀ M⁻¹``); then ``L = J M⁻ᵀ J`` and
    ``Σ = J M⁻ᵀ M⁻¹ J`` (the same ``K³`` multiplications as `precision_to_scale_tril` +
    `tril_outer`); ``potrf`` and ``trtri`` blocked on torch's BLAS above `BLOCKED_ROW_BYTES`
    (`cholesky_reversed_`; ``lauum`` stays LAPACK's). Returns ``False`` (buffers unspecified)
    when the LAPACK path does not apply (not CPU, not contiguous, no SciPy), ``precision`` is
    not positive definite in its dtype, or in float32 its condition number is evidently above
    `FLOAT32_MAX_CONDITION` (the squared ratio of the factor's largest and smallest diagonal
    entries, a lower bound); the caller then takes the robust route (`precision_to_scale_tril`
    in float64, with jitter)."""
    bufs = (precision, scale_tril, covariance)
    lapack = _lapack(precision)
    if lapack is None or any(
        not b.is_contiguous() or b.dtype != precision.dtype or b.shape != precision.shape
        for b in bufs
    ):
        return False
    single = precision.dtype == torch.float32
    lauum = lapack.slauum if single else lapack.dlauum
    p, s, c = (b.detach().numpy() for b in bufs)
    import numpy as np

    np.copyto(s.reshape(-1), p.reshape(-1)[::-1])  # J P J; its Fortran view is the same matrix
    # Fortran lower M with J P J = M Mᵀ (the upper triangle keeps J P J: LAPACK reads only the
    # lower one, and `tril_` below clears it, faster than potrf's clean=1); blocked on torch's
    # BLAS above `BLOCKED_ROW_BYTES`
    info, condition = cholesky_reversed_(scale_tril)
    if info != 0 or (single and condition > FLOAT32_MAX_CONDITION):
        return False
    if _invert_reversed_cholesky_(scale_tril) != 0:  # M⁻¹, lower (Fortran)
        return False
    with blas_threads():
        np.copyto(c, s)
        out, info = lauum(c.T, lower=1, overwrite_c=1)  # M⁻ᵀ M⁻¹ on the Fortran lower triangle
        if info != 0 or not np.shares_memory(out, c):
            return False
    reverse_(scale_tril).tril_()  # C order held (M⁻¹)ᵀ = M⁻ᵀ: J M⁻ᵀ J is L
    reverse_(symmetrize_(covariance, upper=True))  # Fortran lower = C upper
    return True


_CONTROLLER = None


def blas_threads():
    """Context manager: SciPy's BLAS/LAPACK run with torch's thread count (``threadpoolctl``)."""
    global _CONTROLLER
    if _CONTROLLER is None:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER = ThreadpoolController()
    return _CONTROLLER.limit(limits=torch.get_num_threads(), user_api="blas")


def blas_module(a: torch.Tensor):
    """SciPy's BLAS for an unbatched float CPU matrix of at least 64 rows, else ``None``."""
    if _lapack(a) is None:
        return None
    from scipy.linalg import blas

    return blas


def _lapack(a: torch.Tensor):
    """SciPy's LAPACK for an unbatched float CPU matrix of at least 64 rows, else ``None``."""
    if a.dim() != 2 or a.device.type != "cpu" or a.dtype not in (torch.float32, torch.float64):
        return None
    if a.shape[-1] < 64 or a.requires_grad:
        return None
    try:
        import threadpoolctl  # noqa: F401
        from scipy.linalg import lapack
    except ImportError:  # pragma: no cover - both come with scikit-learn
        return None
    return lapack


def eigh_(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``(n,)`` (ascending) and eigenvectors ``(n, n)`` (columns) of the symmetric
    part of the square ``a``, which is overwritten (symmetrised in place, then LAPACK's
    ``syevd`` on its Fortran view on CPU: the vectors take ``a``'s memory and the only
    temporary is ``syevd``'s workspace, instead of ``torch.linalg.eigh``'s copy of the input
    beside it); ``torch.linalg.eigh`` elsewhere."""
    symmetrize_(a)
    lapack = _lapack(a)
    if lapack is not None and a.is_contiguous():
        syevd = lapack.ssyevd if a.dtype == torch.float32 else lapack.dsyevd
        with blas_threads():  # the Fortran view of the symmetric C-ordered a is a itself
            w, v, info = syevd(a.detach().numpy().T, compute_v=1, lower=0, overwrite_a=1)
        if info == 0:
            return torch.from_numpy(w), torch.from_numpy(v)
    return torch.linalg.eigh(a)


def logdet(a: torch.Tensor, what: str) -> torch.Tensor:
    """``log |a|`` of a symmetric positive-definite ``a`` via `cholesky`."""
    return 2 * cholesky(a, what).diagonal(dim1=-2, dim2=-1).log().sum(-1)


def gaussian_draws(
    mean: torch.Tensor, cov: torch.Tensor, num_samples: int, generator: torch.Generator | None
) -> torch.Tensor:
    """``num_samples`` draws of ``N(mean, cov)`` per row: ``mean`` ``(N, O)``, ``cov``
    ``(N, O, O)``; returns ``(S, N, O)``. ``generator=None`` uses torch's global generator."""
    positive_int(num_samples, "num_samples")
    chol = cholesky(cov, "output covariance")
    eps = torch.randn(
        num_samples, *mean.shape, generator=generator, dtype=mean.dtype, device=mean.device
    )
    return mean + torch.einsum("nop,snp->sno", chol, eps)


def row_gram(a: torch.Tensor) -> torch.Tensor:
    """``A Aᵀ`` ``(r, r)`` of ``A`` ``(r, K)``, exactly symmetric: BLAS ``syrk`` on CPU (half
    the multiplications of a general product), a matrix product elsewhere."""
    blas = blas_module(a)
    if blas is None:
        return symmetrize_(a @ a.mT)
    syrk = blas.ssyrk if a.dtype == torch.float32 else blas.dsyrk
    with blas_threads():  # the Fortran view of the C-ordered A is Aᵀ (K, r): syrk(Aᵀ)ᵀ(Aᵀ)
        upper = syrk(1.0, a.contiguous().numpy().T, trans=1)
    return symmetrize_(torch.from_numpy(upper), upper=True).contiguous()


def solve_lower(chol: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``chol⁻¹ A`` ``(r, K)`` for a lower-triangular ``chol`` ``(r, r)``: BLAS ``trsm`` on CPU
    (on the transposed, Fortran-ordered views: no copies beyond the result), else torch's."""
    blas = blas_module(a)
    if blas is None or chol.dtype != a.dtype:
        return torch.linalg.solve_triangular(chol, a, upper=False)
    trsm = blas.strsm if a.dtype == torch.float32 else blas.dtrsm
    with blas_threads():  # Xᵀ = Aᵀ chol⁻ᵀ: Aᵀ and cholᵀ (upper) are the Fortran views
        out = trsm(1.0, chol.contiguous().numpy().T, a.contiguous().numpy().T, side=1, lower=0)
    return torch.from_numpy(out.T)  # C-ordered (r, K)


# ---------------------------------------------------------------------- in-place factorisations
# The full Laplace structure holds two (K, K) matrices (the GGN and one factor) at the paper's
# K = 42,438: every helper below writes into memory its caller owns and forms no K x K
# temporary (LAPACK on the Fortran view of a C-ordered array; the caller checks `lapack_for`).


def lapack_for(a: torch.Tensor):
    """SciPy's LAPACK when the in-place helpers below apply to ``a`` (an unbatched contiguous
    float CPU matrix of at least 64 rows, not requiring grad), else ``None``."""
    return _lapack(a) if a.is_contiguous() else None


def reversed_copy_(out: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``out ← J a J`` (both indices reversed; ``J`` the index reversal) for square ``a`` and a
    contiguous ``out`` of the same shape and dtype, with no temporary (the flat buffer read
    backwards); returns ``out``."""
    if a.is_contiguous() and a.dtype == out.dtype and a.device.type == "cpu":
        import numpy as np

        np.copyto(out.detach().numpy().reshape(-1), a.detach().numpy().reshape(-1)[::-1])
        return out
    return out.copy_(a.flip(-2, -1))


#: Rows per block of the blocked in-place factorisations (`cholesky_upper_`, `triu_inverse_`):
#: their temporaries are ``b × b`` and ``b × K`` numbers (at ``K`` = 5,000-8,000 on 2 threads,
#: 1,024 was faster than 256, 512 and 2,048).
FACTOR_BLOCK = 1024

#: From this many bytes per matrix row (float32 ``K`` > 16,384, float64 ``K`` > 8,192) the
#: in-place Cholesky factor and triangular inverse of `cholesky_reversed_`,
#: `scale_tril_from_reversed_cholesky_` and `posterior_factors_` are blocked on torch's BLAS
#: (`cholesky_upper_`, `triu_inverse_`) instead of SciPy's LAPACK: SciPy's bundled OpenBLAS
#: (0.3.30) ``potrf`` with 2 threads writes past its buffer, a SEGFAULT, from about 170,000
#: bytes per row (float32 ``K`` = 42,438 and float64 ``K`` = 23,170 crash; float32 36,000 and
#: float64 21,213 do not; 1, 4 or 8 threads do not at 42,438; its ``trtri`` at 42,438 float32
#: does not crash). Below, LAPACK: on 2 shared cores (load 3.5-4) at ``K`` = 8,000 its best
#: factor + inverse was 1.4x (float32) and 1.5x (float64) faster than the blocked code's, while
#: at 5,000 the blocked code was faster (0.2x, 0.7x: OpenBLAS suffers more under the load).
BLOCKED_ROW_BYTES = 1 << 16


def _blocked(a: torch.Tensor) -> bool:
    """The in-place factorisations of ``a`` take the blocked torch route (`BLOCKED_ROW_BYTES`)."""
    return a.shape[-1] * a.element_size() > BLOCKED_ROW_BYTES


def cholesky_upper_(a: torch.Tensor, block: int | None = None) -> int:
    """In place on the square ``a`` ``(K, K)`` (a CPU or device tensor, rows of stride 1 or
    not): its upper triangle, read as the symmetric ``A``, becomes ``U`` (upper triangular) with
    ``A = Uᵀ U``; the strict lower triangle is not touched. Blocked left-looking Cholesky on
    torch's BLAS, per block row ``k:e``: the diagonal block updated and factorised on a ``b × b``
    copy (`torch.linalg.cholesky_ex`), the row panel ``a[k:e, e:]`` updated by one ``addmm_`` on
    its view and solved by `torch.linalg.solve_triangular` (one ``b × K`` temporary): ``K³/3``
    multiplications, no ``K × K`` temporary, no OpenBLAS (`BLOCKED_ROW_BYTES`). ``block``:
    `FACTOR_BLOCK` by default. Returns ``0``, or as LAPACK's ``info`` the order of the first
    leading minor that is not positive definite (``a`` then partly overwritten)."""
    n, block = a.shape[-1], block or FACTOR_BLOCK
    with torch.no_grad():
        for k in range(0, n, block):
            e = min(k + block, n)
            d = a[k:e, k:e]
            sym = d.triu()
            sym += sym.triu(1).mT  # the symmetric block from its upper triangle
            top = a[:k, k:e]  # U's rows above, this block's columns
            if k:
                sym.addmm_(top.mT, top, alpha=-1)
            u, info = torch.linalg.cholesky_ex(sym, upper=True)
            if int(info):
                return k + int(info)
            d.copy_(u + d.tril(-1))
            if e < n:
                row = a[k:e, e:]
                if k:
                    row.addmm_(top.mT, a[:k, e:], alpha=-1)
                # Uᵀ X = row as Xᵀ U = rowᵀ: rowᵀ is column-major, as LAPACK's trsm wants it
                row.copy_(torch.linalg.solve_triangular(u, row.mT, upper=True, left=False).mT)
    return 0


def triu_inverse_(a: torch.Tensor, block: int | None = None) -> int:
    """In place on the square ``a`` ``(K, K)``: its upper triangle ``U`` (upper triangular)
    becomes ``U⁻¹``; the strict lower triangle is not touched. Blocked on torch's BLAS, block
    rows from the last: ``X_jj = U_jj⁻¹`` (a ``b × b`` solve) and
    ``X_j,rest = -U_jj⁻¹ (U_j,rest X_rest,rest)`` (the product by column blocks of the inverted
    ``X_rest,rest``, its diagonal blocks' upper triangles copied, ``b × b``, then a triangular
    solve; two ``b × K`` temporaries): about ``K³/3 (1 + 3b/2K)`` multiplications (LAPACK's
    ``trtri``: ``K³/3``), no ``K × K`` temporary.
    ``block``: `FACTOR_BLOCK` by default. Returns ``0``, or as LAPACK's ``info`` the index
    (from 1) of a zero diagonal entry (``a`` then untouched)."""
    n, block = a.shape[-1], block or FACTOR_BLOCK
    zero = (a.diagonal() == 0).nonzero()
    if len(zero):
        return int(zero[0, 0]) + 1
    buf = None
    with torch.no_grad():
        eye = torch.eye(min(block, n), dtype=a.dtype, device=a.device)
        for j in reversed(range(0, n, block)):
            e = min(j + block, n)
            d = a[j:e, j:e]
            u = d.triu()
            x = torch.linalg.solve_triangular(u, eye[: e - j, : e - j], upper=True)
            if e < n:
                row = a[j:e, e:]  # U_j,rest
                if buf is None:  # as wide as the first block row's (the widest) needs
                    buf = a.new_empty(block, n - block)
                t = buf[: e - j, : n - e]
                for c in range(e, n, block):  # t = U_j,rest X_rest,rest by column blocks
                    c2 = min(c + block, n)
                    tc = t[:, c - e : c2 - e]
                    torch.mm(row[:, c - e : c2 - e], a[c:c2, c:c2].triu(), out=tc)
                    if c > e:
                        tc.addmm_(row[:, : c - e], a[e:c, c:c2])
                # X_j,rest = -U_jj⁻¹ t: a triangular solve (b²m/2, half of x @ t), transposed
                # so that tᵀ is the column-major operand LAPACK's trsm wants
                y = torch.linalg.solve_triangular(u.mT, t.mT, upper=False, left=False)
                torch.neg(y.mT, out=row)
            d.copy_(x + d.tril(-1))
    return 0


def cholesky_reversed_(s: torch.Tensor) -> tuple[int, float]:
    """In place on a contiguous CPU ``s`` holding ``J P J`` (symmetric): LAPACK ``potrf`` so
    that ``s``'s Fortran view holds ``M`` lower with ``J P J = M Mᵀ`` (the C-ordered ``s`` holds
    ``Mᵀ`` on its upper triangle; its strict lower triangle keeps ``J P J``). ``K³/3``
    multiplications, no temporary (`lapack_for` must apply). Returns LAPACK's ``info`` (``0``:
    positive definite) and the squared ratio of ``M``'s largest and smallest diagonal entries
    (a lower bound on the condition number of ``P``). Above `BLOCKED_ROW_BYTES` the same in
    place by `cholesky_upper_` (the C-ordered upper triangle: ``Mᵀ``), not OpenBLAS."""
    if _blocked(s):
        info = cholesky_upper_(s.detach())
        if info != 0:
            return info, float("inf")
        diag = s.detach().diagonal().double()
        return 0, float((diag.max() / diag.min()) ** 2)
    lapack = _lapack(s)
    potrf = lapack.spotrf if s.dtype == torch.float32 else lapack.dpotrf
    arr = s.detach().numpy()
    with blas_threads():
        m, info = potrf(arr.T, lower=1, clean=0, overwrite_a=1)
    if info != 0:
        return int(info), float("inf")
    if not np.shares_memory(m, arr):  # pragma: no cover - SciPy copied
        arr[...] = m.T
    diag = np.diagonal(arr).astype(np.float64)
    return 0, float((diag.max() / diag.min()) ** 2)


def scale_tril_from_reversed_cholesky_(s: torch.Tensor) -> torch.Tensor:
    """After `cholesky_reversed_`: ``s ← L = J M⁻ᵀ J`` in place (LAPACK ``trtri``, ``K³/3``
    multiplications, then the in-place index reversal), lower triangular with
    ``L Lᵀ = J M⁻ᵀ M⁻¹ J = P⁻¹``: the Cholesky factor of the covariance; returns ``s``. Above
    `BLOCKED_ROW_BYTES` the inverse by `triu_inverse_`, not OpenBLAS."""
    info = _invert_reversed_cholesky_(s)
    if info != 0:
        raise torch.linalg.LinAlgError(f"posterior precision: singular factor (trtri info {info})")
    return reverse_(s).tril_()  # C order held (M⁻¹)ᵀ = M⁻ᵀ: J M⁻ᵀ J is L


def _invert_reversed_cholesky_(s: torch.Tensor) -> int:
    """``M⁻¹`` on the Fortran lower triangle of ``s`` (the C-ordered upper: ``Mᵀ`` becomes
    ``M⁻ᵀ``) in place: LAPACK ``trtri``, or `triu_inverse_` above `BLOCKED_ROW_BYTES`; returns
    ``info`` (``0``: done)."""
    if _blocked(s):
        return triu_inverse_(s.detach())
    lapack = _lapack(s)
    trtri = lapack.strtri if s.dtype == torch.float32 else lapack.dtrtri
    arr = s.detach().numpy()
    with blas_threads():
        inv, info = trtri(arr.T, lower=1, overwrite_c=1)  # M⁻¹ on the Fortran lower triangle
    if info == 0 and not np.shares_memory(inv, arr):  # pragma: no cover - SciPy copied
        arr[...] = inv.T
    return int(info)


def solve_reversed_cholesky(s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """After `cholesky_reversed_` (``J P J = M Mᵀ``): ``Y = X J M⁻ᵀ`` ``(m, K)`` for ``X``
    ``(m, K)``, so that ``X P⁻¹ Xᵀ = Y Yᵀ`` (BLAS ``trsm``, ``m·K²/2`` multiplications; only the
    result beside ``X``). Above `BLOCKED_ROW_BYTES` (and off CPU) torch's ``trsm`` on the
    C-ordered upper triangle ``Mᵀ`` (``Y Mᵀ = X J``, no copy of it), as the factorisations
    there avoid SciPy's OpenBLAS."""
    if _blocked(s) or s.device.type != "cpu":
        xr = x.to(s.dtype).flip(-1)
        return torch.linalg.solve_triangular(s.detach(), xr, upper=True, left=False)
    from scipy.linalg import blas

    trsm = blas.strsm if s.dtype == torch.float32 else blas.dtrsm
    xr = x.to(s.dtype).flip(-1).contiguous()  # X J: rows of (m, K)
    with blas_threads():  # Fortran: Yᵀ = M⁻¹ (X J)ᵀ, (X J)ᵀ the Fortran view of the C-ordered X J
        out = trsm(1.0, s.detach().numpy().T, xr.numpy().T, side=0, lower=1, overwrite_b=1)
    return torch.from_numpy(out.T)


def tril_outer_(out: torch.Tensor, scale_tril: torch.Tensor) -> torch.Tensor:
    """``out ← L Lᵀ`` ``(K, K)`` of a lower-triangular ``L`` into the contiguous ``out`` (LAPACK
    ``lauum`` on the index-reversed copy: ``K³/3`` multiplications and no temporary on CPU; a
    matrix product elsewhere), exactly symmetric; returns ``out``."""
    lapack = lapack_for(out)
    if lapack is None or scale_tril.dtype != out.dtype:
        return out.copy_(symmetrize_(scale_tril @ scale_tril.mT))
    lauum = lapack.slauum if out.dtype == torch.float32 else lapack.dlauum
    reversed_copy_(out, scale_tril)  # C order J L J (upper): its Fortran view N = (J L J)ᵀ lower
    arr = out.detach().numpy()
    with blas_threads():  # Nᵀ N = J L Lᵀ J on the Fortran lower = C upper triangle
        res, info = lauum(arr.T, lower=1, overwrite_c=1)
    if info != 0 or not np.shares_memory(res, arr):  # pragma: no cover
        return out.copy_(symmetrize_(scale_tril @ scale_tril.mT))
    return reverse_(symmetrize_(out, upper=True))


def eigvalsh_(a: torch.Tensor) -> torch.Tensor:
    """Eigenvalues ``(K,)`` (ascending, in ``a``'s dtype) of the symmetric ``a``, which is
    overwritten: LAPACK ``syevd`` without vectors on CPU (workspace ``O(K)``: the
    tridiagonal reduction in ``a``'s own memory), ``torch.linalg.eigvalsh`` elsewhere (a copy)."""
    lapack = lapack_for(a)
    if lapack is not None:
        syevd = lapack.ssyevd if a.dtype == torch.float32 else lapack.dsyevd
        with blas_threads():
            w, _, info = syevd(a.detach().numpy().T, compute_v=0, lower=0, overwrite_a=1)
        if info == 0:
            return torch.from_numpy(w)
    return torch.linalg.eigvalsh(a)


def eigh_evr_(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``(K,)`` (ascending) and eigenvectors ``(K, K)`` (columns) of the symmetric
    ``a``, which is overwritten: ``scipy.linalg.eigh(driver="evr", overwrite_a=True)`` on CPU
    (LAPACK ``syevr``: the vectors are the one new ``(K, K)`` matrix, its workspace is
    ``O(K)``, where ``syevd``, which ``torch.linalg.eigh`` calls, needs about ``2K²`` more);
    ``torch.linalg.eigh`` elsewhere."""
    lapack = lapack_for(a)
    if lapack is not None:
        import scipy.linalg

        with blas_threads():
            w, v = scipy.linalg.eigh(
                a.detach().numpy().T, driver="evr", overwrite_a=True, check_finite=False
            )
        return torch.from_numpy(w), torch.from_numpy(v)
    return torch.linalg.eigh(a)
