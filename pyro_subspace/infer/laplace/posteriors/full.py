"""`FullPosterior`: the dense ``(K, K)`` posterior ``Σ⁻¹ = PᵀGP/T + Λ₀`` (Subnetwork Inference
eq. 15), the paper's full-covariance subnetwork Laplace.

Buffers ``ggn`` (``PᵀGP``, untempered), ``precision_matrix``, ``covariance_matrix`` and
``scale_tril`` (``L`` lower-triangular, ``L Lᵀ = Σ``), each ``(K, K)`` in the posterior's dtype
(the network's by default: float32 products and factorisation for a float32 network, float64
sums; a precision that does not factorise in float32 is factorised in float64).

**Buffers left to first use.** With fewer GGN rows ``r = N·C`` than weights ``K``, the
covariance comes from the rows themselves by Woodbury's identity, ``Σ = D (I − BᵀB) D`` with
``B`` ``(r, K)`` (`_woodbury_`); the ``(K, K)`` GGN ``AᵀA``, the precision ``AᵀA/T + Λ₀``, ``Σ``
and the factor ``L = chol(Σ)`` are then not needed for the linearised predictive and the
marginal variances (they read ``B``), and each costs ``K²r/2`` to ``K³/3`` multiplications.
`fit_curvature` and `set_prior` leave them pending: reading ``ggn``, ``precision_matrix``,
``covariance_matrix`` or ``scale_tril`` (a draw, the evidence, a ``state_dict``) forms it then,
exactly as the fit would have.
"""

from __future__ import annotations

import numpy as np
import torch

