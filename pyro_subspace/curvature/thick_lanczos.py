"""Thick-restart Lanczos: the fewest operator-vector products for top-``k`` eigenpairs at a tolerance.

For an operator whose product dominates the cost (the GGN: `GGNOperator`), what matters is how
many products a solver needs before its Ritz pairs pass the stopping test. ARPACK
(``scipy.sparse.linalg.eigsh``) runs implicitly restarted Lanczos and tests convergence only
when its basis of ``ncv`` vectors is full (then after each restart cycle), so it applies the
operator up to a whole cycle more often than needed. Here (Wu & Simon 2000, thick-restart
Lanczos; in the Krylov-Schur form of Stewart 2001):

- the basis ``Q`` is kept orthonormal by full reorthogonalisation (classical Gram-Schmidt,
  twice), so ``H = Qᵀ A Q`` is formed column by column from the same inner products, and the
  Lanczos relation ``A Q_j = Q_j H_j + r_j e_jᵀ`` holds with ``‖r_j‖ = β_j``;
- the Ritz pairs ``H_j = S Θ Sᵀ`` are tested with ARPACK's criterion: the residual of
  ``(θ_i, Q s_i)`` is ``‖A Q s_i − θ_i Q s_i‖ = β_j |S_{j,i}|``, converged when
  ``<= tol · max(|θ_i|, ε^(2/3) |θ_1|)`` for each of the ``k`` largest; after every product,
  except that while the worst ratio residual/bound, extrapolated at the geometric rate it fell
  between the last two tests, needs at least 8 more steps, only every second product is
  tested (a test is an ``eigh`` of ``H``; at most one product more than testing every step);
- when the basis reaches ``ncv`` vectors, it is thick-restarted: the ``l`` leading Ritz vectors
  (``l = k + min(n_converged, (ncv − k) // 2)``, ARPACK's choice) and the residual direction
  ``q_{j+1}`` are kept, ``H`` becomes ``diag(θ_1..θ_l)`` bordered by ``β_j S_{j,1..l}``.

A breakdown (``β`` below ``1e-10`` of the largest product norm: an invariant subspace, e.g. a
GGN of rank below ``k``) continues with a random vector orthogonal to the basis.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from .lanczos import _check_int, _fix_signs, _solver_setup, checked_operator


def thick_restart_lanczos_eigh(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    dim: int,
    k: int,
    tol: float = 1e-6,
    ncv: int | None = None,
    max_products: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    seed: int = 0,
    v0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The ``k`` largest (algebraic) eigenpairs of a symmetric ``A`` by thick-restart Lanczos,
    stopping within one product of the first after which all pass ARPACK's test (module docstring).

    Args:
        matvec: ``v ↦ A v`` for ONE vector ``(dim,)`` (in ``dtype``, on ``device``), returning
            ``(dim,)``; e.g. ``GGNOperator(net, lik, x).matvec``.
        dim: size ``n`` of the operator.
        k: how many eigenpairs, ``1 <= k <= dim``.
        tol: relative residual tolerance, ``>= 0`` (``0``: run to ``max_products``); as
            ``eigsh(tol=...)``.
        ncv: the most basis vectors kept, in ``[k + 1, dim]`` (``k`` if ``k == dim``); default
            ``min(dim, max(3k, 2k + 20))``. Memory is ``ncv`` vectors of ``dim``.
        max_products: the most products; default ``max(100 · ncv, dim)``. If reached before
            convergence, a ``RuntimeWarning`` is issued and the current Ritz pairs returned.
        dtype, device: of the Lanczos vectors (default float64 on CPU).
        seed: seed of the random start vector (a private ``torch.Generator``).
        v0: optional start vector ``(dim,)`` (e.g. the one given to ``eigsh``); not zero.

    Returns:
        ``eigenvalues`` ``(k,)`` descending, ``eigenvectors`` ``(dim, k)`` orthonormal (each
        signed so that its largest-magnitude entry is positive), and the number of products.

    Example:
        >>> a = torch.diag(torch.arange(1.0, 101.0, dtype=torch.float64))
        >>> values, vectors, products = thick_restart_lanczos_eigh(lambda v: a @ v, 100, 3)
        >>> values.round(decimals=6), vectors.shape
        (tensor([100.,  99.,  98.], dtype=torch.float64), torch.Size([100, 3]))
    """
    if not callable(matvec):
        raise TypeError(f"matvec: expected a callable v (dim,) -> A v (dim,), got {matvec!r}")
    dim = _check_int(dim, "dim", 1, 2**62)
    k = _check_int(k, "k", 1, dim)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol: expected a float >= 0, got {tol!r}")
    ncv = min(dim, max(3 * k, 2 * k + 20)) if ncv is None else ncv
    ncv = _check_int(ncv, "ncv", min(k + 1, dim), dim)
    max_products = max(100 * ncv, dim) if max_products is None else max_products
    max_products = _check_int(max_products, "max_products", 1, None)
    gen, device = _solver_setup(seed, dtype, device)
    if v0 is not None:
        if not isinstance(v0, torch.Tensor) or tuple(v0.shape) != (dim,):
            raise ValueError(f"v0: expected a tensor of shape ({dim},), got {v0!r}")
        if not torch.isfinite(v0).all() or not v0.abs().max() > 0:
            raise ValueError("v0: must be finite and not zero")
    apply = checked_operator(matvec, "matvec", dtype, device)
    eps = torch.finfo(dtype).eps

    q = torch.zeros(ncv + 1, dim, dtype=dtype, device=device)  # rows: the basis
    h = torch.zeros(ncv, ncv, dtype=dtype, device=device)  # H = Q A Qᵀ (rows of Q)

    def orthogonal(r: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``r`` minus its part in the first ``j`` rows of ``q``, and that part's coefficients:
        classical Gram-Schmidt, repeated when the norm fell below ``1/√2`` of what it was
        (Daniel, Gragg, Kaufman & Stewart 1976; ARPACK's test). "Twice is enough"."""
        basis = q[:j]
        coef = torch.mv(basis, r)
        norm0 = torch.linalg.vector_norm(r)
        r = torch.addmv(r, basis.T, coef, alpha=-1)
        if torch.linalg.vector_norm(r) < 0.7071 * norm0:
            c = torch.mv(basis, r)
            r, coef = torch.addmv(r, basis.T, c, alpha=-1), coef + c
        return r, coef

    def fresh(j: int) -> torch.Tensor:
        r = orthogonal(torch.randn(dim, generator=gen, dtype=dtype).to(device), j)[0]
        return r / r.norm()

    start = fresh(0) if v0 is None else v0.detach().to(dtype=dtype, device=device)
    q[0] = start / start.norm()
    j, products, scale = 0, 0, 0.0  # j: vectors with products in H
    skip, history = 0, (float("inf"), 0)  # steps left without a test; (worst ratio, products)
    while True:
        r = apply(q[j])
        products += 1
        scale = max(scale, float(r.norm()))
        r, coef = orthogonal(r, j + 1)
        h[: j + 1, j] = coef
        h[j, : j + 1] = coef
        j += 1
        beta = float(r.norm())
        if beta <= 1e-10 * scale:  # invariant subspace: Ritz pairs in it are exact
            beta = 0.0
        last = j == dim or products >= max_products
        skip -= 1
        if (j < k or skip > 0) and beta > 0 and j < ncv and not last:  # no test this step
            q[j] = r / beta
            continue
        values, s = torch.linalg.eigh(h[:j, :j])
        values, s = values.flip(0), s.flip(1)
        residuals = beta * s[-1].abs()
        floor = eps ** (2 / 3) * float(values.abs().max())
        ok = residuals[:k] <= tol * values[:k].abs().clamp_min(floor)
        done = j >= k and bool(ok.all()) and (tol > 0 or beta == 0.0)
        # far from converged (at the rate the worst ratio residual / bound fell, at least 8
        # steps to go): test only every second step (a test is an eigh of H)
        worst = (
            float((residuals[:k] / (tol * values[:k].abs().clamp_min(floor))).max())
            if (tol > 0 and floor > 0)
            else float("inf")
        )
        if 1 < worst < float("inf") and 1 < history[0] < float("inf") and worst < history[0]:
            rate = (history[0] / worst) ** (1 / (products - history[1]))
            skip = min(2, int(0.25 * math.log(worst) / math.log(rate)))
        history = (worst, products)
        if done or last:
            if not done and j < dim:
                warnings.warn(
                    f"thick_restart_lanczos_eigh: {int(ok.sum())} of {k} Ritz pairs converged "
                    f"within max_products={max_products}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if j < k:  # budget smaller than k: fill with orthogonal random directions
                extra = torch.stack([fresh(j + i) for i in range(k - j)])
                basis = torch.cat([s.T @ q[:j], extra])
                return torch.cat([values, values.new_zeros(k - j)]), _fix_signs(basis.T), products
            return values[:k], _fix_signs((s[:, :k].T @ q[:j]).T), products
        q[j] = fresh(j) if beta == 0.0 else r / beta
        if j == ncv:  # thick restart: keep l Ritz vectors and the residual direction
            keep = k + min(int(ok.sum()), (ncv - k) // 2)
            keep = min(keep, ncv - 1)
            q[:keep] = s[:, :keep].T @ q[:j]
            q[keep] = q[j]
            h.zero_()
            h[:keep, :keep] = torch.diag(values[:keep])
            j = keep
