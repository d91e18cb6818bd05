"""`LowRankPosterior`: low rank plus isotropic remainder (laplace-torch's ``LowRankLaplace``).

Daxberger et al., 2021, "Laplace Redux", section 3.2: the GGN of the subspace coordinates
``C = PᵀGP`` ``(K, K)`` is replaced by its top-``k`` eigenpairs ``C ≈ U diag(l) Uᵀ`` (``U``
``(K, k)`` orthonormal, ``l`` ``(k,)``, by our Lanczos, `curvature.lanczos_eigh`, on the
GGN-vector product ``v ↦ Pᵀ G (P v)``; never a ``K × K`` matrix), and the prior fills the rest:

    Σ⁻¹ ≈ U diag(l) Uᵀ / T + Λ₀,        Λ₀ = diag(p)   (the prior's diagonal)

Directions outside ``span(U)`` keep the prior precision: the isotropic remainder. With
``V = Λ₀^{-1/2} U diag(l/T)^{1/2} = Q diag(s) Hᵀ`` (thin SVD), the Woodbury identity and the
matrix determinant lemma give everything in ``O(K k²)``:

    Σ = δ (I − Q diag(s²/(1+s²)) Qᵀ) δ,   F = δ (I + Q diag(c) Qᵀ),   δ = Λ₀^{-1/2},
    c = (1+s²)^{-1/2} − 1  (F Fᵀ = Σ),   log|Σ⁻¹| = log|Λ₀| + Σ_j log(1 + s_j²).
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution, constraints

from ....curvature import ggn_vector_product, lanczos_eigh
from ....flat import per_coordinate
from .base import Posterior, PriorPrecision, check_positive


class LowRankPosterior(Posterior):
    """``Σ⁻¹ ≈ U diag(l) Uᵀ/T + Λ₀`` with the ``rank`` leading GGN eigenpairs (module docstring).

    Buffers, float64: ``eigenvalues`` ``l`` ``(k,)`` (untempered) and ``eigenvectors`` ``U``
    ``(K, k)`` of the curvature; ``prior_diagonal`` ``(K,)`` of the ``Λ₀`` that ``Σ`` was formed
    with; the factor ``F = δ (I + Q diag(c) Qᵀ)`` as ``scale`` ``δ`` ``(K,)``,
    ``factor_basis`` ``Q`` ``(K, k)`` and ``factor_weights`` ``c`` ``(k,)``.

    Args:
        dim: ``K``, the number of coordinates.
        rank: ``k``, eigenpairs kept, ``1 <= k <= K`` (``None``: `default_rank`). ``k = K`` is
            the full structure up to rounding (when ``Λ₀`` is diagonal).
        num_iter: Lanczos iterations (GGN-vector products, each one pass over the data);
            default that of `curvature.lanczos_eigh`, ``min(K, max(2k + 20, 3k))``.
        seed: seed of Lanczos' start vector.
        device: of the buffers.
    """

    name = "lowrank"

    def __init__(
        self,
        dim: int,
        rank: int | None = None,
        num_iter: int | None = None,
        seed: int = 0,
        device=None,
    ) -> None:
        rank = self.default_rank(dim) if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= dim:
            raise ValueError(
                f"rank: expected an int in [1, {dim}] (the subspace's K), got {rank!r}"
            )
        super().__init__(dim, torch.float64, device)
        self.rank, self.num_iter, self.seed = rank, num_iter, seed
        f64 = {"dtype": torch.float64, "device": device}
        self.register_buffer("eigenvalues", torch.zeros(rank, **f64))
        self.register_buffer("eigenvectors", torch.zeros(dim, rank, **f64))
        self.register_buffer("prior_diagonal", per_coordinate(torch.zeros((), **f64), dim))
        self.register_buffer("scale", torch.zeros(dim, **f64))
        self.register_buffer("factor_basis", torch.zeros(dim, rank, **f64))
        self.register_buffer("factor_weights", torch.zeros(rank, **f64))

    @staticmethod
    def default_rank(dim: int) -> int:
        """``min(K, 10)``: laplace-torch's low-rank examples keep a few tens of eigenpairs at
        most; 10 costs ~40 GGN-vector products."""
        return min(dim, 10)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rank={self.rank}"

    def legacy_state(self, old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Unpack the ``(K+1, k+1)`` buffers of the former packed form ``[[w, 0], [M, δ]]``."""
        out = {}
        if "ggn" in old:
            out["eigenvectors"], out["eigenvalues"] = old["ggn"][1:, :-1], old["ggn"][0, :-1]
        if "precision" in old:
            out["prior_diagonal"] = old["precision"][1:, -1]
        if "scale_tril" in old:
            f = old["scale_tril"]
            out["scale"], out["factor_basis"], out["factor_weights"] = f[1:, -1], f[1:, :-1], f[0, :-1]
        return out

    # ------------------------------------------------------------------ building

    def lanczos_iterations(self, dim: int) -> int:
        """GGN-vector products Lanczos would use for ``K = dim`` coordinates."""
        return self.num_iter or min(dim, max(2 * self.rank + 20, 3 * self.rank))

    def eigenpairs(self, evaluator, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` eigenpairs ``(l (k,), U (K, k))`` float64 of ``PᵀGP`` (untempered) at
        ``w = ŵ + P t``: Lanczos on ``v ↦ Pᵀ G (P v)`` over the evaluator's data in chunks.

        When Lanczos would need ``K`` products (``k`` close to ``K``, or small ``K``) it would
        be a full tridiagonalisation, no cheaper than the dense ``PᵀGP`` from the subspace's
        Jacobian blocks (`Evaluator.ggn`), and ``torch.linalg.eigh`` of that is exact: then
        that is used. Lanczos is accurate to about ``1e-6`` relative (its invariant-subspace
        rule, `curvature.lanczos`)."""
        model = evaluator.model
        if self.lanczos_iterations(model.subspace.rank) >= model.subspace.rank:
            values, vectors = torch.linalg.eigh(evaluator.ggn(t))
            values, vectors = values.flip(0)[: self.rank], vectors.flip(1)[:, : self.rank]
            return values.clamp_min(0), vectors
        data, sub, lik, net = evaluator.data, model.subspace, model.likelihood, model.flat.net
        w = sub.weights(t).detach()

        def matvec(v: torch.Tensor) -> torch.Tensor:
            pv = sub.direction(v.to(w.dtype))
            total = torch.zeros_like(w)
            for xc in data.inputs():
                total += ggn_vector_product(net, lik, xc, pv, w=w, chunk_size=data.chunk_size)
            return sub.transpose_apply(total).double()

        values, vectors = lanczos_eigh(
            matvec, sub.rank, self.rank, num_iter=self.num_iter, dtype=torch.float64,
            device=w.device, seed=self.seed,
        )  # fmt: skip
        return values.clamp_min(0), vectors

    def fit_curvature(self, evaluator, t: torch.Tensor, **kwargs: object) -> None:
        self.temperature.fill_(evaluator.temperature)
        values, vectors = self.eigenpairs(evaluator, t)
        self.eigenvalues.copy_(values), self.eigenvectors.copy_(vectors)

    def scale_curvature_(self, c: float) -> None:
        self.eigenvalues.mul_(c)

    def set_prior(self, prior: PriorPrecision) -> None:
        """``F = δ (I + Q diag(c) Qᵀ)`` from one thin SVD of ``δ U diag(l/T)^{1/2}``."""
        p = prior.diagonal().detach().to(torch.float64).expand(self.dim)
        check_positive(p, "posterior precision: the prior part")
        d, q, c = _factor(p, self.eigenvectors, self.eigenvalues / float(self.temperature))
        self.prior_diagonal = per_coordinate(p, self.dim)
        self.scale.copy_(d), self.factor_basis.copy_(q), self.factor_weights.copy_(c)

    def log_det(self, prior: PriorPrecision, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """``Σ log p + log|I_k + diag(s l/T) Uᵀ diag(1/p) U|`` (matrix determinant lemma)."""
        p = prior.diagonal().expand(self.dim)
        check_positive(p.detach(), "posterior precision")
        u, w = self.eigenvectors, scale * self.eigenvalues / float(self.temperature)
        small = torch.eye(self.rank, dtype=p.dtype, device=p.device) + w[:, None] * (
            u.T @ (u / p[:, None])
        )
        sign, value = torch.linalg.slogdet(small)
        if not bool(sign > 0):
            raise torch.linalg.LinAlgError("posterior precision: not positive definite")
        return p.log().sum() + value

    # ------------------------------------------------------------------ draws and moments

    def draw(self, eps: torch.Tensor) -> torch.Tensor:
        """``F ε`` for standard normal ``ε`` ``(..., K)``."""
        d, q, c = self.scale, self.factor_basis, self.factor_weights
        return (eps + ((eps @ q) * c) @ q.T) * d

    def distribution(self, loc: torch.Tensor):
        return LowRankFactorNormal(loc, self.scale, self.factor_basis, self.factor_weights)

    def _covariance_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Σ = diag(δ²) + (δ Q) diag(c(2 + c)) (δ Q)ᵀ`` (``QᵀQ = I``) as its three parts."""
        d, q, c = self.scale, self.factor_basis, self.factor_weights
        return d.square(), d[:, None] * q, c * (2 + c)

    def covariance(self) -> torch.Tensor:
        diag, m, w = self._covariance_parts()
        return torch.diag(diag) + (m * w) @ m.T

    def precision(self) -> torch.Tensor:
        u = self.eigenvectors
        return torch.diag(self.prior_diagonal) + (u * (self.eigenvalues / float(self.temperature))) @ u.T

    def curvature(self) -> torch.Tensor:
        u = self.eigenvectors
        return (u * self.eigenvalues) @ u.T

    def posterior_precision(self):
        """``((U, l/T), p)``: the low-rank part and the prior's diagonal, laplace-torch's
        ``LowRankLaplace.posterior_precision`` form."""
        return (self.eigenvectors, self.eigenvalues / float(self.temperature)), self.prior_diagonal

    def marginal_variance(self) -> torch.Tensor:
        d, q, c = self.scale, self.factor_basis, self.factor_weights
        return d.square() * (1 + q.square() @ (c * (2 + c))).clamp_min(0)

    def functional_covariance(self, jp: torch.Tensor) -> torch.Tensor:
        """``J diag(δ²) Jᵀ + (J δQ) diag(w) (J δQ)ᵀ`` ``(n, O, O)`` in ``O(n O K k)``."""
        diag, m, w = (v.to(jp.dtype) for v in self._covariance_parts())
        jm = jp @ m  # (n, O, k)
        return torch.einsum("nok,k,npk->nop", jp, diag, jp) + torch.einsum("nor,r,npr->nop", jm, w, jm)

    def feature_covariance(
        self, phi: torch.Tensor, rows: torch.Tensor, diagonal: bool = False
    ) -> torch.Tensor:
        diag, m, w = (v.to(phi.dtype) for v in self._covariance_parts())
        var = torch.einsum("np,cp->nc", phi.square(), diag[rows])
        jm = torch.einsum("np,cpr->ncr", phi, m[rows])  # (n, C, k): rows of J δQ
        if diagonal:
            return var + torch.einsum("ncr,r,ncr->nc", jm, w, jm)
        return torch.diag_embed(var) + torch.einsum("ncr,r,ndr->ncd", jm, w, jm)

    def newton_step(self, evaluator, t: torch.Tensor, grad: torch.Tensor, prior: PriorPrecision):
        """``Σ ∇`` with this structure's ``Σ`` at ``t`` (Woodbury, no ``K × K`` matrix): the MAP
        search's last step, kept by the guide only if it lowers the loss; the prior's diagonal
        enters."""
        values, vectors = self.eigenpairs(evaluator, t)
        d, q, c = _factor(prior.diagonal().expand(self.dim), vectors, values / evaluator.temperature)
        m, w = d[:, None] * q, c * (2 + c)
        return d.square() * grad + m @ (w * (grad @ m))


def _factor(p: torch.Tensor, u: torch.Tensor, l: torch.Tensor):
    """``(δ, Q, c)`` of ``F = δ (I + Q diag(c) Qᵀ)``, ``F Fᵀ = (diag(p) + U diag(l) Uᵀ)⁻¹``."""
    d = p.rsqrt()
    q, s, _ = torch.linalg.svd(d[:, None] * u * l.clamp_min(0).sqrt(), full_matrices=False)
    return d, q, (1 + s.square()).rsqrt() - 1


class LowRankFactorNormal(TorchDistribution):
    """``N(loc, F Fᵀ)`` for ``F = diag(δ)(I + Q diag(c) Qᵀ)`` (``QᵀQ = I``, ``c > −1``): draws,
    log-density (``F⁻¹ = (I + Q diag(1/(1+c) − 1) Qᵀ) diag(1/δ)``,
    ``log|F| = Σ log δ + Σ log(1 + c)``) and entropy in ``O(K k)``; event shape ``(K,)``."""

    arg_constraints: dict = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc, scale, basis, weights, validate_args=None) -> None:
        self.loc = loc
        self._d, self._q, self._c = (v.to(loc) for v in (scale, basis, weights))
        super().__init__(loc.shape[:-1], loc.shape[-1:], validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        loc = self.loc.expand(batch_shape + self.event_shape)
        return LowRankFactorNormal(loc, self._d, self._q, self._c)

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        d, q, c = self._d, self._q, self._c
        var = d.square() * (1 + q.square() @ (c * (2 + c))).clamp_min(0)
        return var.expand(self.loc.shape)

    def rsample(self, sample_shape=torch.Size()) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + (eps + ((eps @ self._q) * self._c) @ self._q.T) * self._d

    def _half_log_det(self) -> torch.Tensor:
        return self._d.log().sum() + torch.log1p(self._c).sum()

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        if self._validate_args:
            self._validate_sample(value)
        y = (value - self.loc) / self._d
        y = y + ((y @ self._q) * (1 / (1 + self._c) - 1)) @ self._q.T
        k = self.event_shape[0]
        return -0.5 * y.square().sum(-1) - self._half_log_det() - k / 2 * math.log(2 * math.pi)

    def entropy(self) -> torch.Tensor:
        k = self.event_shape[0]
        return (k / 2 * (1 + math.log(2 * math.pi)) + self._half_log_det()).expand(self.batch_shape)
