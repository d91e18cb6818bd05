"""Low rank plus isotropic remainder: the ``"lowrank"`` posterior structure of a Laplace guide.

laplace-torch's ``LowRankLaplace`` (Daxberger et al., 2021, "Laplace Redux", section 3.2):
the GGN of the subspace coordinates ``C = PᵀGP`` ``(K, K)`` is replaced by its top-``k``
eigenpairs ``C ≈ U diag(l) Uᵀ`` (``U`` ``(K, k)`` orthonormal, ``l`` ``(k,)``, by our Lanczos,
`curvature.lanczos_eigh`, on the GGN-vector product ``v ↦ Pᵀ G (P v)``; never a ``K × K``
matrix), and the prior fills the rest:

    Σ⁻¹ ≈ U diag(l) Uᵀ / T + Λ₀,        Λ₀ = λ I   (or ``diag(λ)``, or ``λ·diag(PᵀP)``)

Directions outside ``span(U)`` keep the prior precision ``λ``: the isotropic remainder. With
``V = Λ₀^{-1/2} U diag(l/T)^{1/2} = Q diag(s) Hᵀ`` (thin SVD), the Woodbury identity and the
matrix determinant lemma give everything in ``O(K k²)``:

    Σ = Λ₀^{-1/2} (I − Q diag(s²/(1+s²)) Qᵀ) Λ₀^{-1/2},   F = Λ₀^{-1/2} (I + Q diag(c) Qᵀ),
    c = (1+s²)^{-1/2} − 1  (F Fᵀ = Σ),   log|Σ⁻¹| = log|Λ₀| + Σ_j log(1 + s_j²).

**Packed form.** The guide keeps its curvature, precision, covariance and factor in buffers of
one shape ``(K+1, k+1)``, each packing a diagonal ``δ`` ``(K,)``, a basis ``M`` ``(K, k)`` and
weights ``w`` ``(k,)`` (`pack`, `unpack`): ``[[w, 0], [M, δ]]``. The curvature, precision and
covariance mean ``diag(δ) + M diag(w) Mᵀ``; the factor means ``diag(δ) (I + M diag(w) Mᵀ)``.
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import TorchDistribution, constraints

from ...curvature import ggn_vector_product, lanczos_eigh


def pack(diag: torch.Tensor, basis: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``δ`` ``(K,)``, ``M`` ``(K, k)``, ``w`` ``(k,)`` as one ``(K+1, k+1)`` tensor."""
    top = torch.cat([weights, weights.new_zeros(1)])[None]
    return torch.cat([top, torch.cat([basis, diag[:, None]], 1)], 0)


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(δ (K,), M (K, k), w (k,))`` of a packed tensor (views)."""
    return packed[1:, -1], packed[1:, :-1], packed[0, :-1]


def dense(packed: torch.Tensor) -> torch.Tensor:
    """``diag(δ) + M diag(w) Mᵀ`` ``(K, K)``: for tests and small ``K`` only."""
    d, m, w = unpack(packed)
    return torch.diag(d) + (m * w) @ m.T


class LowRankStructure:
    """``Σ⁻¹ ≈ U diag(l) Uᵀ/T + Λ₀`` with the ``rank`` leading GGN eigenpairs (module docstring).

    Args:
        rank: ``k``, eigenpairs kept, ``1 <= k <= K``. ``k = K`` is the full structure up to
            rounding (when ``Λ₀`` is diagonal).
        dim: ``K``, the number of coordinates (for the check).
        num_iter: Lanczos iterations (GGN-vector products, each one pass over the data);
            default that of `curvature.lanczos_eigh`, ``min(K, max(2k + 20, 3k))``.
        seed: seed of Lanczos' start vector.

    The prior enters through its diagonal, as in `DiagonalStructure` (``λ I`` for ``"shift"``
    priors and index kinds; exact whenever ``PᵀP`` is diagonal, e.g. `subspaces.ggn_eigen`).
    """

    name = "lowrank"

    def __init__(self, rank: int, dim: int, num_iter: int | None = None, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= dim:
            raise ValueError(
                f"rank: expected an int in [1, {dim}] (the subspace's K), got {rank!r}"
            )
        self.rank, self.num_iter, self.seed = rank, num_iter, seed

    @staticmethod
    def default_rank(dim: int) -> int:
        """``min(K, 10)``: laplace-torch's low-rank examples keep a few tens of eigenpairs at
        most; 10 costs ~40 GGN-vector products."""
        return min(dim, 10)

    def shape(self, k: int) -> tuple[int, ...]:
        return (k + 1, self.rank + 1)

    def __repr__(self) -> str:
        return f"LowRankStructure(rank={self.rank})"

    # ------------------------------------------------------------------ curvature and posterior

    def lanczos_iterations(self, dim: int) -> int:
        """GGN-vector products Lanczos would use for ``K = dim`` coordinates."""
        return self.num_iter or min(dim, max(2 * self.rank + 20, 3 * self.rank))

    def curvature(
        self, evaluator, t: torch.Tensor, dtype: torch.dtype = torch.float64
    ) -> torch.Tensor:
        """Top-``k`` eigenpairs of ``PᵀGP`` (untempered) at ``w = ŵ + P t``, packed with
        ``δ = 0``: Lanczos on ``v ↦ Pᵀ G (P v)`` over the evaluator's data in chunks.

        When Lanczos would need ``K`` products (``k`` close to ``K``, or small ``K``) it would
        be a full tridiagonalisation, no cheaper than the dense ``PᵀGP`` from the subspace's
        Jacobian blocks (`Evaluator.ggn`), and ``torch.linalg.eigh`` of that is exact: then
        that is used. Lanczos is accurate to about ``1e-6`` relative (its invariant-subspace
        rule, `curvature.lanczos`)."""
        model, data = evaluator.model, evaluator.data
        sub, lik, net = model.subspace, model.likelihood, model.flat.net
        if self.lanczos_iterations(sub.rank) >= sub.rank:
            values, vectors = torch.linalg.eigh(evaluator.ggn(t))
            values, vectors = values.flip(0)[: self.rank], vectors.flip(1)[:, : self.rank]
            values = values.clamp_min(0)
            return pack(values.new_zeros(sub.rank), vectors, values).to(dtype)
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
        values = values.clamp_min(0)
        return pack(values.new_zeros(sub.rank), vectors, values).to(dtype)

    @staticmethod
    def scale_curvature(curv: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
        d, m, w = unpack(curv)
        return pack(d, m, w * c)

    def newton_step(self, evaluator, t: torch.Tensor, grad: torch.Tensor, prior) -> torch.Tensor:
        """``Σ ∇`` with this structure's ``Σ`` at ``t`` (Woodbury, no ``K × K`` matrix): the MAP
        search's last step, kept by the guide only if it lowers the loss. ``prior`` is the
        guide's exact prior; its diagonal enters (``prior.diagonal``, else ``diag(Λ₀)``)."""
        diag = prior.diagonal if prior.diagonal is not None else prior.matrix.diagonal()
        precision = self.precision(self.curvature(evaluator, t), evaluator.temperature, diag)
        d, m, w = unpack(self.covariance(self.factor(precision)))
        return d * grad + m @ (w * (grad @ m))

    @staticmethod
    def prior_matrix(lam: torch.Tensor, model) -> torch.Tensor:
        """The diagonal ``(K,)`` of ``Λ₀``."""
        return lam if lam.dim() == 1 else lam * model.prior_gram_diagonal()

    @staticmethod
    def precision(curv: torch.Tensor, temperature: float, prior: torch.Tensor) -> torch.Tensor:
        """Packed ``diag(λ) + U diag(l/T) Uᵀ`` (differentiable in ``prior`` and ``curv``)."""
        _, u, l = unpack(curv)
        return pack(prior, u, l / temperature)

    @staticmethod
    def factor(precision: torch.Tensor) -> torch.Tensor:
        """Packed ``F = Λ₀^{-1/2} (I + Q diag(c) Qᵀ)`` with ``F Fᵀ = Σ`` (one thin SVD)."""
        p, u, w = unpack(precision)
        if not bool((p > 0).all()):
            raise torch.linalg.LinAlgError(
                f"posterior precision: the prior part is not positive, smallest {float(p.min()):g}"
            )
        d = p.rsqrt()
        q, s, _ = torch.linalg.svd(d[:, None] * u * w.clamp_min(0).sqrt(), full_matrices=False)
        return pack(d, q, (1 + s.square()).rsqrt() - 1)

    @staticmethod
    def covariance(factor: torch.Tensor) -> torch.Tensor:
        """Packed ``Σ = F Fᵀ = diag(δ²) + (δ Q) diag(c(2 + c)) (δ Q)ᵀ`` (``QᵀQ = I``)."""
        d, q, c = unpack(factor)
        return pack(d.square(), d[:, None] * q, c * (2 + c))

    # ------------------------------------------------------------------ predictives and draws

    @staticmethod
    def functional_covariance(jp: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
        """``J_P Σ J_Pᵀ = J_P diag(δ) J_Pᵀ + (J_P M) diag(w) (J_P M)ᵀ`` ``(n, O, O)`` from
        ``J_P`` ``(n, O, K)``, in ``O(n O K k)`` without a ``K × K`` matrix."""
        d, m, w = unpack(cov)
        jm = jp @ m  # (n, O, k)
        return torch.einsum("nok,k,npk->nop", jp, d, jp) + torch.einsum("nor,r,npr->nop", jm, w, jm)

    @staticmethod
    def feature_covariance(
        phi: torch.Tensor, rows: torch.Tensor, cov: torch.Tensor, diagonal: bool
    ):
        """A last layer (features ``φ̃`` ``(n, P̃)``, ``rows`` ``(C, P̃)``): ``C_cd`` ``(n, C, C)``."""
        d, m, w = unpack(cov)
        out = torch.diag_embed(torch.einsum("np,cp->nc", phi.square(), d[rows]))
        jm = torch.einsum("np,cpr->ncr", phi, m[rows])  # (n, C, k): rows of J_P M
        if diagonal:
            return out + torch.diag_embed(torch.einsum("ncr,r,ncr->nc", jm, w, jm))
        return out + torch.einsum("ncr,r,ndr->ncd", jm, w, jm)

    @staticmethod
    def draw(factor: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """``F ε`` for standard normal ``ε`` ``(..., K)``."""
        d, q, c = unpack(factor)
        return (eps + ((eps @ q) * c) @ q.T) * d

    @staticmethod
    def distribution(loc: torch.Tensor, factor: torch.Tensor):
        return LowRankFactorNormal(loc, factor)

    @staticmethod
    def marginal_std(factor: torch.Tensor) -> torch.Tensor:
        """``√diag(Σ)`` ``(K,)``."""
        d, q, c = unpack(factor)
        return d * (1 + q.square() @ (c * (2 + c))).clamp_min(0).sqrt()

    # ------------------------------------------------------------------ evidence

    @staticmethod
    def logdet(matrix: torch.Tensor, what: str) -> torch.Tensor:
        """``log|Λ₀|`` of a diagonal ``(K,)``, or of a packed ``diag(p) + U diag(w) Uᵀ`` by the
        matrix determinant lemma ``Σ log p + log|I_k + diag(w) Uᵀ diag(1/p) U|`` (differentiable)."""
        if matrix.dim() == 1:
            if not bool((matrix > 0).all()):
                raise torch.linalg.LinAlgError(f"{what}: not positive definite")
            return matrix.log().sum()
        p, u, w = unpack(matrix)
        if not bool((p > 0).all()):
            raise torch.linalg.LinAlgError(f"{what}: not positive definite")
        small = torch.eye(w.shape[0], dtype=p.dtype, device=p.device) + w[:, None] * (
            u.T @ (u / p[:, None])
        )
        sign, value = torch.linalg.slogdet(small)
        if not bool(sign > 0):
            raise torch.linalg.LinAlgError(f"{what}: not positive definite")
        return p.log().sum() + value

    @staticmethod
    def quad(matrix: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """``dᵀ A d`` for a diagonal ``(K,)`` or packed ``A``."""
        if matrix.dim() == 1:
            return (matrix * d.square()).sum()
        p, u, w = unpack(matrix)
        return (p * d.square()).sum() + (w * (d @ u).square()).sum()


class LowRankFactorNormal(TorchDistribution):
    """``N(loc, F Fᵀ)`` for a packed factor ``F = diag(δ)(I + Q diag(c) Qᵀ)`` (``QᵀQ = I``,
    ``c > −1``): draws, log-density (``F⁻¹ = (I + Q diag(1/(1+c) − 1) Qᵀ) diag(1/δ)``,
    ``log|F| = Σ log δ + Σ log(1 + c)``) and entropy in ``O(K k)``; event shape ``(K,)``."""

    arg_constraints: dict = {}
    support = constraints.real_vector
    has_rsample = True

    def __init__(self, loc: torch.Tensor, factor: torch.Tensor, validate_args=None) -> None:
        self.loc, self.factor = loc, factor
        self._d, self._q, self._c = unpack(factor)
        super().__init__(loc.shape[:-1], loc.shape[-1:], validate_args=validate_args)

    def expand(self, batch_shape, _instance=None):
        batch_shape = torch.Size(batch_shape)
        return LowRankFactorNormal(self.loc.expand(batch_shape + self.event_shape), self.factor)

    @property
    def mean(self) -> torch.Tensor:
        return self.loc

    @property
    def variance(self) -> torch.Tensor:
        return LowRankStructure.marginal_std(self.factor).square().expand(self.loc.shape)

    def rsample(self, sample_shape=torch.Size()) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        eps = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self.loc + LowRankStructure.draw(self.factor, eps)

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
