"""Posterior structures: how the covariance of the subspace coordinates ``t`` is represented.

As laplace-torch separates the subset of weights from the Hessian structure, a Laplace guide
combines a `Subspace` kind (which weights) with one of these (which covariance over them):

- `FullStructure`: ``Σ⁻¹ = C/T + Λ₀`` as a dense ``(K, K)`` matrix (Subnetwork Inference eq. 15);
- `DiagonalStructure`: only the diagonal, ``Σ = diag(1/(c/T + λ))`` (the mean-field baseline of
  Subnetwork Inference sections 6.1–6.2 when the subspace is all weights);
- `LowRankStructure` (in `lowrank.py`): the top-``k`` eigenpairs of the GGN plus the prior as an
  isotropic remainder, ``Σ⁻¹ ≈ U diag(l) Uᵀ/T + λ I`` (laplace-torch's ``LowRankLaplace``).

Each gives the curvature it needs from an `Evaluator`, the posterior precision and its factor,
the functional covariance ``J_P Σ J_Pᵀ``, draws, and the log-determinants of the evidence.
`make_structure` builds one by name.
"""

from __future__ import annotations

import numpy as np
import torch

from ...linalg import (
    FLOAT32_MAX_CONDITION,
    blas_module,
    blas_threads,
    cholesky,
    logdet,
    posterior_factors_,
    precision_to_scale_tril,
    row_gram,
    solve_lower,
    symmetrize_,
    tril_outer,
)
from .lowrank import LowRankStructure


