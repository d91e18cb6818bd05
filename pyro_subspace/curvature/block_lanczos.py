"""Block Lanczos: top-``k`` eigenpairs from products of the operator with BLOCKS of vectors.

`lanczos_eigh` applies the operator to one vector at a time; for the GGN each product is a
``jvp`` + ``vjp`` pass over the data, dominated on small networks by per-pass overhead. Block
Lanczos (Golub & Underwood 1977; Golub & Van Loan, *Matrix Computations*, section 10.3.6) grows
the Krylov space ``span{Q₀, A Q₀, A² Q₀, …}`` by ``b`` vectors at a time, so the operator is
applied to ``(n, b)`` matrices: `curvature.ggn_matrix_product` does that in ONE batched pass
(``vmap`` over the ``b`` tangents of ``jvp`` and cotangents of ``vjp``).

Here the basis ``Q = [Q₀ … Q_j]`` is kept fully orthonormal (block Gram-Schmidt, twice, against
all previous blocks, then QR) and the products ``A Q`` are stored, so the Ritz values and vectors
come from the Rayleigh-Ritz problem ``T = Qᵀ (A Q)`` directly, with no reliance on the three-term
block recurrence (which rounding would break): ``T = S Θ Sᵀ``, Ritz pairs ``(θ_i, Q s_i)``, and
the residual norms ``‖A Q s_i − θ_i Q s_i‖`` are exact for each Ritz pair. Iteration stops when
the ``k`` leading residuals fall below ``tol · |θ_i|`` (ARPACK's criterion, floored at
``ε^(2/3) |θ_1|``), or when ``num_iter`` vectors have been used. Columns of a new block that
are (numerically) in the span of the basis -- an invariant subspace, e.g. a GGN of rank below
``k`` -- are replaced by random vectors orthogonal to it, so ``k`` orthonormal vectors always come
back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .lanczos import _check_int, _fix_signs, _solver_setup, checked_operator


def block_lanczos_eigh(
    matmat: Callable[[torch.Tensor], torch.Tensor],
    dim: int,
    k: int,
    block_size: int | None = None,
    num_iter: int | None = None,
    tol: float | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ``k`` largest (algebraic) eigenvalues and eigenvectors of a symmetric ``A`` by block
    Lanczos with full reorthogonalisation and Rayleigh-Ritz (module docstring).

    Args:
        matmat: ``V ↦ A V`` for a block: called with shape ``(dim, b)`` (in ``dtype``, on
            ``device``), must return shape ``(dim, b)``; cast to ``dtype``. E.g.
            ``lambda v: ggn_matrix_product(net, lik, x, v)``.
        dim: size ``n`` of the operator.
        k: how many eigenpairs, ``1 <= k <= dim``.
        block_size: ``b``, vectors per product; default ``min(k, dim)``.
        num_iter: the most vectors (operator-vector products, summed over the blocks) to use,
            in ``[k, dim]``; default ``min(dim, max(2k + 20, 3k))`` as `lanczos_eigh`. The last
            block is shortened to stay within it; ``num_iter = dim`` is exact up to rounding.
        tol: stop as soon as every one of the ``k`` leading Ritz pairs has
            ``‖A y − θ y‖ <= tol · max(|θ|, ε^(2/3) |θ_1|)`` (ARPACK's test); ``None``: use
            all ``num_iter`` vectors.
        dtype, device: of the Lanczos vectors (default float64 on CPU).
        seed: seed of the random start block (a private ``torch.Generator``).

    Returns:
        ``eigenvalues`` ``(k,)`` descending, ``eigenvectors`` ``(dim, k)`` orthonormal, each
        signed so that its largest-magnitude entry is positive, and the number of
        operator-vector products used (``<= num_iter``).

    Example:
        >>> a = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
        >>> values, vectors, products = block_lanczos_eigh(lambda v: a @ v, 10, 2, num_iter=10)
        >>> values.round(decimals=8), vectors.shape, products
        (tensor([10.,  9.], dtype=torch.float64), torch.Size([10, 2]), 10)
    """
    if not callable(matmat):
        raise TypeError(f"matmat: expected a callable V (dim, b) -> A V (dim, b), got {matmat!r}")
    dim = _check_int(dim, "dim", 1, 2**62)
    k = _check_int(k, "k", 1, dim)
    b = _check_int(min(k, dim) if block_size is None else block_size, "block_size", 1, dim)
    if num_iter is None:
        num_iter = min(dim, max(2 * k + 20, 3 * k))
    num_iter = _check_int(num_iter, "num_iter", k, dim)
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0):
        raise ValueError(f"tol: expected a float >= 0 or None, got {tol!r}")
    gen, device = _solver_setup(seed, dtype, device)

    apply = checked_operator(matmat, "matmat", dtype, device)

    def orthonormal_block(r: torch.Tensor, basis: torch.Tensor, scale: float) -> torch.Tensor:
        """Orthonormal columns spanning ``r`` minus its part in ``basis``; columns that vanish
        (relative to ``scale``) are replaced by random directions orthogonal to everything."""
        for _ in range(2):  # "twice is enough"
            r = r - basis @ (basis.T @ r)
        q, rr = torch.linalg.qr(r)
        dead = rr.diagonal().abs() <= 1e-10 * scale
        if dead.any():
            keep = torch.cat([basis, q[:, ~dead]], 1)
            fresh = torch.randn(dim, int(dead.sum()), generator=gen, dtype=dtype).to(device)
            for _ in range(2):
                fresh = fresh - keep @ (keep.T @ fresh)
            q[:, dead] = torch.linalg.qr(fresh).Q
        return q

    # Q, A Q (dim, m) and Qᵀ A Q, (A Q)ᵀ (A Q) (m, m), in buffers grown by doubling
    q_all = aq_all = torch.empty(dim, 0, dtype=dtype, device=device)
    t = gram = torch.empty(0, 0, dtype=dtype, device=device)
    m, scale = 0, 0.0
    block = orthonormal_block(torch.randn(dim, b, generator=gen, dtype=dtype).to(device), q_all, 1)
    while True:
        block = block[:, : num_iter - m]  # stay within the budget
        image = apply(block)
        nb = block.shape[1]
        if m + nb > q_all.shape[1]:
            cap = min(num_iter, max(2 * q_all.shape[1], m + nb, 2 * k + 2 * b))
            q_all, aq_all = _grow(q_all, (dim, cap)), _grow(aq_all, (dim, cap))
            t, gram = _grow(t, (cap, cap)), _grow(gram, (cap, cap))
        q_all[:, m : m + nb], aq_all[:, m : m + nb] = block, image
        basis, images, m = q_all[:, : m + nb], aq_all[:, : m + nb], m + nb
        cross = basis.T @ image  # (m, b): the new columns of T
        t[:m, m - nb : m], t[m - nb : m, :m] = cross, cross.T
        corner = t[m - nb : m, m - nb : m]
        t[m - nb : m, m - nb : m] = (corner + corner.T) / 2
        cross = images.T @ image
        gram[:m, m - nb : m], gram[m - nb : m, :m] = cross, cross.T
        values, s = torch.linalg.eigh(t[:m, :m])
        order = values.argsort(descending=True)[:k]
        values, s = values[order], s[:, order]
        scale = max(scale, float(image.norm(dim=0).max()), float(values.abs().max()))
        if m >= num_iter or m == dim:
            break
        # ‖A y − θ y‖² = sᵀ (AQ)ᵀ(AQ) s − θ² for the Ritz vector y = Q s (Q orthonormal)
        norms = ((s * (gram[:m, :m] @ s)).sum(0) - values**2).clamp_min(0).sqrt()
        floor = torch.finfo(dtype).eps ** (2 / 3) * values.abs().max()
        bound = (0.0 if tol is None else tol) * torch.maximum(values.abs(), floor)
        # the estimate loses ~sqrt(eps)·|θ_1| to cancellation: below that, check exactly
        noise = (64 * torch.finfo(dtype).eps) ** 0.5 * values.abs().max()
        open_ = (norms > bound + noise).nonzero().flatten()
        if tol is not None and m >= k and open_.numel() == 0:
            exact = (images @ s - (basis @ s) * values).norm(dim=0)  # confirm without cancellation
            open_ = (exact > bound).nonzero().flatten()
            if open_.numel() == 0:
                break
        # next block: the residuals of the leading unconverged Ritz pairs (they lie in the block
        # Krylov space), orthogonal to the basis; converged pairs cost no more products
        if open_.numel() == 0:  # every Ritz pair exact but fewer than k: new random directions
            residuals = torch.randn(dim, b, generator=gen, dtype=dtype).to(device)
        else:
            pick = s[:, open_[:b]]
            residuals = images @ pick - (basis @ pick) * values[open_[:b]]
        block = orthonormal_block(residuals, basis, max(scale, 1e-300))
    return values, _fix_signs(basis @ s), m


def _grow(a: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A zero tensor of ``shape`` with ``a`` copied into its leading corner."""
    out = a.new_zeros(shape)
    out[: a.shape[0], : a.shape[1]] = a
    return out