from ....curvature.gram import RootRows, gram_from_blocks
from ....linalg import (
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
from .base import Posterior, PriorPrecision

#: The buffers a fit from rows may leave to first use.
DEFERRABLE = ("ggn", "precision_matrix", "covariance_matrix", "scale_tril")
#: Every buffer of the posterior, ``(K, K)`` each.
BUFFERS = ("ggn", "precision_matrix", "covariance_matrix", "scale_tril")
#: the most bytes the four ``(K, K)`` buffers may take (16 GiB: ``K ≤ 32768`` in float32,
#: ``23170`` in float64): above it the structure is refused at construction, naming the others
#: (a rule of ``K`` and the dtype alone, the same on every machine)
MAX_BYTES = 16 * 2**30


class Deferred:
    """A buffer of a `FullPosterior` that reading forms, if the fit left it pending."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        if self.name not in obj.__dict__.get("_buffers", {}):  # during construction
            raise AttributeError(self.name)
        if self.name in obj.__dict__.get("_pending", ()):
            obj._form(self.name)
        return obj._buffers[self.name]


class Woodbury:
    """``Σ = D (I − BᵀB) D`` kept unformed: ``B = L⁻¹ Ã`` ``(r, K)`` with ``Ã = A D`` (the
    GGN's root scaled by ``D = Λ₀^{-1/2}``) and ``L = chol(T I + Ã Ãᵀ)`` ``(r, r)``; a scalar
    prior ``λ I`` keeps ``Ã = A``, ``L = chol(λT I + AAᵀ)`` and ``D = λ^{-1/2}``. ``B`` itself
    (``r²K`` multiplications) is solved on first use: the moments need only ``L`` and ``Ã``.

    Args:
        a: ``Ã`` ``(r, K)``.
        chol: ``L`` ``(r, r)``, of ``a``'s dtype.
        scale: ``1/λ`` (0-d) or ``d`` ``(K,)``, of ``a``'s dtype.
    """

    def __init__(self, a: torch.Tensor, chol: torch.Tensor, scale: torch.Tensor) -> None:
        self.a, self.chol, self.scale = a, chol, scale
        self._b: torch.Tensor | None = None

    def apply(self, fn) -> Woodbury:
        """A copy with ``fn`` applied to each tensor (`nn.Module._apply`'s conversions)."""
        return Woodbury(fn(self.a), fn(self.chol), fn(self.scale))

    @property
    def b(self) -> torch.Tensor:
        """``B = L⁻¹ Ã`` ``(r, K)`` (BLAS ``trsm``), solved once."""
        if self._b is None:
            self._b = solve_lower(self.chol, self.a)
        return self._b

    def covariance_(self, out: torch.Tensor) -> torch.Tensor:
        """``out ← Σ`` ``(K, K)`` (one ``syrk``, in ``B``'s dtype), exactly symmetric."""
        full = out if self.a.dtype == out.dtype else torch.empty_like(out, dtype=self.a.dtype)
        _identity_minus_gram_(self.b, full)
        scale = self.scale
        full.mul_(scale if scale.dim() == 0 else scale[:, None] * scale[None, :])
        if full is not out:
            out.copy_(full)
        return out

    def marginal_variance(self) -> torch.Tensor:
        """``diag Σ = d² (1 − Σ_r B²)`` ``(K,)`` float64."""
        var = 1.0 - self.b.double().square().sum(0)
        scale = self.scale.double()
        return var * (scale if scale.dim() == 0 else scale.square())

    def functional_covariance(self, jp: torch.Tensor) -> torch.Tensor:
        """``J Σ Jᵀ`` ``(n, O, O)`` float64 from ``J`` ``(n, O, K)``: ``(JD)(JD)ᵀ − M Mᵀ`` with
        ``Mᵀ = L⁻¹ Ã (JD)ᵀ`` (``n·O·K·(r + 1) + n·O·r²`` multiplications, no ``(K, K)`` matrix
        and no ``B``), in float64: the difference cancels, and float32 would lose ``ε ‖JD‖²``
        where a formed ``Σ`` loses ``ε ‖JΣJᵀ‖``."""
        n, o, k = jp.shape
        scale = self.scale.double()
        jd = jp.double() if scale.dim() == 0 else jp.double() * scale
        at = self.a.double() @ jd.reshape(n * o, k).T  # shape: (r, n·O)
        mt = torch.linalg.solve_triangular(self.chol.double(), at, upper=False)
        m = mt.T.reshape(n, o, -1)
        cov = torch.baddbmm(torch.bmm(jd, jd.mT), m, m.mT, alpha=-1.0)
        return (cov + cov.mT).mul_(0.5 * scale if scale.dim() == 0 else 0.5)  # exactly symmetric


class FullPosterior(Posterior):
    """Dense ``(K, K)`` ``Σ⁻¹ = PᵀGP/T + Λ₀``; ``Λ₀ = λ PᵀP``, ``λ I`` or ``diag(λ)``.

    Args:
        dim: ``K``.
        dtype: float32 or float64, of the four ``(K, K)`` buffers.
        device: of the buffers.
    """

    name = "full"
    ggn = Deferred()
    precision_matrix = Deferred()
    covariance_matrix = Deferred()
    scale_tril = Deferred()

    def __init__(self, dim: int, dtype: torch.dtype = torch.float64, device=None) -> None:
        need = len(BUFFERS) * dim * dim * torch.empty((), dtype=dtype).element_size()
        if need > MAX_BYTES:
            raise ValueError(
                f"hessian_structure: 'full' over K = {dim:,} coordinates needs four ({dim:,}, "
                f"{dim:,}) matrices, {need / 2**30:,.0f} GiB (more than {MAX_BYTES // 2**30} GiB); "
                "use hessian_structure='kron' (K-FAC, for whole layers), 'lowrank' or 'diag'"
            )
        super().__init__(dim, dtype, device)
        for name in BUFFERS:  # zeros without memory until fit (`_materialized`)
            zero = torch.zeros((), dtype=dtype, device=device)
            self.register_buffer(name, zero.expand(dim, dim))
        self._reset_deferred()

    @property
    def buffer_dtype(self) -> torch.dtype:
        return self._buffers["covariance_matrix"].dtype

    # ------------------------------------------------------------------ buffers left to first use

    def _materialized(self, name: str) -> torch.Tensor:
        """The buffer ``name`` as a contiguous tensor to write into: itself once it is one (a
        refit overwrites it in place), else new memory."""
        buf = self._buffers[name]
        if not buf.is_contiguous():  # the zero-stride zeros of an unfitted posterior
            buf = torch.empty(buf.shape, dtype=buf.dtype, device=buf.device)
            self._buffers[name] = buf
        return buf

    def _reset_deferred(self, rows: RootRows | None = None) -> None:
        """Forget pending buffers; keep ``rows`` (the GGN's root, collected by a fit whose GGN
        is then pending)."""
        self.__dict__["_pending"] = set()
        self.__dict__["_rows"] = rows
        self.__dict__["_rows_ggn"] = None  # (the ggn buffer formed from the rows, its version)
        self.__dict__["_pending_prior"] = None
        self.__dict__["_woodbury"] = None  # `Woodbury`: Σ = D (I − BᵀB) D left unformed
        self.__dict__["_eig_cache"] = None
        if rows is not None:
            self.__dict__["_pending"].add("ggn")

    def clear_pending(self) -> None:
        self._reset_deferred()

    @property
    def pending(self) -> frozenset[str]:
        """The buffers left to first use."""
        return frozenset(self.__dict__["_pending"])

    def _root(self) -> torch.Tensor | None:
        """The GGN's root ``A`` ``(r, K)`` if it still matches the ``ggn`` buffer, else ``None``
        (a re-tuned curvature, a loaded state, a posterior moved to another device)."""
        rows = self.__dict__.get("_rows")
        if rows is None or rows.parts[0].device != self.temperature.device:  # moved by ``.to``
            return None
        if "ggn" not in self.__dict__["_pending"]:
            formed = self.__dict__.get("_rows_ggn")
            ggn = self._buffers["ggn"]
            if formed is None or formed[0] is not ggn or formed[1] != ggn._version:
                return None
        return rows.matrix()

    def _form(self, name: str) -> None:
        """Write the pending buffer ``name`` (and what it needs) into the buffer."""
        out = self._materialized(name)
        if name == "ggn":  # Σ AᵀA over the kept blocks, as the fit's `gram_from_blocks`
            blocks = ((None, part) for part in self.__dict__["_rows"].parts)
            out.copy_(gram_from_blocks(blocks, dtype=out.dtype))
            self.__dict__["_rows_ggn"] = (self._buffers["ggn"], self._buffers["ggn"]._version)
        elif name == "precision_matrix":
            self._precision_(self.__dict__["_pending_prior"], out)
        elif name == "covariance_matrix":
            self.__dict__["_woodbury"].covariance_(out)
            self.__dict__["_woodbury"] = None
        else:
            self._factor_from_covariance_(out)
        self.__dict__["_pending"].discard(name)  # only once written (an error leaves it pending)

    def _apply(self, fn, recurse=True):
        woodbury = self.__dict__.get("_woodbury")  # moves and casts with the buffers
        if woodbury is not None:
            self.__dict__["_woodbury"] = woodbury.apply(fn)
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        for name in DEFERRABLE:  # the state holds all of the posterior
            getattr(self, name)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        self._reset_deferred()
        for name in BUFFERS:  # copy_ needs memory to write into
            if not self._buffers[name].is_contiguous():
                self._materialized(name).zero_()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def legacy_state(self, old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = {"ggn": "ggn", "precision": "precision_matrix", "covariance": "covariance_matrix"}
        names["scale_tril"] = "scale_tril"
        return {new: old[key] for key, new in names.items() if key in old}

    # ------------------------------------------------------------------ building

    def fit_curvature(self, evaluator, t: torch.Tensor, **kwargs: object) -> None:
        """``PᵀGP`` at ``t`` (`Evaluator.ggn`) in the buffers' dtype; with at most ``2K/3``
        GGN rows only the rows are kept (the GGN is formed when first read)."""
        self.temperature.fill_(evaluator.temperature)
        rows = RootRows(2 * self.dim // 3)  # Woodbury pays below that
        ggn = evaluator.ggn(t, dtype=self.buffer_dtype, rows=rows)
        self._reset_deferred(rows if ggn is None else None)  # None: the GGN is left pending
        if ggn is not None:
            self._buffers["ggn"] = ggn.detach().to(self.buffer_dtype)

    def scale_curvature_(self, c: float) -> None:
        self.ggn.mul_(c)  # a new version: the kept rows no longer count

    def effective_prior(self, prior: PriorPrecision) -> PriorPrecision:
        return prior

    def set_prior(self, prior: PriorPrecision) -> None:
        """Write ``Σ⁻¹``, ``L`` and ``Σ`` in the buffers' dtype, without ``(K, K)`` temporaries
        on CPU (`linalg.posterior_factors_`); from the kept GGN rows by Woodbury's identity
        when there are any (``Σ⁻¹``, ``Σ`` and ``L`` then on first use: the moments and the
        marginal variances read its factors, not ``Σ``; `_woodbury_`). A precision that does not
        factorise so (not positive definite or evidently ill-conditioned in float32, or off
        CPU) is formed again in float64 and factorised there, with jitter if needed
        (`linalg.precision_to_scale_tril`)."""
        prior = _detached(prior)
        self.__dict__["_pending"] -= {"precision_matrix", "covariance_matrix", "scale_tril"}
        self.__dict__["_woodbury"] = None
        root = self._root()  # fewer GGN rows than K: Woodbury; Σ⁻¹, Σ and L on first use
        if root is not None and self._woodbury_(root, prior):
            self.__dict__["_pending"].update({"precision_matrix", "covariance_matrix", "scale_tril"})
            self.__dict__["_pending_prior"] = prior
            return
        names = ("precision_matrix", "scale_tril", "covariance_matrix")
        precision, scale_tril, covariance = (self._materialized(n) for n in names)
        if posterior_factors_(self._precision_(prior, precision), scale_tril, covariance):
            return
        p64 = precision  # float32: formed again in float64, so a small λ is not rounded away
        if precision.dtype != torch.float64:
            p64 = self._precision_(prior, torch.empty_like(precision, dtype=torch.float64))
            precision.copy_(p64)
        factor = precision_to_scale_tril(p64)
        scale_tril.copy_(factor)
        covariance.copy_(tril_outer(factor))

    def _precision_(self, prior: PriorPrecision, p: torch.Tensor) -> torch.Tensor:
        """``p ← PᵀGP/T + Λ₀`` in ``p``'s dtype; returns ``p``."""
        ggn, temperature = self.ggn, float(self.temperature)
        if ggn.dtype == p.dtype:
            torch.div(ggn, temperature, out=p)
        else:
            p.copy_(ggn).div_(temperature)
        if prior.is_diagonal:
            p.diagonal().add_(prior.diagonal().to(p.dtype))
        else:
            p.add_(prior.lam * prior.gram)
            symmetrize_(p)
        return p

    def _woodbury_(self, root: torch.Tensor, prior: PriorPrecision) -> bool:
        """Keep ``Σ``'s Woodbury form from the GGN's root ``A`` ``(r, K)`` (``AᵀA = PᵀGP``) when
        ``r < K``: with ``Λ₀ = D⁻²`` diagonal and ``Ã = A D``,

            ``Σ = (AᵀA/T + D⁻²)⁻¹ = D (I − Bᵀ B) D``,  ``B = chol(T I + Ã Ãᵀ)⁻¹ Ã``,

        ``r²K/2 + r³/3`` multiplications (``ÃÃᵀ`` and its Cholesky factor; `Woodbury`) instead
        of the ``K³`` of inverting ``Σ⁻¹``; ``B`` (a triangular solve, ``r²K``) and ``Σ`` (one
        ``syrk``, ``K²r/2``) on first use. Computed in the buffers' dtype; in float64 instead when float32 would lose more
        than about ``1e-3`` to the cancellation in ``I − BᵀB`` (``max diag(T I + ÃÃᵀ)/T``, a
        lower bound on the condition number of ``Σ⁻¹ D²``, above `FLOAT32_MAX_CONDITION`).
        Returns ``False`` (nothing kept) for a prior that is not diagonal (``λ PᵀP`` of a
        dense basis) or when ``T I + ÃÃᵀ`` does not factorise."""
        if not prior.is_diagonal:
            return False
        scalar = prior.lam.dim() == 0
        temperature = float(self.temperature)
        d = prior.diagonal().to(torch.float64).rsqrt()  # Λ₀ = D⁻²
        for dtype in dict.fromkeys((self.buffer_dtype, torch.float64)):
            # λ I: chol(λT I + A Aᵀ)⁻¹ A is the same B, and A needs no scaled copy
            a = root.to(dtype) if scalar else root.to(dtype) * d.to(dtype)  # shape: (r, K)
            c = row_gram(a)
            shift = temperature * (float(prior.lam) if scalar else 1.0)
            c.diagonal().add_(shift)
            # I − BᵀB has eigenvalues shift/(shift + s²): float32 cancellation costs ε·κ(Σ⁻¹),
            # κ(Σ⁻¹) ≥ max diag(C)/shift
            if dtype == torch.float32 and float(c.diagonal().max()) > shift * FLOAT32_MAX_CONDITION:
                continue
            chol, info = torch.linalg.cholesky_ex(c)
            if int(info) != 0:
                return False
            scale = (1.0 / prior.lam.to(torch.float64)) if scalar else d
            self.__dict__["_woodbury"] = Woodbury(a, chol, scale.to(dtype))
            return True
        return False

    def _factor_from_covariance_(self, scale_tril: torch.Tensor) -> None:
        """``scale_tril ← chol(Σ)`` in the buffers' dtype; in float64 (with `cholesky`'s stated
        jitter if needed) when that dtype's factorisation fails."""
        covariance = self.covariance_matrix
        chol, info = torch.linalg.cholesky_ex(covariance)
        if int(info) != 0:
            chol = cholesky(covariance.double(), "posterior covariance")
        scale_tril.copy_(chol)

    # ------------------------------------------------------------------ the evidence

    def log_det(self, prior: PriorPrecision, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """``log|s·PᵀGP/T + Λ₀|``. For ``Λ₀ = λI``, ``Σ_i log(s g_i/T + λ)`` from one
        eigendecomposition of the fitted ``PᵀGP`` (cached), so each evaluation and its gradient
        cost ``O(K)``, not ``O(K³)``; else a dense log-determinant."""
        temperature = float(self.temperature)
        if prior.lam.dim() == 0 and prior.gram is None:
            g = self.ggn_eigenvalues()
            return torch.log(scale * g / temperature + prior.lam).sum()
        post = scale * self.ggn.double() / temperature + prior.matrix()
        return logdet((post + post.T) / 2, "posterior precision")

    def ggn_eigenvalues(self) -> torch.Tensor:
        """Eigenvalues ``(K,)`` float64 of the fitted ``PᵀGP`` (clamped at 0: it is PSD up to
        rounding), cached until the curvature changes; from the ``(r, r)`` ``A Aᵀ`` of the kept
        GGN rows when there are any (``r³`` instead of ``K³``, no ``(K, K)`` GGN)."""
        root = self._root()
        if root is not None:  # AᵀA and the (r, r) A Aᵀ share their non-zero eigenvalues
            key = ("rows", id(self.__dict__["_rows"]))
        else:
            key = (self.ggn.data_ptr(), self.ggn._version)
        cached = self.__dict__.get("_eig_cache")
        if cached is None or cached[0] != key:
            if root is not None:
                g = torch.linalg.eigvalsh(row_gram(root.double()))
                g = torch.cat([g, g.new_zeros(root.shape[1] - root.shape[0])])
            else:
                g = torch.linalg.eigvalsh(symmetrize_(self.ggn.to(torch.float64, copy=True)))
            self.__dict__["_eig_cache"] = cached = (key, g.clamp_min(0))
        return cached[1]

    # ------------------------------------------------------------------ draws and moments

    def draw(self, eps: torch.Tensor) -> torch.Tensor:
        factor = self.scale_tril
        return eps.to(factor.dtype) @ factor.T

    def covariance(self) -> torch.Tensor:
        return self.covariance_matrix

    def precision(self) -> torch.Tensor:
        return self.precision_matrix

    def curvature(self) -> torch.Tensor:
        return self.ggn

    def cholesky(self) -> torch.Tensor:
        return self.scale_tril

    def marginal_variance(self) -> torch.Tensor:
        woodbury = self._pending_woodbury()
        if woodbury is None:
            return self.covariance_matrix.diagonal().double()
        return woodbury.marginal_variance()

    def _pending_woodbury(self) -> Woodbury | None:
        """`Woodbury`'s form while ``Σ`` is left to first use, else ``None``."""
        if "covariance_matrix" in self.__dict__["_pending"]:
            return self.__dict__["_woodbury"]
        return None

    def functional_covariance(self, jp: torch.Tensor) -> torch.Tensor:
        """``J Σ Jᵀ`` ``(n, O, O)`` from ``J`` ``(n, O, K)``, in the buffers' dtype: with the
        factor, ``(J L)(J L)ᵀ`` by BLAS ``trmm`` on CPU (half the multiplications of ``J Σ``,
        overwriting ``jp`` when it is a column-major block, as the Jacobian blocks of a
        subnetwork are; positive semi-definite by construction); while ``L`` is left to first
        use, ``J Σ Jᵀ`` with ``Σ`` (no ``K³/3`` Cholesky for it); while ``Σ`` is left in
        Woodbury's form, from its factors (`Woodbury.functional_covariance`)."""
        woodbury = self._pending_woodbury()
        if woodbury is not None:
            return woodbury.functional_covariance(jp).to(self.buffer_dtype)
        jp = jp.to(self.buffer_dtype)
        n, o, k = jp.shape
        if "scale_tril" in self.__dict__["_pending"]:
            js = (jp.reshape(n * o, k) @ self.covariance_matrix).view(n, o, k)
            return torch.bmm(js, jp.mT)
        factor = self.scale_tril
        blas = blas_module(factor)
        if blas is None:
            m = (jp.reshape(n * o, k) @ factor).view(n, o, k)
            return torch.bmm(m, m.mT)
        cols = jp.permute(2, 1, 0)  # shape: (K, O, n)
        if not cols.is_contiguous():
            cols = cols.contiguous()
        b = cols.detach().numpy().reshape(k, o * n).T  # J rows (O·n, K), Fortran-ordered
        trmm = blas.strmm if factor.dtype == torch.float32 else blas.dtrmm
        with blas_threads():  # b ← b Lᵀᵀ: the Fortran view of the C-ordered L is Lᵀ
            out = trmm(1.0, factor.detach().numpy().T, b, side=1, lower=0, trans_a=1, overwrite_b=1)
        m = torch.from_numpy(out.T.reshape(k, o, n)).permute(2, 1, 0).contiguous()  # (n, O, K)
        return torch.bmm(m, m.mT)

    def feature_covariance(
        self, phi: torch.Tensor, rows: torch.Tensor, diagonal: bool = False
    ) -> torch.Tensor:
        """``C_cd = φ̃ᵀ Σ_(c,d) φ̃`` (MoLA A.2) from features ``(n, P̃)``, in the buffers' dtype."""
        cov = self.covariance_matrix
        phi = phi.to(cov.dtype)
        if diagonal:
            blocks = cov[rows[:, :, None], rows[:, None, :]]  # (C, P̃, P̃)
            return torch.einsum("np,cpq,nq->nc", phi, blocks, phi)
        blocks = cov[rows[:, :, None, None], rows[None, None, :, :]]  # (C, P̃, C, P̃)
        return torch.einsum("np,cpdq,nq->ncd", phi, blocks, phi)

    def functional_covariance_on_grid(self, blocks, prior_at, rows=None):
        """One eigendecomposition for the whole sweep: with ``Λ₀(λ) = λB``, ``B = L Lᵀ`` and
        ``L⁻¹ (PᵀGP/T) L⁻ᵀ = U diag(e) Uᵀ``, ``Σ(λ) = L⁻ᵀ U diag(1/(e + λ)) Uᵀ L⁻¹``, so
        ``J Σ(λ) Jᵀ = Σ_k a_k a_kᵀ / (e_k + λ)`` with ``a = J L⁻ᵀ U`` (``O(N·O²·K)`` per ``λ``,
        no factorisation). A per-coordinate ``λ`` sweep falls back to the default."""
        unit = prior_at(torch.tensor(1.0, dtype=torch.float64))
        if unit.lam.dim() != 0:
            return super().functional_covariance_on_grid(blocks, prior_at, rows)
        jp = []
        for b in blocks:
            b = b.double()
            if rows is not None:  # features: J[n, c, rows[c, p]] = φ̃[n, p]
                j = b.new_zeros(b.shape[0], rows.shape[0], self.dim)
                for i in range(rows.shape[0]):
                    j[:, i, rows[i]] = b
                b = j
            jp.append(b)
        jp = torch.cat(jp)  # shape: (N, O, K)
        chol = torch.linalg.cholesky(unit.matrix())
        a = torch.linalg.solve_triangular(chol, self.ggn.double() / float(self.temperature), upper=False)
        a = torch.linalg.solve_triangular(chol, a.T.contiguous(), upper=False)
        e, u = torch.linalg.eigh((a + a.T) / 2)
        ju = jp @ torch.linalg.solve_triangular(chol.T, u, upper=True)
        e = e.clamp_min(0.0)
        return lambda lam: torch.einsum("nok,k,npk->nop", ju, 1.0 / (e + lam), ju)


def _detached(prior: PriorPrecision) -> PriorPrecision:
    return PriorPrecision(prior.lam.detach(), prior.gram, prior.dim)


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