class FullStructure:
    """Dense ``(K, K)`` precision ``Σ⁻¹ = PᵀGP/T + Λ₀``; ``Λ₀ = λ PᵀP`` or ``diag(λ)``."""

    name = "full"

    @staticmethod
    def curvature(
        evaluator, t: torch.Tensor, dtype: torch.dtype = torch.float64, rows=None
    ) -> torch.Tensor:
        """``PᵀGP`` ``(K, K)``; with ``rows`` (a `gram.RootRows`) ``None`` when it holds all of
        the root ``A`` (the GGN is then formed only when asked for: `deferred`)."""
        return evaluator.ggn(t, dtype=dtype, rows=rows)

    @staticmethod
    def prior_matrix(lam: torch.Tensor, model) -> torch.Tensor:
        return torch.diag(lam) if lam.dim() == 1 else lam * model.prior_gram_matrix()

    @staticmethod
    def shape(k: int) -> tuple[int, ...]:
        """Shape of the curvature, precision, covariance and factor buffers."""
        return (k, k)

    @staticmethod
    def newton_step(evaluator, t: torch.Tensor, grad: torch.Tensor, prior) -> torch.Tensor:
        """``(PᵀGP/T + Λ₀)⁻¹ ∇`` ``(K,)`` for the MAP search's last step (dense ``PᵀGP``;
        ``prior`` is the guide's exact prior, ``prior.matrix`` ``(K, K)``)."""
        hessian = evaluator.ggn(t) / evaluator.temperature + prior.matrix
        return torch.cholesky_solve(grad[:, None], cholesky(hessian, "precision"))[:, 0]

    @staticmethod
    def scale_curvature(curv: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
        """The curvature of ``c`` times the GGN (a re-tuned noise scale: ``G ∝ 1/σ²``)."""
        return curv * c

    @staticmethod
    def precision(curv: torch.Tensor, temperature: float, prior: torch.Tensor) -> torch.Tensor:
        p = curv / temperature + prior
        return (p + p.T) / 2

    @staticmethod
    def posterior_(
        curv: torch.Tensor,
        temperature: float,
        lam: torch.Tensor,
        model,
        precision: torch.Tensor,
        scale_tril: torch.Tensor,
        covariance: torch.Tensor,
    ) -> None:
        """Write ``Σ⁻¹ = curv/T + Λ₀`` (``Λ₀ = λ PᵀP``, ``λ I`` for an index basis, or
        ``diag(λ)``), its scale ``L`` and ``Σ`` into the three ``(K, K)`` buffers, in their
        dtype, without ``(K, K)`` temporaries on CPU (`linalg.posterior_factors_`). A precision
        that does not factorise so (not positive definite or evidently ill-conditioned in
        float32, or off CPU) is formed again in float64 from ``curv`` and factorised there, with
        jitter if needed (`linalg.precision_to_scale_tril`); the buffers get the result."""

        fill = lambda p: FullStructure._precision_(curv, temperature, lam, model, p)
        if posterior_factors_(fill(precision), scale_tril, covariance):
            return
        p64 = precision  # float32: formed again in float64, so a small λ is not rounded away
        if precision.dtype != torch.float64:
            p64 = fill(torch.empty_like(precision, dtype=torch.float64))
            precision.copy_(p64)
        factor = precision_to_scale_tril(p64)
        scale_tril.copy_(factor)
        covariance.copy_(tril_outer(factor))

    @staticmethod
    def _precision_(curv, temperature: float, lam: torch.Tensor, model, p: torch.Tensor):
        """``p ← curv/T + Λ₀`` in ``p``'s dtype; returns ``p``."""
        if curv.dtype == p.dtype:
            torch.div(curv, temperature, out=p)
        else:
            p.copy_(curv).div_(temperature)
        if lam.dim() == 1 or model.prior_gram.numel() == 0:  # diag(λ) or λ I
            p.diagonal().add_(lam.to(p.dtype).expand(p.shape[0]))
        else:
            p.add_(lam * model.prior_gram_matrix())
            symmetrize_(p)
        return p

    @staticmethod
    def posterior_from_root_(
        root: torch.Tensor, temperature: float, lam: torch.Tensor, model, covariance: torch.Tensor
    ) -> bool:
        """Write ``Σ`` from the GGN's root ``A`` ``(r, K)`` (``AᵀA = PᵀGP``) when ``r < K``, by
        Woodbury's identity: with ``Λ₀ = D⁻²`` diagonal and ``Ã = A D``,

            ``Σ = (AᵀA/T + D⁻²)⁻¹ = D (I − Bᵀ B) D``,  ``B = chol(T I + Ã Ãᵀ)⁻¹ Ã``,

        ``r²K + K²r/2`` multiplications (an ``(r, r)`` Cholesky, a triangular solve and one
        ``syrk``) instead of the ``K³`` of inverting ``Σ⁻¹``. The precision (``PᵀGP/T + Λ₀``,
        `_precision_`) and the scale ``L`` (a ``K³/3`` Cholesky of ``Σ``, for draws) are left
        to the caller (`deferred`). Computed in the buffers'
        dtype; in float64 instead when float32 would lose more than about ``1e-3`` to the
        cancellation in ``I − BᵀB`` (``max diag(T I + ÃÃᵀ)/T``, a lower bound on the condition
        number of ``Σ⁻¹ D²``, above `FLOAT32_MAX_CONDITION`). Returns ``False`` (nothing
        written) for a prior that is not diagonal (``λ PᵀP`` of a dense basis) or when
        ``T I + ÃÃᵀ`` does not factorise."""
        if not (lam.dim() == 1 or model.prior_gram.numel() == 0):
            return False
        k, scalar = covariance.shape[0], lam.dim() == 0
        d = lam.to(torch.float64).expand(k).rsqrt()  # Λ₀ = D⁻²
        for dtype in dict.fromkeys((covariance.dtype, torch.float64)):
            # λ I: chol(λT I + A Aᵀ)⁻¹ A is the same B, and A needs no scaled copy
            a = root.to(dtype) if scalar else root.to(dtype) * d.to(dtype)  # shape: (r, K)
            c = row_gram(a)
            shift = temperature * (float(lam) if scalar else 1.0)
            c.diagonal().add_(shift)
            # I − BᵀB has eigenvalues shift/(shift + s²): float32 cancellation costs ε·κ(Σ⁻¹),
            # κ(Σ⁻¹) ≥ max diag(C)/shift
            if dtype == torch.float32 and float(c.diagonal().max()) > shift * FLOAT32_MAX_CONDITION:
                continue
            chol, info = torch.linalg.cholesky_ex(c)
            if int(info) != 0:
                return False
            b = solve_lower(chol, a)  # shape: (r, K)
            out = covariance
            if dtype != covariance.dtype:
                out = torch.empty(covariance.shape, dtype=dtype, device=covariance.device)
            _identity_minus_gram_(b, out)
            if scalar:
                out.div_(float(lam))
            else:
                dd = d.to(dtype)
                out.mul_(dd[:, None] * dd[None, :])  # d_i d_j = d_j d_i: stays symmetric
            if out is not covariance:
                covariance.copy_(out)
            return True
        return False

    @staticmethod
    def factor_from_covariance_(covariance: torch.Tensor, scale_tril: torch.Tensor) -> None:
        """``scale_tril ← chol(Σ)`` (the unique lower-triangular ``L`` with ``L Lᵀ = Σ``, as
        `posterior_` writes it), in the buffers' dtype; in float64 (with `cholesky`'s stated
        jitter if needed) when that dtype's factorisation fails."""
        chol, info = torch.linalg.cholesky_ex(covariance)
        if int(info) != 0:
            chol = cholesky(covariance.double(), "posterior covariance")
        scale_tril.copy_(chol)

    @staticmethod
    def factor(precision: torch.Tensor) -> torch.Tensor:
        """``L`` lower-triangular with ``L Lᵀ = Σ``."""
        return precision_to_scale_tril(precision)

    @staticmethod
    def covariance(factor: torch.Tensor) -> torch.Tensor:
        return tril_outer(factor)

    @staticmethod
    def functional_covariance(jp: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
        """``J_P Σ J_Pᵀ`` ``(n, O, O)`` from ``J_P`` ``(n, O, K)``: one ``(n·O, K) × (K, K)``
        matrix multiply, then ``n`` small ``(O, K) × (K, O)`` ones."""
        n, o, k = jp.shape
        js = (jp.reshape(n * o, k) @ cov).view(n, o, k)
        return torch.bmm(js, jp.mT)

    @staticmethod
    def functional_covariance_from_factor(jp: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """``(J_P L)(J_P L)ᵀ = J_P Σ J_Pᵀ`` ``(n, O, O)`` from ``J_P`` ``(n, O, K)`` and the
        lower-triangular scale ``L``: BLAS ``trmm`` on CPU (half the multiplications of
        ``J_P Σ``), overwriting ``jp`` when it is a column-major block (as the Jacobian blocks
        of a subnetwork are); positive semi-definite by construction."""
        n, o, k = jp.shape
        cols = jp.permute(2, 1, 0)  # shape: (K, O, n)
        blas = blas_module(factor)
        if blas is None or jp.dtype != factor.dtype:
            m = (jp.reshape(n * o, k) @ factor).view(n, o, k)
            return torch.bmm(m, m.mT)
        if not cols.is_contiguous():
            cols = cols.contiguous()
        b = cols.detach().numpy().reshape(k, o * n).T  # J_P rows (O·n, K), Fortran-ordered
        trmm = blas.strmm if factor.dtype == torch.float32 else blas.dtrmm
        with blas_threads():  # b ← b Lᵀᵀ: the Fortran view of the C-ordered L is Lᵀ
            out = trmm(1.0, factor.detach().numpy().T, b, side=1, lower=0, trans_a=1, overwrite_b=1)
        m = torch.from_numpy(out.T.reshape(k, o, n)).permute(2, 1, 0).contiguous()  # (n, O, K)
        return torch.bmm(m, m.mT)

    @staticmethod
    def feature_covariance(
        phi: torch.Tensor, rows: torch.Tensor, cov: torch.Tensor, diagonal: bool
    ):
        """A last layer: ``C_cd = φ̃ᵀ Σ_(c,d) φ̃`` (MoLA A.2) from features ``(n, P̃)``."""
        if diagonal:
            blocks = cov[rows[:, :, None], rows[:, None, :]]  # (C, P̃, P̃)
            return torch.diag_embed(torch.einsum("np,cpq,nq->nc", phi, blocks, phi))
        blocks = cov[rows[:, :, None, None], rows[None, None, :, :]]  # (C, P̃, C, P̃)
        return torch.einsum("np,cpdq,nq->ncd", phi, blocks, phi)

    @staticmethod
    def draw(factor: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return eps.to(factor.dtype) @ factor.T

    @staticmethod
    def distribution(loc: torch.Tensor, factor: torch.Tensor):
        from pyro.distributions import MultivariateNormal

        return MultivariateNormal(loc, scale_tril=factor)

    @staticmethod
    def marginal_std(factor: torch.Tensor) -> torch.Tensor:
        return factor.square().sum(-1).sqrt()

    @staticmethod
    def logdet(matrix: torch.Tensor, what: str) -> torch.Tensor:
        return logdet(matrix, what)

    @staticmethod
    def quad(matrix: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return d @ matrix @ d


def _identity_minus_gram_(b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out ← I − BᵀB`` ``(K, K)`` from ``B`` ``(r, K)``, exactly symmetric, in place when
    ``out`` is a contiguous array of ``B``'s dtype (BLAS ``syrk`` on CPU: half the
    multiplications of ``BᵀB``); returns ``out``."""
    blas = blas_module(b)
    if blas is None or not out.is_contiguous() or out.dtype != b.dtype:
        out.copy_((b.T @ b).neg_())
        symmetrize_(out)
    else:
        syrk = blas.ssyrk if b.dtype == torch.float32 else blas.dsyrk
        c = out.detach().numpy().T  # Fortran view: its upper triangle is out's lower one
        with blas_threads():  # the Fortran view of the C-ordered B is Bᵀ (K, r): (Bᵀ)(Bᵀ)ᵀ
            res = syrk(-1.0, b.contiguous().numpy().T, beta=0.0, c=c, trans=0, overwrite_c=1)
        if not np.shares_memory(res, c):  # pragma: no cover - SciPy copied: keep the result
            out.copy_(torch.from_numpy(res.T))
        symmetrize_(out, upper=False)
    out.diagonal().add_(1.0)
    return out


class DiagonalStructure:
    """Diagonal precision ``c/T + λ`` ``(K,)`` with ``c = diag(PᵀGP)``; the prior's ``PᵀP`` is
    replaced by its diagonal (exact for subnetworks and all-weights subspaces)."""

    name = "diag"

    @staticmethod
    def curvature(evaluator, t: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        return evaluator.ggn(t, diagonal=True, dtype=dtype)

    @staticmethod
    def prior_matrix(lam: torch.Tensor, model) -> torch.Tensor:
        return lam if lam.dim() == 1 else lam * model.prior_gram_diagonal()

    @staticmethod
    def shape(k: int) -> tuple[int, ...]:
        return (k,)

    #: the MAP search's last step uses the dense ``PᵀGP`` (the MAP does not depend on the
    #: posterior's structure).
    newton_step = staticmethod(FullStructure.newton_step)

    @staticmethod
    def scale_curvature(curv: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
        return curv * c

    @staticmethod
    def precision(curv: torch.Tensor, temperature: float, prior: torch.Tensor) -> torch.Tensor:
        return curv / temperature + prior

    @staticmethod
    def factor(precision: torch.Tensor) -> torch.Tensor:
        """Standard deviations ``(K,)``."""
        if not bool((precision > 0).all()):
            raise torch.linalg.LinAlgError(
                f"posterior precision: not positive, smallest {float(precision.min()):g}"
            )
        return precision.rsqrt()

    @staticmethod
    def covariance(factor: torch.Tensor) -> torch.Tensor:
        return factor.square()

    @staticmethod
    def functional_covariance(jp: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nok,k,npk->nop", jp, cov, jp)

    @staticmethod
    def feature_covariance(
        phi: torch.Tensor, rows: torch.Tensor, cov: torch.Tensor, diagonal: bool
    ):
        var = cov[rows]  # (C, P̃)
        return torch.diag_embed(torch.einsum("np,cp->nc", phi.square(), var))

    @staticmethod
    def draw(factor: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return eps * factor

    @staticmethod
    def distribution(loc: torch.Tensor, factor: torch.Tensor):
        from pyro.distributions import Normal

        return Normal(loc, factor).to_event(1)

    @staticmethod
    def marginal_std(factor: torch.Tensor) -> torch.Tensor:
        return factor

    @staticmethod
    def logdet(matrix: torch.Tensor, what: str) -> torch.Tensor:
        return matrix.log().sum()

    @staticmethod
    def quad(matrix: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return (matrix * d.square()).sum()


STRUCTURES = {s.name: s for s in (FullStructure, DiagonalStructure, LowRankStructure)}


def make_structure(name: str, rank: int | None, dim: int):
    """The structure called ``name`` for ``dim`` coordinates; ``rank`` only for ``"lowrank"``
    (``None``: `LowRankStructure.default_rank`). Raises ``ValueError`` naming the argument."""
    check_structure(name, rank)
    if name == "lowrank":
        return LowRankStructure(LowRankStructure.default_rank(dim) if rank is None else rank, dim)
    return STRUCTURES[name]


def check_structure(name: str, rank: int | None) -> None:
    """The checks of `make_structure` that need no ``K`` (for entry points, before any work)."""
    if not isinstance(name, str) or name not in STRUCTURES:
        raise ValueError(f"hessian_structure: expected one of {tuple(STRUCTURES)}, got {name!r}")
    if rank is not None and name != "lowrank":
        raise ValueError(f"rank: only used with hessian_structure='lowrank', got {name!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank: expected a positive int, got {rank!r}")
