"""`FullPosterior`: the dense ``(K, K)`` posterior ``Σ⁻¹ = PᵀGP/T + Λ₀`` (Subnetwork Inference
eq. 15), the paper's full-covariance subnetwork Laplace.

Buffers ``ggn`` (``PᵀGP``, untempered), ``precision_matrix``, ``covariance_matrix`` and
``scale_tril`` (``L`` lower-triangular, ``L Lᵀ = Σ``), each ``(K, K)`` in the posterior's dtype
(the network's by default: float32 products and factorisation for a float32 network, float64
sums; a precision that does not factorise in float32 is factorised in float64 where that fits,
`set_prior`).

**Two ``(K, K)`` matrices at large ``K``.** What a fit, the evidence, draws and the GLM
predictive need is the GGN and one factor: `set_prior` writes the precision straight into the
``scale_tril`` buffer (index-reversed) and factorises it there (LAPACK ``potrf`` + ``trtri``:
``L = chol(Σ)`` with no ``Σ`` formed, `linalg.cholesky_reversed_`); draws are ``L ε``, ``J Σ Jᵀ``
is ``(J L)(J L)ᵀ``, ``diag Σ`` the row sums of ``L²``, the evidence at that ``λ``
``−2 Σ log L_ii``. ``precision_matrix`` and ``covariance_matrix`` are then left to first use
(formed when read, e.g. by ``la.covariance``, and kept). The choice per use:

- one ``λ`` (the fit, the predictive, draws, the evidence at the fitted ``λ``): the Cholesky
  factor, with the GGN kept beside it for the next ``λ``: two matrices;
- the evidence at many ``λ`` (``"marglik"``: a gradient in ``λ`` per step): the GGN's
  eigenvalues, computed once (the factor's memory given back first, ``syevd`` without
  vectors on a copy, workspace ``O(K)``), ``O(K)`` per ``λ``; the factor is formed again on
  its next use: two;
- the grid's validation predictive (`functional_covariance_on_grid`): the GGN's eigenvectors
  (``syevr``, which needs no ``K²`` workspace, on a copy in the factor's memory, the vectors
  beside it: three matrices while the Jacobians are rotated, ``O(N·O·K)`` per ``λ`` after)
  where three fit under `MAX_BYTES`; else one Cholesky factor per ``λ`` in the factor's
  memory (two).

`MAX_BYTES` bounds the two held matrices: float32 ``K ≤ 46,340`` (the paper's ``K = 42,438``
takes 2 × 7.2 GB), float64 ``K ≤ 32,768``. The GGN's accumulation holds two as well in float32
(the float32 part and the float64 sum of its upper triangle, `gram`), one in float64; with
``N·C`` known to exceed ``2K/3`` no GGN row is held back for Woodbury (`RootRows.points`).
Reading ``precision_matrix`` or ``covariance_matrix``, a ``state_dict`` (which holds all four)
and ``hessian_structure``'s MAP polish (`Posterior.newton_step`, a dense float64 Hessian) cost
more: one or two matrices each.

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

import warnings

import numpy as np
import torch

from ....curvature.gram import RootRows, gram_from_blocks
from ....linalg import (
    FLOAT32_MAX_CONDITION,
    JITTERS,
    blas_module,
    blas_threads,
    cholesky,
    cholesky_reversed_,
    eigh_evr_,
    lapack_for,
    logdet,
    precision_to_scale_tril,
    reversed_copy_,
    row_gram,
    scale_tril_from_reversed_cholesky_,
    solve_lower,
    solve_reversed_cholesky,
    symmetrize_,
    tril_outer_,
)
from .... import heap
from .base import Posterior, PriorPrecision, stacked_jacobians

#: The buffers a fit from rows may leave to first use.
DEFERRABLE = ("ggn", "precision_matrix", "covariance_matrix", "scale_tril")
#: Every buffer of the posterior, ``(K, K)`` each.
BUFFERS = ("ggn", "precision_matrix", "covariance_matrix", "scale_tril")
#: The ``(K, K)`` matrices a fit, the evidence, draws and the GLM predictive hold: the GGN and
#: the factor (`precision_matrix` and `covariance_matrix` are formed only when read).
HELD = ("ggn", "scale_tril")
#: the most bytes the held ``(K, K)`` matrices may take (16 GiB: ``K ≤ 46,340`` in float32,
#: ``32,768`` in float64): above it the structure is refused at construction, naming the sizes
#: and the others; also the bound under which the grid takes the eigenbasis (three matrices)
#: and a float32 precision is repaired in float64 (a rule of ``K`` and the dtype alone, the
#: same on every machine)
MAX_BYTES = 16 * 2**30
#: From this ``K`` on, the evidence at the factor's own ``λ`` is read off the factor
#: (``O(K)``) instead of an eigendecomposition or a dense log-determinant (``K³``, about 30
#: factorisations for the eigenvalues): below it those cost under a second (a loaded posterior
#: takes the same route as the saved one: its factor's prior is in the state).
FACTOR_LOG_DET_MIN_K = 2048
#: The grid's per-``λ`` solve takes its Jacobian rows in blocks of at most this many bytes:
#: the solve's copies of its right-hand side (reversed, then solved) are then two such blocks,
#: not two more copies of all ``N·O`` rows (at ``K = 42,438`` float32 and 500 points: 0.8 GB
#: each, beside the two ``(K, K)`` matrices). Each block still reads the whole factor once.
GRID_SOLVE_BYTES = 1 << 28


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
        dtype: float32 or float64, of the ``(K, K)`` matrices (`HELD`: the GGN and the
            Cholesky factor; the other `BUFFERS` are formed on demand, never kept).
        device: of the buffers.
    """

    name = "full"
    ggn = Deferred()
    precision_matrix = Deferred()
    covariance_matrix = Deferred()
    scale_tril = Deferred()

    def __init__(self, dim: int, dtype: torch.dtype = torch.float64, device=None) -> None:
        size = torch.empty((), dtype=dtype).element_size()
        need = len(HELD) * dim * dim * size
        if need > MAX_BYTES:
            raise ValueError(
                f"hessian_structure: 'full' over K = {dim:,} coordinates in {dtype} holds two "
                f"({dim:,}, {dim:,}) matrices (the GGN and the Cholesky factor), "
                f"{need / 2**30:,.1f} GiB (more than {MAX_BYTES // 2**30} GiB); "
                + ("use dtype=torch.float32 (half of it), " if size > 4 else "use ")
                + "hessian_structure='kron' (K-FAC, for whole layers), 'lowrank' or 'diag'"
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
        self.__dict__["_route"] = None  # "dense" (L from the precision) or "woodbury"
        self.__dict__["_factor_of"] = None  # (prior, GGN key) of the formed dense factor
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
            if self.__dict__["_woodbury"] is not None:
                self.__dict__["_woodbury"].covariance_(out)
                self.__dict__["_woodbury"] = None
            else:  # Σ = L Lᵀ from the factor (LAPACK lauum into ``out``)
                tril_outer_(out, self.scale_tril)
        elif self.__dict__["_route"] == "woodbury":
            self._factor_from_covariance_(out)
        else:
            self._factor_(self.__dict__["_pending_prior"], out)
        self.__dict__["_pending"].discard(name)  # only once written (an error leaves it pending)

    def _apply(self, fn, recurse=True):
        woodbury = self.__dict__.get("_woodbury")  # moves and casts with the buffers
        if woodbury is not None:
            self.__dict__["_woodbury"] = woodbury.apply(fn)
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """The state holds the posterior in the `HELD` matrices (the GGN and the factor, formed
        if pending) and the prior they were formed with (``formed_prior_lam``,
        ``formed_prior_gram``: ``λ`` and ``PᵀP`` or an empty tensor for ``I``); ``Σ⁻¹`` and ``Σ``
        only if they were formed, else a zero-stride placeholder of no memory: saving a
        posterior of the paper's ``K = 42,438`` in float32 writes two ``(K, K)`` matrices
        (14.4 GB), not four, and forms none but the factor."""
        for name in HELD:
            getattr(self, name)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        prior = self.__dict__.get("_pending_prior")
        for name in set(BUFFERS) - set(HELD):
            if name in self.__dict__["_pending"]:  # stale or absent memory: not the posterior's
                destination[prefix + name] = _placeholder(self._buffers[name])
        if prior is not None:
            gram = prior.gram if prior.gram is not None else prior.lam.new_zeros(0)
            destination[prefix + "formed_prior_lam"] = prior.lam.detach().clone()
            destination[prefix + "formed_prior_gram"] = gram.detach().clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:  # fmt: skip
        """Loads what `_save_to_state_dict` wrote (and the states of earlier releases, which
        hold all four matrices): a placeholder (zero-stride, or all zeros: a cloned one) of
        ``Σ⁻¹`` or ``Σ`` is left to first use, formed from the GGN, the factor and the saved
        prior; a placeholder of the GGN or factor (an unfitted posterior) stays one."""
        self._reset_deferred()
        # kept as the pending prior: copies, never the state's tensors (one from
        # ``torch.load(mmap=True)`` keeps the whole file mapped: at the paper's K 14.4 GB of
        # file pages counted in the RSS long after the state is gone)
        lam = state_dict.pop(prefix + "formed_prior_lam", None)
        gram = state_dict.pop(prefix + "formed_prior_gram", None)
        lam = None if lam is None else lam.detach().clone()
        gram = None if gram is None else gram.detach().clone()
        unformed = []
        for name in BUFFERS:
            value = state_dict.get(prefix + name)
            held = isinstance(value, torch.Tensor) and value.dim() == 2 and value.numel() > 0
            if held and (0 in value.stride() or lam is not None and name not in HELD
                         and not bool(value.any())):  # fmt: skip
                unformed.append(name)
                del state_dict[prefix + name]
                self._release(name)
            elif not self._buffers[name].is_contiguous():  # copy_ needs memory to write into
                self._materialized(name).zero_()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)  # fmt: skip
        names = {prefix + name for name in unformed}
        missing_keys[:] = [key for key in missing_keys if key not in names]
        if lam is not None and not set(unformed) & set(HELD):  # a fitted posterior's state
            lam = lam.to(torch.float64)
            gram = gram if gram is not None and gram.numel() else None
            prior = PriorPrecision(lam, gram, self.dim)
            self.__dict__["_pending_prior"] = prior
            self.__dict__["_route"] = "dense"
            self.__dict__["_factor_of"] = (prior, self._ggn_key())
            self.__dict__["_pending"].update(unformed)

    def legacy_state(self, old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = {"ggn": "ggn", "precision": "precision_matrix", "covariance": "covariance_matrix"}
        names["scale_tril"] = "scale_tril"
        return {new: old[key] for key, new in names.items() if key in old}

    # ------------------------------------------------------------------ building

    def fit_curvature(self, evaluator, t: torch.Tensor, **kwargs: object) -> None:
        """``PᵀGP`` at ``t`` (`Evaluator.ggn`) in the buffers' dtype; with at most ``2K/3``
        GGN rows only the rows are kept (the GGN is formed when first read). With ``N·C``
        known to exceed that (in-memory data) no row is held back (`RootRows.points`)."""
        self.temperature.fill_(evaluator.temperature)
        data = getattr(evaluator, "data", None)  # N where the pass covers in-memory data
        points = None
        if data is not None and data.loader is None and not data.sharded:
            points = data.local_num_data
        rows = RootRows(2 * self.dim // 3, points)  # Woodbury pays below that
        ggn = evaluator.ggn(t, dtype=self.buffer_dtype, rows=rows)
        self._reset_deferred(rows if ggn is None else None)  # None: the GGN is left pending
        if ggn is not None:
            self._buffers["ggn"] = ggn.detach().to(self.buffer_dtype)
            # the Jacobian passes' freed row blocks back to the OS before the factor's memory
            heap.trim_after(ggn.numel() * ggn.element_size())

    def scale_curvature_(self, c: float) -> None:
        self.ggn.mul_(c)  # a new version: the kept rows no longer count

    def effective_prior(self, prior: PriorPrecision) -> PriorPrecision:
        return prior

    def set_prior(self, prior: PriorPrecision) -> None:
        """Form ``L = chol(Σ)`` for ``Σ⁻¹ = PᵀGP/T + Λ₀`` in the ``scale_tril`` buffer, the one
        ``(K, K)`` matrix beside the GGN (`_factor_`: the precision written into it
        index-reversed, LAPACK ``potrf`` + ``trtri`` in place, ``2K³/3`` multiplications);
        ``precision_matrix`` and ``covariance_matrix`` are left to first use (and stale ones
        released). From the kept GGN rows by Woodbury's identity when there are any (``Σ⁻¹``,
        ``Σ`` and ``L`` then on first use: the moments and the marginal variances read its
        factors; `_woodbury_`)."""
        prior = _detached(prior)
        pending = self.__dict__["_pending"]
        pending -= {"precision_matrix", "covariance_matrix", "scale_tril"}
        self.__dict__["_woodbury"] = None
        self.__dict__["_factor_of"] = None
        self.__dict__["_pending_prior"] = prior
        root = self._root()  # fewer GGN rows than K: Woodbury; Σ⁻¹, Σ and L on first use
        if root is not None and self._woodbury_(root, prior):
            self.__dict__["_route"] = "woodbury"
            pending.update({"precision_matrix", "covariance_matrix", "scale_tril"})
            return
        self.__dict__["_route"] = "dense"
        for name in ("precision_matrix", "covariance_matrix"):  # stale: released
            self._release(name)
        self._factor_(prior, self._materialized("scale_tril"))
        pending.update({"precision_matrix", "covariance_matrix"})

    def _release(self, name: str) -> None:
        """Give the memory of the buffer ``name`` back (zeros without memory, `_materialized`
        allocates again)."""
        buf = self._buffers[name]
        if buf.is_contiguous():
            self._buffers[name] = _placeholder(buf)

    def _ggn_key(self) -> tuple:
        ggn = self._buffers["ggn"]
        return (ggn.data_ptr(), ggn._version, float(self.temperature))

    def _reversed_precision_(self, prior: PriorPrecision, s: torch.Tensor, jitter: float = 0.0):
        """``s ← J (PᵀGP/T + Λ₀ + jitter·I) J`` (``J`` the index reversal), no temporary for a
        diagonal ``Λ₀``."""
        reversed_copy_(s, self.ggn.to(s.dtype) if self.ggn.dtype != s.dtype else self.ggn)
        s.div_(float(self.temperature))
        if prior.is_diagonal:
            s.diagonal().add_(prior.diagonal().to(s.dtype).flip(0) + jitter)
        else:
            s.add_((prior.lam * prior.gram).flip(-2, -1).to(s.dtype))
            symmetrize_(s)
            if jitter:
                s.diagonal().add_(jitter)

    def _cholesky_reversed_(self, prior: PriorPrecision, s: torch.Tensor) -> float:
        """``s`` ← ``M`` (`linalg.cholesky_reversed_`: ``J Σ⁻¹ J = M Mᵀ``) in place, in ``s``'s
        dtype; a precision that is not positive definite gets `linalg.JITTERS` ``× mean
        diag`` added, with a ``RuntimeWarning``, or raises ``LinAlgError``. Returns the
        condition bound (`linalg.cholesky_reversed_`)."""
        mean_diag = None
        for jitter in JITTERS:
            shift = 0.0
            if jitter:
                if mean_diag is None:
                    mean_diag = float(self.ggn.diagonal().double().mean()) / float(
                        self.temperature
                    ) + float(prior.diagonal().double().mean())
                shift = jitter * abs(mean_diag)
            self._reversed_precision_(prior, s, shift)
            info, condition = cholesky_reversed_(s)
            if info == 0:
                if jitter:
                    warnings.warn(
                        f"posterior precision: not positive definite in {s.dtype}; added "
                        f"{jitter:g} x mean diagonal",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                return condition
        raise torch.linalg.LinAlgError(
            f"posterior precision: not positive definite in {s.dtype} even with jitter 1e-6"
        )

    def _float64_fits(self) -> bool:
        """A float64 repair (its precision, factor and solve: three float64 ``(K, K)``) fits
        under `MAX_BYTES` beside the held matrices."""
        size = torch.empty((), dtype=self.buffer_dtype).element_size()
        return (len(HELD) * size + 3 * 8) * self.dim**2 <= MAX_BYTES

    def _factor_(self, prior: PriorPrecision, out: torch.Tensor) -> None:
        """``out ← L = chol(Σ)`` (lower) for ``Σ⁻¹ = PᵀGP/T + Λ₀``, in ``out``'s memory and
        dtype, with no ``(K, K)`` temporary on CPU (`linalg.cholesky_reversed_`,
        `linalg.scale_tril_from_reversed_cholesky_`). A float32 precision that is not positive
        definite or whose condition evidently exceeds `FLOAT32_MAX_CONDITION` is formed again in
        float64 and factorised there (`linalg.precision_to_scale_tril`, with jitter if needed)
        when that fits (`_float64_fits`); else it keeps the float32 factor (with jitter if
        needed) and warns with the condition bound."""
        if lapack_for(out) is None:  # off CPU: torch's factorisations, with temporaries
            p = self._precision_(prior, torch.empty_like(out, dtype=torch.float64))
            out.copy_(precision_to_scale_tril(p))
        else:
            single = out.dtype == torch.float32
            self._reversed_precision_(prior, out)
            info, condition = cholesky_reversed_(out)
            bad = info != 0 or (single and condition > FLOAT32_MAX_CONDITION)
            if bad and single and self._float64_fits():
                p64 = self._precision_(prior, torch.empty_like(out, dtype=torch.float64))
                out.copy_(precision_to_scale_tril(p64))
            else:
                if info != 0:
                    condition = self._cholesky_reversed_(prior, out)
                if bad and single:
                    warnings.warn(
                        f"posterior precision: condition number above {condition:.3g} in "
                        f"float32 at K = {self.dim:,}, where a float64 factor does not fit "
                        f"under {MAX_BYTES // 2**30} GiB; the covariance may lose about "
                        f"{condition * 6e-8:.1g} relative",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                scale_tril_from_reversed_cholesky_(out)
        self.__dict__["_factor_of"] = (prior, self._ggn_key())

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

    def _factor_from_covariance_(self, scale_tril: torch.Tensor) -> None:  # Woodbury's route
        """``scale_tril ← chol(Σ)`` in the buffers' dtype; in float64 (with `cholesky`'s stated
        jitter if needed) when that dtype's factorisation fails."""
        covariance = self.covariance_matrix
        chol, info = torch.linalg.cholesky_ex(covariance)
        if int(info) != 0:
            chol = cholesky(covariance.double(), "posterior covariance")
        scale_tril.copy_(chol)

    # ------------------------------------------------------------------ the evidence

    def log_det(self, prior: PriorPrecision, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """``log|s·PᵀGP/T + Λ₀|``. At the ``λ`` of the formed factor (``s = 1``, nothing to
        differentiate, ``K ≥`` `FACTOR_LOG_DET_MIN_K`): ``−2 Σ log L_ii``, ``O(K)``. At another
        prior there, nothing to differentiate: one Cholesky factorisation in the factor's memory
        (`_one_factorisation_log_det`). Else for ``Λ₀ = λI``
        ``Σ_i log(s g_i/T + λ)`` from the fitted ``PᵀGP``'s eigenvalues (`ggn_eigenvalues`,
        computed once), so each evaluation and its gradient cost ``O(K)``, not ``O(K³)``; else
        a dense log-determinant."""
        temperature = float(self.temperature)
        if self._factor_matches(prior, scale):
            return -2.0 * self.scale_tril.diagonal().double().log().sum()
        if self._one_factorisation_log_det(prior, scale):
            # J (PᵀGP/T + Λ₀) J = M Mᵀ in the factor's memory: log|Σ⁻¹| = 2 Σ log M_ii
            scratch = self._scratch()
            self._cholesky_reversed_(prior, scratch)
            return 2.0 * scratch.diagonal().double().log().sum()
        if prior.lam.dim() == 0 and prior.gram is None:
            g = self.ggn_eigenvalues()
            x = scale * g / temperature + prior.lam
            if bool((x.detach() <= 0).any()):  # rounding larger than λ: taken as 0, saying so
                warnings.warn(
                    f"posterior precision: the GGN's smallest eigenvalue {float(g.min()):.3g} "
                    f"(a GGN is PSD: rounding of its {self.buffer_dtype} sums) exceeds the prior "
                    f"precision {float(prior.lam.detach()):.3g} at this noise scale; its negative "
                    "eigenvalues are taken as 0 in the log-determinant (fit in float64 to avoid)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                x = scale * g.clamp_min(0) / temperature + prior.lam
            return torch.log(x).sum()
        post = scale * self.ggn.double() / temperature + prior.matrix()
        return logdet((post + post.T) / 2, "posterior precision")

    def _one_factorisation_log_det(self, prior: PriorPrecision, scale) -> bool:
        """A one-off evidence at a ``λ`` other than the factor's, at ``K ≥``
        `FACTOR_LOG_DET_MIN_K` on CPU with nothing to differentiate and no eigenvalues yet for
        this GGN nor kept GGN rows: one Cholesky factorisation (``K³/3``) in the factor's memory,
        instead of the eigendecomposition a λ optimiser amortises (about 30 factorisations, and
        at the paper's ``K = 42,438`` float32 a second copy of the GGN) or a dense float64
        log-determinant. The factor is formed again, at the kept prior, on its next use."""
        if self.dim < FACTOR_LOG_DET_MIN_K or self._root() is not None:
            return False
        if isinstance(scale, torch.Tensor) and scale.requires_grad or float(scale) != 1.0:
            return False
        if prior.lam.requires_grad or self.__dict__["_route"] == "woodbury":
            return False
        cached = self.__dict__.get("_eig_cache")
        if cached is not None and cached[0] == (self.ggn.data_ptr(), self.ggn._version):
            return prior.lam.dim() != 0 or prior.gram is not None  # O(K) from the eigenvalues
        return lapack_for(self._buffers["scale_tril"]) is not None

    def _factor_matches(self, prior: PriorPrecision, scale) -> bool:
        """The formed dense factor is ``chol(Σ)`` of ``prior`` at the current GGN, and nothing
        asks for a gradient."""
        formed = self.__dict__.get("_factor_of")
        if self.dim < FACTOR_LOG_DET_MIN_K:
            return False
        if formed is None or "scale_tril" in self.__dict__["_pending"]:
            return False
        if isinstance(scale, torch.Tensor) and scale.requires_grad or float(scale) != 1.0:
            return False
        if prior.lam.requires_grad or formed[1] != self._ggn_key():
            return False
        old = formed[0]
        return (
            old.gram is prior.gram
            and old.lam.shape == prior.lam.shape
            and torch.equal(old.lam, prior.lam.to(old.lam))
        )

    def ggn_eigenvalues(self) -> torch.Tensor:
        """Eigenvalues ``(K,)`` float64 of the fitted ``PᵀGP``, cached until the curvature
        changes; not clamped at 0 (a float32 GGN's near-null eigenvalues scatter around 0 by
        its rounding: clamping only the negative ones biased the evidence, and the tuned ``λ``
        by 4 % on laplace-torch's regression example; `log_det` clamps only where the
        precision would not be positive). The factor's memory is given back (the factor is
        formed again on its next use) and ``torch.linalg.eigvalsh`` (MKL's ``syevd`` without
        vectors, workspace ``O(K)``, on its own float64 copy of the GGN: about 3x faster than OpenBLAS's here; for float32 buffers
        that copy is twice the factor's bytes, the price of eigenvalues as accurate as the
        float32 GGN itself) takes it; from the ``(r, r)`` ``A Aᵀ`` of the kept GGN rows when
        there are any (``r³`` instead of ``K³``, no ``(K, K)`` GGN)."""
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
            else:  # the factor's memory given back first: torch's copy of the GGN takes it
                if self.__dict__["_route"] == "dense":
                    self.__dict__["_pending"].add("scale_tril")
                    self.__dict__["_factor_of"] = None
                    self._release("scale_tril")
                # in float64 whatever the buffers' dtype: float32's eigensolver errs by
                # ~eps·‖G‖ on every eigenvalue (−9e-3 on laplace-torch's regression example,
                # whose float32 GGN itself has −6e-4), which moved the tuned λ by 5 %
                # (torch copies its input again: two float64 copies beside the GGN, where they
                # fit under MAX_BYTES; else the buffers' dtype, one copy: two matrices in all)
                size = self.ggn.element_size()
                if (size + 2 * 8) * self.dim**2 <= MAX_BYTES:
                    g = torch.linalg.eigvalsh(self.ggn.double())
                else:
                    g = torch.linalg.eigvalsh(self.ggn).double()
            self.__dict__["_eig_cache"] = cached = (key, g)
        return cached[1]

    def _scratch(self) -> torch.Tensor:
        """A ``(K, K)`` matrix to overwrite: the memory of a dense-route factor (which is then
        left to first use, formed again from the kept prior when next read), else new."""
        buf = self._buffers["scale_tril"]
        if self.__dict__["_route"] == "dense" and buf.is_contiguous():
            self.__dict__["_pending"].add("scale_tril")
            self.__dict__["_factor_of"] = None
            return buf
        return torch.empty(self.dim, self.dim, dtype=self.buffer_dtype, device=buf.device)

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
        """``diag Σ`` ``(K,)`` float64: the row sums of ``L²`` on the dense route (blocks of
        rows, no ``Σ``), ``Σ``'s diagonal once it is formed, `Woodbury.marginal_variance` while
        it is left in Woodbury's form."""
        woodbury = self._pending_woodbury()
        if woodbury is not None:
            return woodbury.marginal_variance()
        if "covariance_matrix" not in self.__dict__["_pending"]:
            return self.covariance_matrix.diagonal().double()
        factor = self.scale_tril
        out = torch.empty(self.dim, dtype=torch.float64, device=factor.device)
        for s in range(0, self.dim, 256):
            e = min(s + 256, self.dim)
            out[s:e] = factor[s:e, :e].double().square().sum(1)
        return out

    def apply_covariance(self, v: torch.Tensor) -> torch.Tensor:
        """``Σ v`` ``(..., K)`` float64: ``(v L) Lᵀ`` with the factor (no ``Σ``) on the dense
        route."""
        if self.__dict__["_route"] == "woodbury":
            return super().apply_covariance(v)
        factor = self.scale_tril
        return ((v.to(factor.dtype) @ factor) @ factor.T).double()

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
        Woodbury's form, from its factors (`Woodbury.functional_covariance`). The dense route
        forms ``L`` (never ``Σ``) if it is pending."""
        woodbury = self._pending_woodbury()
        if woodbury is not None:
            return woodbury.functional_covariance(jp).to(self.buffer_dtype)
        jp = jp.to(self.buffer_dtype)
        n, o, k = jp.shape
        if self.__dict__["_route"] == "woodbury" and "scale_tril" in self.__dict__["_pending"]:
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
        """``C_cd = φ̃ᵀ Σ_(c,d) φ̃`` (MoLA A.2) from features ``(n, P̃)``, in the buffers' dtype:
        on the dense route ``z_c · z_d`` with ``z_c = φ̃ᵀ L[rows_c]`` ``(n, K)`` (no ``Σ``), else
        from ``Σ``'s blocks."""
        if self.__dict__["_route"] != "woodbury":  # the factor's rows, also when Σ was formed
            # (a state_dict forms it) and after a reload (no route): the same bits as before
            factor = self.scale_tril
            phi = phi.to(factor.dtype)
            z = torch.stack([phi @ factor[r] for r in rows], 1)  # shape: (n, C, K)
            return z.square().sum(-1) if diagonal else z @ z.mT
        cov = self.covariance_matrix
        phi = phi.to(cov.dtype)
        if diagonal:
            blocks = cov[rows[:, :, None], rows[:, None, :]]  # (C, P̃, P̃)
            return torch.einsum("np,cpq,nq->nc", phi, blocks, phi)
        blocks = cov[rows[:, :, None, None], rows[None, None, :, :]]  # (C, P̃, C, P̃)
        return torch.einsum("np,cpdq,nq->ncd", phi, blocks, phi)

    def functional_covariance_on_grid(self, blocks, prior_at, rows=None):
        """``λ ↦ J Σ(λ) Jᵀ`` ``(N, O, O)`` float64 for a sweep over a scalar ``λ``.

        ``Λ₀ = λI`` (index subspaces, orthonormal bases): where three ``(K, K)`` matrices fit
        under `MAX_BYTES`, one eigendecomposition ``PᵀGP/T = U diag(e) Uᵀ`` for the whole sweep
        (`linalg.eigh_evr_` on a copy in the factor's memory, in the buffers' dtype), so
        ``J Σ(λ) Jᵀ = Σ_k a_k a_kᵀ / (e_k + λ)`` with ``a = J U`` (``O(N·O²·K)`` per ``λ``, no
        factorisation); else, per ``λ``, one Cholesky factor of the precision in the factor's
        memory and ``J Σ Jᵀ = Y Yᵀ`` with one triangular solve per block of rows of at most
        `GRID_SOLVE_BYTES` (two matrices: `linalg.solve_reversed_cholesky`). The factor is
        formed again on its next use.
        ``Λ₀ = λB`` with ``B = L Lᵀ`` (a dense basis): ``L⁻¹ (PᵀGP/T) L⁻ᵀ = U diag(e) Uᵀ``,
        ``a = J L⁻ᵀ U`` in float64. A per-coordinate ``λ`` sweep falls back to the default."""
        unit = prior_at(torch.tensor(1.0, dtype=torch.float64))
        if unit.lam.dim() != 0:
            return super().functional_covariance_on_grid(blocks, prior_at, rows)
        # in the dtype its route computes in (the buffers' for λI): no float64 copy beside
        dtype = self.buffer_dtype if unit.gram is None else torch.float64
        jp = stacked_jacobians(blocks, self.dim, rows, dtype)  # shape: (N, O, K)
        n, o, k = jp.shape
        temperature = float(self.temperature)
        if unit.gram is None:
            size = torch.empty((), dtype=self.buffer_dtype).element_size()
            scratch = self._scratch()
            if (len(HELD) + 1) * size * k * k <= MAX_BYTES or lapack_for(scratch) is None:
                e, u = eigh_evr_(scratch.copy_(self.ggn))
                del scratch
                ju = (jp.to(u.dtype) @ u).double()  # shape: (N, O, K)
                del u
                e = e.double().clamp_min(0.0) / temperature
                return lambda lam: torch.einsum("nok,k,npk->nop", ju, 1.0 / (e + lam), ju)

            points = max(1, GRID_SOLVE_BYTES // (o * k * jp.element_size()))  # per solve

            def f_cov(lam: torch.Tensor) -> torch.Tensor:
                scratch = self._scratch()  # (the factor may have been formed since: again pending)
                self._cholesky_reversed_(prior_at(torch.as_tensor(lam, dtype=torch.float64)), scratch)
                out = torch.empty(n, o, o, dtype=torch.float64, device=jp.device)
                for i in range(0, n, points):
                    rows = jp[i : i + points]
                    y = solve_reversed_cholesky(scratch, rows.reshape(-1, k)).view(rows.shape)
                    out[i : i + points] = torch.bmm(y, y.mT)
                return out

            return f_cov
        chol = torch.linalg.cholesky(unit.matrix())
        a = torch.linalg.solve_triangular(chol, self.ggn.double() / temperature, upper=False)
        a = torch.linalg.solve_triangular(chol, a.T.contiguous(), upper=False)
        e, u = torch.linalg.eigh((a + a.T) / 2)
        ju = jp @ torch.linalg.solve_triangular(chol.T, u, upper=True)
        e = e.clamp_min(0.0)
        return lambda lam: torch.einsum("nok,k,npk->nop", ju, 1.0 / (e + lam), ju)


def _placeholder(buf: torch.Tensor) -> torch.Tensor:
    """A ``(K, K)`` zero of no memory (stride 0) in ``buf``'s dtype and device."""
    return buf.new_zeros(()).expand(buf.shape)


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
