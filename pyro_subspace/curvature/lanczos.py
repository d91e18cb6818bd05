"""Top-``k`` eigenpairs of a symmetric operator given only as a matrix-vector product.

Subspace Inference (Izmailov et al., 2019), appendix E, runs GPyTorch's Lanczos on the Hessian
and Fisher; this wraps the same routine, ``linear_operator.utils.lanczos.lanczos_tridiag``
(undocumented upstream), which always fully reorthogonalises its Krylov basis. Its contract,
as read from the source of linear_operator 0.6:

- ``lanczos_tridiag(matmul_closure, max_iter, dtype, device, matrix_shape=(n, n),
  init_vecs=(n, 1))`` calls ``matmul_closure`` on ``(n, 1)`` matrices and returns
  ``Q`` of shape ``(n, m)`` (orthonormal columns) and the tridiagonal ``T = Qᵀ A Q`` of
  shape ``(m, m)``, ``m <= max_iter``;
- it stops early when an off-diagonal ``β`` drops below ``1e-6`` (an invariant subspace), but
  never checks the first ``β₀`` (dividing by zero, or normalising rounding noise into a
  non-orthogonal second vector, when ``q₀`` is already an eigenvector); it fails for
  ``max_iter = 1``.

This wrapper scales the operator by ``‖A q₀‖`` so that stopping rule is relative, checks
``β₀`` itself (reusing ``A q₀``, so no extra product), handles ``A = 0`` and one-step blocks,
and restarts on early stops with a fresh start vector orthogonal to
the basis found so far (deflating it), until ``num_iter`` vectors are collected. So ranks
below ``k`` (a GGN with fewer data than weights) still give ``k`` orthonormal vectors.
Limitation of single-vector Lanczos: a repeated eigenvalue may be found only once unless the
Krylov space breaks down before ``num_iter``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from linear_operator.utils.lanczos import lanczos_tridiag

from ..validation import check_int


def _check_int(value: object, name: str, low: int, high: int) -> int:
    return check_int(value, name, low, high)


def _solver_setup(seed: object, dtype: object, device) -> tuple[torch.Generator, torch.device]:
    """The checked ``seed``'s private generator and the device (CPU by default); a
    ``TypeError`` unless ``dtype`` is a floating ``torch.dtype``."""
    seed = _check_int(seed, "seed", -(2**63), 2**64 - 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    return torch.Generator().manual_seed(seed), torch.device("cpu" if device is None else device)


def _valid_prefix(q: torch.Tensor, t: torch.Tensor) -> int:
    """Number of leading Lanczos vectors before a zero-``β`` breakdown produced NaNs."""
    ok = torch.isfinite(q).all(0) & torch.isfinite(t.diagonal())
    ok[1:] &= torch.isfinite(t.diagonal(-1))
    return int(ok.long().cumprod(0).sum())


def lanczos_eigh(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    dim: int,
    k: int,
    num_iter: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest (algebraic) eigenvalues and their eigenvectors of a symmetric ``A``.

    Lanczos (``lanczos_tridiag``, full reorthogonalisation) builds ``A ≈ Q T Qᵀ``; then
    ``torch.linalg.eigh(T) = S Θ Sᵀ`` gives Ritz values ``Θ`` and vectors ``Q S``.

    Args:
        matvec: ``v ↦ A v`` for ONE vector: called with shape ``(dim,)`` (in ``dtype``, on
            ``device``) and must return shape ``(dim,)``; the result is cast to ``dtype``.
            E.g. ``lambda v: ggn_vector_product(net, lik, x, v)`` (which casts ``v`` to the
            network's dtype itself).
        dim: size ``n`` of the operator.
        k: how many eigenpairs, ``1 <= k <= dim``.
        num_iter: Lanczos vectors (= matrix-vector products), in
            ``[k, dim]``; default ``min(dim, max(2k + 20, 3k))``. ``num_iter = dim`` is exact up
            to rounding.
        dtype: floating dtype of the Lanczos vectors.
        device: device of the Lanczos vectors; default CPU.
        seed: seed of the random start vectors (a private ``torch.Generator``).

    Returns:
        ``eigenvalues`` ``(k,)`` in descending order and ``eigenvectors`` ``(dim, k)`` with
        orthonormal columns, each signed so that its largest-magnitude entry is positive.

    Example:
        >>> a = torch.diag(torch.arange(1.0, 11.0, dtype=torch.float64))
        >>> values, vectors = lanczos_eigh(lambda v: a @ v, dim=10, k=2)
        >>> values.round(decimals=8), vectors.shape
        (tensor([10.,  9.], dtype=torch.float64), torch.Size([10, 2]))
    """
    if not callable(matvec):
        raise TypeError(f"matvec: expected a callable v (dim,) -> A v (dim,), got {matvec!r}")
    dim = _check_int(dim, "dim", 1, 2**62)
    k = _check_int(k, "k", 1, dim)
    if num_iter is None:
        num_iter = min(dim, max(2 * k + 20, 3 * k))
    num_iter = _check_int(num_iter, "num_iter", k, dim)
    gen, device = _solver_setup(seed, dtype, device)

    apply = checked_operator(matvec, "matvec", dtype, device)

    def start_vector(basis: torch.Tensor) -> torch.Tensor:
        q = torch.randn(dim, generator=gen, dtype=dtype).to(device)
        for _ in range(2):  # twice is enough (Gram-Schmidt "twice is enough")
            q = q - basis @ (basis.T @ q)
        return q / q.norm()

    basis = torch.zeros(dim, 0, dtype=dtype, device=device)  # shape: (dim, m so far)
    q0 = start_vector(basis)
    a_q0 = apply(q0)
    scale = a_q0.norm()
    if scale == 0:  # A q0 = 0 for a random q0: A = 0 almost surely
        vecs = torch.linalg.qr(torch.randn(dim, k, generator=gen, dtype=dtype)).Q.to(device)
        return torch.zeros(k, dtype=dtype, device=device), _fix_signs(vecs)
    a_q0 = a_q0 / scale
    tridiagonals = []
    while basis.shape[1] < num_iter:
        deflate, cached = basis.clone(), []

        def closure(m: torch.Tensor, deflate=deflate, cached=cached) -> torch.Tensor:
            if cached:  # the library's first call is on q0 (renormalised): reuse A q0
                return cached.pop()[:, None].clone()
            if not torch.isfinite(m).all():  # after a zero-β breakdown: keep NaNs out of matvec
                return torch.zeros_like(m)
            m = m - deflate @ (deflate.T @ m)
            r = torch.stack([apply(c) for c in m.unbind(-1)], -1) / scale
            return r - deflate @ (deflate.T @ r)

        if basis.shape[1] > 0:
            q0 = start_vector(basis)
            a_q0 = closure(q0[:, None])[:, 0]
        alpha = q0 @ a_q0
        budget = num_iter - basis.shape[1]
        # lanczos_tridiag neither checks nor reorthogonalises its first β: a (relatively) zero
        # β₀ means q0 spans an invariant subspace on its own.
        if budget == 1 or (a_q0 - alpha * q0).norm() <= 1e-6:
            q, t = q0[:, None], alpha.reshape(1, 1)
        else:
            cached.append(a_q0)
            q, t = lanczos_tridiag(
                closure, budget, dtype, device, matrix_shape=(dim, dim), init_vecs=q0[:, None]
            )
        m = max(_valid_prefix(q, t), 1)
        basis = torch.cat([basis, q[:, :m]], 1)
        tridiagonals.append(t[:m, :m])
    values, vectors = torch.linalg.eigh(torch.block_diag(*tridiagonals))
    order = values.argsort(descending=True)[:k]
    return values[order] * scale, _fix_signs(basis @ vectors[:, order])


def checked_operator(
    op: Callable[[torch.Tensor], torch.Tensor], name: str, dtype: torch.dtype, device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``v ↦ op(v)`` detached and cast to ``dtype``/``device``, with a ``ValueError`` naming
    ``name`` if the result is not a tensor of ``v``'s shape or is not finite."""

    def apply(v: torch.Tensor) -> torch.Tensor:
        out = op(v)
        if not isinstance(out, torch.Tensor) or out.shape != v.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(
                f"{name}: must return shape {tuple(v.shape)} for input {tuple(v.shape)}, got {got}"
            )
        out = out.detach().to(dtype=dtype, device=device)
        if not torch.isfinite(out).all():
            raise ValueError(f"{name}: returned NaN or inf")
        return out

    return apply


def _fix_signs(vectors: torch.Tensor) -> torch.Tensor:
    """Flip columns so that each one's largest-magnitude entry is positive."""
    rows = vectors.abs().argmax(0)
    signs = vectors[rows, torch.arange(vectors.shape[1], device=vectors.device)].sign()
    return vectors * torch.where(signs == 0, 1.0, signs)
