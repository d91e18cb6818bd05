"""`KronPosterior`: the K-FAC Laplace posterior, one Kronecker-factored block per layer.

Ritter, Botev & Barber (2018), "A Scalable Laplace Approximation for Neural Networks"; the
K-FAC Laplace of laplace-torch (``KronLaplace``) and of Mixtures of Laplace Approximations
(Algorithm 1, App. B.2). Over a subspace that is a union of whole parameter tensors (the last
layer, all weights, a set of layers) the GGN is replaced by `curvature.kfac`'s blocks: per
``nn.Linear``/``nn.Conv2d`` weight ``G ⊗ A`` (``G`` ``(out, out)`` a sum over the data of the
back-propagated output-Hessian factor columns, ``A`` ``(in, in)`` the mean of the layer's inputs'
outer products), per bias ``G`` (a Kronecker block with ``A = [1]``), and the exact GGN
diagonal for every other parameter (BatchNorm, embeddings, ...). With the eigendecompositions
``G = Q_G diag(g) Q_Gᵀ`` and ``A = Q_A diag(a) Q_Aᵀ`` each block of the posterior precision is
diagonal in the Kronecker eigenbasis::

    Σ⁻¹_block = (Q_G ⊗ Q_A) diag(m) (Q_G ⊗ Q_A)ᵀ,   m_kl = s g_k a_l / T + λ_block

(``s`` a curvature scale, ``T`` the temperature): the prior is added exactly in the eigenbasis,
as laplace-torch does. So the log-determinant ``Σ log m`` and its gradient in ``λ`` cost
``O(D)`` per ``λ`` without refactorising, draws are ``(Q_G ⊗ Q_A) diag(m^{-1/2}) ε``
(``vec(Q_G (E / √m) Q_Aᵀ)``, row-major ``vec``), and ``J Σ Jᵀ`` rotates each layer's Jacobian
block into the eigenbasis. ``damping="ritter"`` uses Ritter et al.'s damped factors instead,
``(√N A + √λ I) ⊗ (G/√N + √λ I)`` (their eq. 11 with ``A``, ``G`` as means): eigenvalues
``m_kl = (s g_k/(T√N) + √λ)(√N a_l + √λ)``, the KFAC-Laplace baseline of Subspace Inference's
tables 8–9.

The prior ``λ`` must be one value per Kronecker block (a scalar, or laplace-torch's
``prior_structure="layerwise"``: one per parameter tensor); a per-weight ``λ`` is exact only on
the full and diagonal structures and is refused here (it is accepted on diagonal blocks).
"""

from __future__ import annotations

import copy
import math

import torch

from .... import batch as batching
from ....curvature.kfac import KronFactors, conv_patches, kfac
from ....flat import eval_mode, flat_parameters, per_coordinate
from ....linalg import eigh_
from ....nn.evaluator import MapStatistics
from ....subspaces.last_layer import LastLayerSubspace
from ....threads import thread_policy
from ....validation import choice
from .base import Posterior, PriorPrecision, check_positive

#: the most coordinates a dense ``(K, K)`` covariance, precision or curvature is formed for
DENSE_LIMIT = 10_000
DAMPINGS = ("exact", "ritter")


class KronPosterior(Posterior):
    """K-FAC Laplace over a union of whole parameter tensors (module docstring).

    Args:
        dim: ``K``, the coordinates (the subspace's indices, in its order).
        fisher: ``"type-2"`` (the exact GGN factors) or ``"mc"`` (one sampled output per point,
            laplace-torch's ``stochastic=True``), `curvature.kfac`.
        conv: ``Conv2d`` weight sharing: ``"expand"`` (laplace-torch's default curvlinops
            backend), ``"reduce"`` or ``"backpack"`` (laplace-torch's BackPack backend).
        bias: ``"separate"`` (a bias its own block, laplace-torch's convention) or ``"augment"``.
        damping: ``"exact"`` (the prior added in the eigenbasis) or ``"ritter"``.
        mc_samples, seed: of the ``"mc"`` Fisher (a fixed seed: refits repeat).
        device: of the buffers.

    Buffers (float64), per block ``i``: ``b{i}_pos`` the block's coordinates among the ``K``
    (row-major ``vec`` of ``(out, in)``), ``b{i}_gvals``/``b{i}_gvecs`` and
    ``b{i}_avals``/``b{i}_avecs`` (eigenpairs of ``G`` and ``A``) or ``b{i}_diag`` for a
    diagonal block; ``prior_diagonal`` ``(K,)`` the ``λ`` that ``Σ`` is formed with;
    ``num_data`` ``N``.
    """

    name = "kron"

    def __init__(
        self,
        dim: int,
        fisher: str = "type-2",
        conv: str = "expand",
        bias: str = "separate",
        damping: str = "exact",
        mc_samples: int = 1,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
        device=None,
    ) -> None:
        super().__init__(dim, torch.float64, device)
        choice(fisher, "fisher", ("type-2", "mc")), choice(conv, "conv", ("expand", "reduce", "backpack"))
        choice(bias, "bias", ("separate", "augment")), choice(damping, "damping", DAMPINGS)
        self.fisher, self.conv, self.bias, self.damping = fisher, conv, bias, damping
        self.mc_samples, self.seed = mc_samples, seed
        f64 = {"dtype": torch.float64, "device": device}
        self.register_buffer("prior_diagonal", per_coordinate(torch.zeros((), **f64), dim))
        self.register_buffer("num_data", torch.zeros((), **f64))
        self._blocks: list[str] = []  # block prefixes "b0", "b1", ...
        #: per block, the module it belongs to and its parameters' names (`get_extra_state`)
        self._owners: list[tuple[str, tuple[str, ...]]] = []

    def extra_repr(self) -> str:
        return f"dim={self.dim}, blocks={len(self._blocks)}, damping={self.damping!r}"

    # ------------------------------------------------------------------ blocks

    def _block(self, prefix: str) -> dict[str, torch.Tensor]:
        return {
            key: self._buffers[f"{prefix}_{key}"]
            for key in ("pos", "gvals", "gvecs", "avals", "avecs", "diag")
            if f"{prefix}_{key}" in self._buffers
        }

    def buffers_replaced_only(self) -> list[str]:
        """Every block buffer but the curvature's eigenvalues (scaled in place by a new ``σ``):
        a fit or a loaded state replaces the blocks (`transaction.REPLACED_ONLY`)."""
        keep = ("pos", "gvecs", "avals", "avecs")
        return [f"{p}_{k}" for p in self._blocks for k in keep if f"{p}_{k}" in self._buffers]

    def blocks(self) -> list[dict[str, torch.Tensor]]:
        """The blocks: dicts of ``pos`` and ``gvals, gvecs, avals, avecs`` (Kronecker) or
        ``diag`` (diagonal)."""
        return [self._block(p) for p in self._blocks]

    def _set_blocks(self, blocks: list[dict[str, torch.Tensor]]) -> None:
        for prefix in self._blocks:
            for key in [k for k in self._buffers if k.startswith(prefix + "_")]:
                del self._buffers[key]
        self._blocks = []
        for i, block in enumerate(blocks):
            prefix = f"b{i}"
            for key, value in block.items():
                self.register_buffer(f"{prefix}_{key}", value)
            self._blocks.append(prefix)

    def get_extra_state(self) -> dict:
        """The blocks' modules and parameter names (kept in the ``state_dict``)."""
        return {"owners": [[m, list(p)] for m, p in self._owners]}

    def set_extra_state(self, state: dict) -> None:
        self._owners = [(m, tuple(p)) for m, p in state.get("owners", [])]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Make the blocks the state holds (their number and shapes come with it)."""
        names = sorted(
            {k[len(prefix):].split("_")[0] for k in state_dict if k.startswith(prefix + "b")},
            key=lambda s: int(s[1:]) if s[1:].isdigit() else -1,
        )
        blocks = []
        for name in names:
            keys = [k for k in state_dict if k.startswith(f"{prefix}{name}_")]
            blocks.append({k[len(prefix) + len(name) + 1:]: torch.empty_like(state_dict[k]) for k in keys})
        self._set_blocks(blocks)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ building

    def fit_curvature(self, evaluator, t: torch.Tensor, **kwargs: object):
        """K-FAC factors at ``w = ŵ + P t`` over the evaluator's data (one pass,
        `curvature.kfac`), eigendecomposed per block; the evidence's statistics at ``t`` come
        from the same forward pass (returned when the data have targets)."""
        data = evaluator.data
        stats = None
        if data.loader is not None or data.y is not None:
            stats = MapStatistics(evaluator.model.likelihood)
        factors = self.factors(evaluator, t, stats)
        self.temperature.fill_(evaluator.temperature)
        self.num_data.fill_(float(factors.num_data))
        blocks = factors.blocks
        del factors  # the blocks are released one by one as they are eigendecomposed
        self._set_blocks(self._eigen_blocks(blocks, evaluator.model.subspace))
        return None if stats is None else data.reduce(*stats.totals())

    def factors(
        self, evaluator, t: torch.Tensor, stats: MapStatistics | None = None
    ) -> KronFactors:
        """`curvature.kfac` of the model's network at ``w = ŵ + P t`` over the modules that own
        the subspace's coordinates (the network's weights are put back afterwards); ``stats``
        (a `MapStatistics`) takes each pass's outputs and targets."""
        model, data = evaluator.model, evaluator.data
        sub, flat = model.subspace, model.flat
        basis = _basis(sub)
        owners = _owning_modules(flat.net, basis)
        w0 = flat.vector().detach().clone()
        x = data.loader if data.loader is not None else data.x
        y = data.y if data.loader is None and stats is not None else None
        hook = None if stats is None else lambda out, yc: stats.add(out, yc, prepared=False)
        try:
            flat.load_vector(sub.weights(t).detach().to(w0))
            with eval_mode(flat.net):
                return kfac(
                    flat.net, model.likelihood, x, y, modules=owners, fisher=self.fisher,
                    conv=self.conv, bias=self.bias, chunk_size=data.chunk_size,
                    generator=self.seed, mc_samples=self.mc_samples, dtype=torch.float64,
                    on_outputs=hook,
                )  # fmt: skip
        finally:
            flat.load_vector(w0)

    @thread_policy
    def _eigen_blocks(self, factors: list, sub) -> list[dict[str, torch.Tensor]]:
        """Each `KronBlock` of ``factors`` (a list, emptied as it goes: a block's factors are
        freed once decomposed) as its buffers: positions in the subspace, eigenpairs. Under
        the library's thread policy, as the K-FAC pass is (`threads`: one thread on a few
        cores): LAPACK's ``syevd`` on two OpenBLAS threads of a shared 2-core machine took
        36-45 s for a 2304 × 2304 factor (LoRA's ``B`` on GPT-2), on one 10-11 s (load 14)."""
        basis = _basis(sub).to(factors[0].index.device if factors else "cpu")
        # the coordinates of a block's indices in the subspace: one sort of the basis for all
        # blocks (none when it is sorted, as the subspaces of whole layers are), a binary search
        # per index (not torch.isin, which sorts per block)
        order = None if bool((basis[1:] > basis[:-1]).all()) else torch.argsort(basis)
        ordered = basis if order is None else basis[order]
        blocks, covered, owners = [], 0, []
        while factors:
            block = factors.pop(0)
            idx = block.index.to(basis.device)
            at = torch.searchsorted(ordered, idx).clamp_max_(ordered.numel() - 1)
            hit = ordered[at] == idx
            inside, touched = bool(hit.all()), bool(hit.any())
            del hit
            if not touched:
                continue
            if not inside:
                raise ValueError(
                    "hessian_structure: 'kron' needs a subspace made of whole parameter tensors "
                    f"(it holds part of {block.module}'s {', '.join(block.params)}); use "
                    "subset_of_weights='last_layer'/'all' or hessian_structure='full'/'diag'"
                )
            covered += idx.numel()
            owners.append((block.module, tuple(block.params)))
            out = {"pos": (at if order is None else order[at]).to(self.prior_diagonal.device)}
            del idx, at
            if block.kind == "diagonal":
                out["diag"] = block.diagonal.double().clamp_min(0)
            else:
                g = block.G.double()
                a = block.A.double() if block.A is not None else g.new_ones(1, 1)
                out["gvals"], out["gvecs"] = _eigh(g)
                out["avals"], out["avecs"] = _eigh(a)
            blocks.append({k: v.to(self.prior_diagonal.device) for k, v in out.items()})
        if covered != self.dim:
            raise ValueError(
                "hessian_structure: 'kron' needs a subspace made of whole parameter tensors of "
                "the network; this one is not (use hessian_structure='full' or 'diag')"
            )
        self._owners = owners
        return blocks

    def scale_curvature_(self, c: float) -> None:
        for block in self.blocks():
            (block["gvals"] if "gvals" in block else block["diag"]).mul_(c)

    def set_prior(self, prior: PriorPrecision) -> None:
        lam = prior.diagonal().detach().to(torch.float64).expand(self.dim)
        check_positive(lam, "prior precision")
        self._block_lambdas(lam)  # one λ per Kronecker block: checked before it is kept
        self.prior_diagonal = per_coordinate(lam, self.dim)

    def _block_lambdas(self, lam: torch.Tensor) -> list[torch.Tensor]:
        """Per block, its ``λ``: 0-d for a Kronecker block (refused unless constant over it),
        per coordinate for a diagonal one."""
        out = []
        for block in self.blocks():
            values = lam[block["pos"]]
            if "diag" in block:
                out.append(values)
                continue
            if bool((values.detach() != values.detach()[0]).any()):
                raise ValueError(
                    "prior_precision: a Kronecker block needs one λ over each parameter tensor "
                    "(a scalar, or prior_structure='layerwise'); a per-weight λ is exact only on "
                    "hessian_structure='full' or 'diag'"
                )
            out.append(values[0])
        return out

    # ------------------------------------------------------------------ eigenvalues

    def _eigenvalues(self, block, lam, scale=1.0) -> torch.Tensor:
        """``m`` of one block: ``(out, in)`` for a Kronecker block, ``(n,)`` for a diagonal one."""
        t = float(self.temperature)
        if "diag" in block:
            return scale * block["diag"] / t + lam
        g, a = block["gvals"], block["avals"]
        if self.damping == "ritter":
            n = float(self.num_data)
            root = lam.sqrt()
            return (scale * g / (t * math.sqrt(n)) + root)[:, None] * (math.sqrt(n) * a + root)[None, :]
        return scale * g[:, None] * a[None, :] / t + lam

    def _prior_eigenvalues(self) -> list[torch.Tensor]:
        lams = self._block_lambdas(self.prior_diagonal)
        return [self._eigenvalues(b, lam) for b, lam in zip(self.blocks(), lams)]

    def log_det(self, prior: PriorPrecision, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """``Σ_blocks Σ log m`` (``O(D)`` per ``λ``, differentiable in ``λ`` and the scale).

        A ``λ`` per coordinate (constant over each Kronecker block) gets its exact gradient
        ``∂ log|Σ⁻¹| / ∂λ_i = Σ_ii`` (the marginal variances, ``O(out² in + out in²)`` per
        block); one ``λ`` per block, or a scalar, the block's trace through ``m``."""
        lam = prior.diagonal().expand(self.dim)
        per_coordinate = prior.lam.dim() == 1 and prior.lam.requires_grad
        lams = self._block_lambdas(lam.detach() if per_coordinate else lam)
        total = lam.new_zeros(())
        for block, lb in zip(self.blocks(), lams):
            m = self._eigenvalues(block, lb, scale)
            check_positive(m.detach(), "posterior precision")
            total = total + m.log().sum()
        if per_coordinate:  # value unchanged; ∂/∂λ_i = Σ_ii at this λ and scale
            with torch.no_grad():
                eig = [self._eigenvalues(b, lb, scale) for b, lb in zip(self.blocks(), lams)]
                var = self._marginal_variance(eig)
            total = total + ((lam - lam.detach()) * var).sum()
        return total

    # ------------------------------------------------------------------ draws and moments

    def _rotate(self, block, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``(Q_G ⊗ Q_A)ᵀ x`` (or ``(Q_G ⊗ Q_A) x`` with ``inverse``) for ``x`` ``(..., out·in)``
        (row-major ``vec``): ``Q_Gᵀ X Q_A``."""
        qg, qa = block["gvecs"], block["avecs"]
        x = x.reshape(*x.shape[:-1], qg.shape[0], qa.shape[0])
        if inverse:
            y = qg @ x @ qa.T
        else:
            y = qg.T @ x @ qa
        return y.reshape(*y.shape[:-2], -1)

    def _apply_power(self, v: torch.Tensor, power: float) -> torch.Tensor:
        """``Σ^{-power}``-like: ``(Q_G ⊗ Q_A) diag(m^power) (Q_G ⊗ Q_A)ᵀ v`` per block for
        ``v`` ``(..., K)`` (``power = −1``: ``Σ v``; ``1``: ``Σ⁻¹ v``)."""
        out = torch.zeros_like(v, dtype=torch.float64)
        v = v.double()
        for block, m in zip(self.blocks(), self._prior_eigenvalues()):
            pos = block["pos"]
            if "diag" in block:
                out[..., pos] = v[..., pos] * m.pow(power)
            else:
                z = self._rotate(block, v[..., pos]) * m.reshape(-1).pow(power)
                out[..., pos] = self._rotate(block, z, inverse=True)
        return out

    def apply_covariance(self, v: torch.Tensor) -> torch.Tensor:
        """``Σ v`` block by block in the eigenbasis, ``O(D (out + in))``, no dense matrix."""
        return self._apply_power(v, -1.0)

    def apply_precision(self, v: torch.Tensor) -> torch.Tensor:
        """``Σ⁻¹ v`` block by block in the eigenbasis."""
        return self._apply_power(v, 1.0)

    def draw(self, eps: torch.Tensor) -> torch.Tensor:
        """``F ε``, ``F = (Q_G ⊗ Q_A) diag(m^{-1/2})`` per block (``F Fᵀ = Σ``)."""
        out = torch.zeros_like(eps, dtype=torch.float64)
        eps = eps.double()
        for block, m in zip(self.blocks(), self._prior_eigenvalues()):
            pos = block["pos"]
            if "diag" in block:
                out[..., pos] = eps[..., pos] * m.rsqrt()
            else:
                out[..., pos] = self._rotate(block, eps[..., pos] * m.reshape(-1).rsqrt(), inverse=True)
        return out

    def _dense(self, power: float | None) -> torch.Tensor:
        if self.dim > DENSE_LIMIT:
            raise ValueError(
                f"hessian_structure='kron': a dense ({self.dim}, {self.dim}) matrix is not formed "
                f"above {DENSE_LIMIT} coordinates; use marginal_variance(), functional_covariance"
                "(J) or draws"
            )
        eye = torch.eye(self.dim, dtype=torch.float64, device=self.prior_diagonal.device)
        if power is None:  # the curvature: m = g a (untempered)
            out = torch.zeros_like(eye)
            for block in self.blocks():
                pos = block["pos"]
                if "diag" in block:
                    out[pos, pos] = block["diag"]
                else:
                    m = (block["gvals"][:, None] * block["avals"][None, :]).reshape(-1)
                    z = self._rotate(block, eye[pos][:, pos]) * m
                    out[pos[:, None], pos[None, :]] = self._rotate(block, z, inverse=True)
            return out
        return self._apply_power(eye, power)

    def covariance(self) -> torch.Tensor:
        return self._dense(-1.0)

    def precision(self) -> torch.Tensor:
        return self._dense(1.0)

    def curvature(self) -> torch.Tensor:
        return self._dense(None)

    def posterior_precision(self):
        """Per block ``(pos, (g, Q_G), (a, Q_A), m)`` or ``(pos, m)`` for a diagonal block: the
        eigendecomposed form laplace-torch's ``KronLaplace.posterior_precision`` returns."""
        out = []
        for block, m in zip(self.blocks(), self._prior_eigenvalues()):
            if "diag" in block:
                out.append((block["pos"], m))
            else:
                g, a = (block["gvals"], block["gvecs"]), (block["avals"], block["avecs"])
                out.append((block["pos"], g, a, m))
        return out

    def marginal_variance(self) -> torch.Tensor:
        return self._marginal_variance(self._prior_eigenvalues())

    def _marginal_variance(self, eigenvalues: list[torch.Tensor]) -> torch.Tensor:
        """``diag(Σ)`` ``(K,)`` for the blocks' precision eigenvalues ``m``."""
        out = torch.zeros(self.dim, dtype=torch.float64, device=self.prior_diagonal.device)
        for block, m in zip(self.blocks(), eigenvalues):
            pos = block["pos"]
            if "diag" in block:
                out[pos] = m.reciprocal()
            else:
                qg2, qa2 = block["gvecs"].square(), block["avecs"].square()
                out[pos] = (qg2 @ m.reciprocal() @ qa2.T).reshape(-1)
        return out

    def functional_covariance(self, jp: torch.Tensor) -> torch.Tensor:
        """``J Σ Jᵀ = Σ_blocks J̃ diag(1/m) J̃ᵀ`` with ``J̃ = J_block (Q_G ⊗ Q_A)`` (each layer's
        Jacobian block rotated into its eigenbasis; no ``K × K`` matrix), ``(n, O, O)``."""
        jp64 = jp.double()
        out = jp64.new_zeros(jp.shape[0], jp.shape[1], jp.shape[1])
        for block, m in zip(self.blocks(), self._prior_eigenvalues()):
            jb = jp64[..., block["pos"]]
            if "diag" in block:
                out += torch.einsum("nok,k,npk->nop", jb, m.reciprocal(), jb)
            else:
                jr = self._rotate(block, jb)
                out += torch.einsum("nok,k,npk->nop", jr, m.reshape(-1).reciprocal(), jr)
        return out.to(jp.dtype)

    def functional_variance(self, jp: torch.Tensor) -> torch.Tensor:
        jp64 = jp.double()
        out = jp64.new_zeros(jp.shape[0], jp.shape[1])
        for block, m in zip(self.blocks(), self._prior_eigenvalues()):
            jb = jp64[..., block["pos"]]
            jr = jb if "diag" in block else self._rotate(block, jb)
            out += jr.square() @ m.reshape(-1).reciprocal()
        return out.to(jp.dtype)

    def feature_covariance(
        self, phi: torch.Tensor, rows: torch.Tensor, diagonal: bool = False
    ) -> torch.Tensor:
        """A last layer in closed form, no ``CP × CP`` matrix: for the weight block
        (``pos`` = ``rows[:, j0:j0+in]``) ``J Σ Jᵀ[n] = Q_G diag(v_n) Q_Gᵀ`` with
        ``v_n = (1/m) (Q_Aᵀ φ̃_n)²``; a bias block (``A = [1]``, ``pos = rows[:, j]``) adds
        ``φ̃_nj² Σ_b``; a diagonal block ``Σ_p φ̃_p² var``. Other layouts take the default."""
        n, c = phi.shape[0], rows.shape[0]
        phi64 = phi.double()
        out = phi64.new_zeros((n, c) if diagonal else (n, c, c))
        for block, m in zip(self.blocks(), self._prior_eigenvalues()):
            pos = block["pos"]
            if "diag" in block:
                var = torch.zeros(self.dim, dtype=torch.float64, device=pos.device)
                var[pos] = m.reciprocal()
                v = torch.einsum("np,cp->nc", phi64.square(), var[rows])
                out += v if diagonal else torch.diag_embed(v)
                continue
            qg, qa = block["gvecs"], block["avecs"]
            cols = _columns(rows, pos.reshape(qg.shape[0], qa.shape[0]))
            if cols is None:
                return super().feature_covariance(phi, rows, diagonal)
            lo = int(cols[0])  # a last layer's weight columns are a range: a view, no copy
            span = torch.equal(cols, torch.arange(lo, lo + cols.numel(), device=cols.device))
            proj = (phi64[:, lo : lo + cols.numel()] if span else phi64[:, cols]) @ qa  # Q_Aᵀ φ̃
            v = proj.square_() @ m.reciprocal().T  # (n, out)
            if diagonal:  # diag(Q_G diag(v) Q_Gᵀ): no (n, C, C) array
                out += v @ qg.square().T
            else:
                out += torch.einsum("ck,nk,dk->ncd", qg, v, qg)
        return out.to(phi.dtype)

    # ------------------------------------------------------------------ the network's outputs

    def linearized_outputs(
        self, model, x: torch.Tensor, w: torch.Tensor, chunk_size: int, diagonal: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``f(x, w)`` and ``J Σ Jᵀ`` layer by layer, without the ``(N, O, K)`` Jacobian, when
        every block is an ``nn.Linear``'s or ``nn.Conv2d``'s weight, bias or ``[W | b]``: with
        ``a_n`` a Linear layer's input and ``B_n = ∂f/∂z`` ``(O, out)`` (``O`` batched backward
        passes), ``J_W = B_n ⊗ a_nᵀ`` and

            ``J_W Σ_W J_Wᵀ = (B_n Q_G) diag(v_n) (B_n Q_G)ᵀ``,  ``v_n = (1/m) (Q_Aᵀ a_n)²``

        (``O(n (O out² + in² + in·out))`` per layer); a Conv2d's rotated Jacobian
        ``J̃ = Σ_r (B_{n,r} Q_G) ⊗ (Q_Aᵀ a_{n,r})ᵀ`` over its ``R`` locations (patches ``a_{n,r}``)
        is formed per layer in row blocks. Other networks (BatchNorm and other diagonal blocks,
        a last layer given by its features) take the contract's route through the subspace's
        blocks."""
        net = model.flat.net
        layers = self._linear_layers(net)
        if layers is None or isinstance(model.subspace, LastLayerSubspace):
            return super().linearized_outputs(model, x, w, chunk_size, diagonal)
        flat = model.flat
        w0 = flat.vector().detach().clone()
        eig = self._prior_eigenvalues()
        means, covs = [], []
        try:
            flat.load_vector(w.detach().to(w0))
            with eval_mode(net):
                chunk_size = _rows_per_pass(net, layers, x, chunk_size)
                for start in range(0, batching.rows(x), chunk_size):
                    out = _layer_outputs(net, layers, batching.take(x, slice(start, start + chunk_size)), self, eig, diagonal)
                    if out is None:  # a layer saw inputs of another shape: the general route
                        return super().linearized_outputs(model, x, w, chunk_size, diagonal)
                    means.append(out[0]), covs.append(out[1])
        finally:
            flat.load_vector(w0)
        return torch.cat(means), torch.cat(covs)

    def _linear_layers(self, net: torch.nn.Module):
        """``{module name: (module, [(block index, role)])}`` with role ``"weight"``,
        ``"bias"``, ``"augmented"`` or ``"diag"`` (and its parameters' names), or ``None``
        when some block is neither a Linear/Conv2d's Kronecker block nor a diagonal block of a
        module's own parameters."""
        if not self._owners or len(self._owners) != len(self._blocks):
            return None
        modules = dict(net.named_modules())
        layers: dict[str, tuple] = {}
        for i, ((name, params), block) in enumerate(zip(self._owners, self.blocks())):
            module = modules.get(name)
            conv = isinstance(module, torch.nn.Conv2d) and module.groups == 1
            kron = isinstance(module, torch.nn.Linear) or conv
            if module is None or ("diag" in block) == kron:  # a K-FAC layer's diagonal: shared
                return None
            leaves = tuple(p.rsplit(".", 1)[-1] for p in params)
            if "diag" in block:  # BatchNorm, LayerNorm, ...: per-sample Jacobians of its own
                own = dict(module.named_parameters(recurse=False))
                if not all(leaf in own for leaf in leaves):
                    return None
                layers.setdefault(name, (module, []))[1].append((i, "diag", leaves))
                continue
            role = {("weight",): "weight", ("bias",): "bias", ("weight", "bias"): "augmented"}
            if leaves not in role:
                return None
            layers.setdefault(name, (module, []))[1].append((i, role[leaves], leaves))
        return layers

    # ------------------------------------------------------------------ the MAP search

    def newton_step(self, evaluator, t: torch.Tensor, grad: torch.Tensor, prior: PriorPrecision):
        """``Σ_t ∇`` with the K-FAC posterior at ``t`` (no dense ``PᵀGP``)."""
        other = copy.deepcopy(self)
        other.fit_curvature(evaluator, t)
        other.set_prior(prior.diagonalised())
        return other._apply_power(grad, -1.0).to(grad)

    def newton_decrement(self, grad: torch.Tensor) -> float:
        g = grad.double()
        return float((g * self._apply_power(g, -1.0)).sum().clamp_min(0).sqrt())


def _layer_outputs(net, layers, x, post: KronPosterior, eig, diagonal: bool):
    """``f`` ``(n, O)`` and ``J Σ Jᵀ`` ``(n, O, O)`` float64 of one chunk (`linearized_outputs`),
    or ``None`` if a layer was not called once on inputs of the chunk's ``n`` rows (``(n, in)``,
    ``(n, C, H, W)``) giving ``n`` rows."""
    seen: dict[str, list] = {name: [] for name in layers}

    def hook(name):
        def keep(module, inp, out):
            z = out if out.requires_grad else out.detach().requires_grad_(True)
            seen[name].append((inp[0].detach(), z))
            return z.clone()  # later in-place ops do not rebase z

        return keep

    handles = [m.register_forward_hook(hook(name)) for name, (m, _) in layers.items()]
    try:
        with torch.enable_grad():
            f = batching.call(net, x)
    finally:
        for h in handles:
            h.remove()
    n = batching.rows(x)
    dims = {
        name: 4 if isinstance(m, torch.nn.Conv2d) else 2 if isinstance(m, torch.nn.Linear) else None
        for name, (m, _) in layers.items()
    }
    if f.dim() != 2 or f.shape[0] != n or any(
        len(v) != 1
        or (dims[k] is not None and v[0][0].dim() != dims[k])
        or v[0][0].shape[0] != n
        or v[0][1].shape[0] != n
        for k, v in seen.items()
    ):  # a layer called twice, or seeing another number of rows than points (a reshaped batch)
        return None
    o = f.shape[1]
    zs = [seen[name][0][1] for name in layers]
    eye = torch.eye(o, dtype=f.dtype, device=f.device)[:, None, :].expand(o, n, o)
    try:  # B = ∂f/∂z for every layer: O backward passes in one batched call
        grads = torch.autograd.grad(f, zs, grad_outputs=eye, is_grads_batched=True)
    except RuntimeError:  # an op without a batching rule: one pass per output
        rows = [torch.autograd.grad(f, zs, eye[c], retain_graph=True) for c in range(o)]
        grads = [torch.stack([r[i] for r in rows]) for i in range(len(zs))]
    blocks = post.blocks()
    cov = torch.zeros((n, o) if diagonal else (n, o, o), dtype=torch.float64, device=f.device)
    for (name, (module, roles)), grad in zip(layers.items(), grads):
        if roles[0][1] == "diag":
            if not _diagonal_blocks(module, grad, seen[name][0][0], roles, blocks, eig, cov, diagonal):
                return None
            continue
        if isinstance(module, torch.nn.Conv2d):
            _conv_layer(module, grad, seen[name][0][0], roles, blocks, eig, cov, diagonal)
            continue
        b = grad.permute(1, 0, 2).double()  # (n, O, out)
        a = seen[name][0][0].double()  # (n, in)
        for i, role, _ in roles:
            block, m = blocks[i], eig[i]
            bq = b @ block["gvecs"]  # (n, O, out) in G's eigenbasis
            if role == "bias":
                v = m[:, 0].reciprocal().expand(n, -1)
            else:
                ai = torch.cat([a, a.new_ones(n, 1)], 1) if role == "augmented" else a
                v = (ai @ block["avecs"]).square() @ m.reciprocal().T  # (n, out)
            if diagonal:
                cov += torch.einsum("nok,nk->no", bq.square(), v)
            else:
                cov += torch.einsum("nok,nk,npk->nop", bq, v, bq)
    return f.detach().double(), cov


#: the most numbers of one pass's output Jacobians ``∂f/∂z`` ``(O, rows, *z)`` over the layers
#: (16 MiB in float64): `linearized_outputs` takes fewer rows per pass where they are large
PASS_NUMBERS = 2**21


def _rows_per_pass(net, layers, x: torch.Tensor, chunk: int) -> int:
    """``chunk``, or fewer rows so that the ``O`` output Jacobians at the layers' outputs hold
    at most `PASS_NUMBERS` numbers (their sizes from a forward pass of one row)."""
    if batching.rows(x) == 0:
        return chunk
    sizes = []
    handles = [
        m.register_forward_hook(lambda mod, inp, out: sizes.append(out.numel()))
        for m, _ in layers.values()
    ]
    try:
        with torch.no_grad():
            f = batching.call(net, batching.take(x, slice(0, 1)))
    finally:
        for h in handles:
            h.remove()
    per_row = max(1, f[0].numel() * sum(sizes))
    return max(1, min(chunk, PASS_NUMBERS // per_row))


#: the most numbers of a Conv2d's rotated Jacobian block ``(rows, O, out, in·kh·kw)`` at once (8 MiB in float64)
CONV_BLOCK_NUMBERS = 2**20


def _conv_layer(module, grad, inp, roles, blocks, eig, cov, diagonal: bool) -> None:
    """Add a Conv2d's blocks to ``cov`` ``(n, O, O)``: ``grad`` ``(O, n, out, H', W')`` is
    ``∂f/∂z``, ``inp`` ``(n, in, H, W)`` the layer's input. The rotated Jacobian is formed in
    the network's dtype (a float32 network's rounding, about 1e-7 relative), its squares summed
    into float64."""
    o, n, out = grad.shape[:3]
    dt = grad.dtype if grad.dtype in (torch.float32, torch.float64) else torch.float64
    b = grad.reshape(o, n, out, -1).permute(1, 0, 2, 3).to(dt)  # (n, O, out, R)
    patches = conv_patches(module, inp).to(dt)  # (n, in', R)
    for i, role, _ in roles:
        block, m = blocks[i], eig[i]
        inv = m.reciprocal()
        if role == "bias":  # J_b = Σ_r B_r: a Kronecker block with A = [1]
            bq = b.sum(-1).double() @ block["gvecs"]  # (n, O, out)
            v = inv[:, 0]
            if diagonal:
                cov += bq.square() @ v
            else:
                cov += torch.einsum("nok,k,npk->nop", bq, v, bq)
            continue
        a = patches
        if role == "augmented":
            a = torch.cat([a, a.new_ones(n, 1, a.shape[-1])], 1)
        # rows per block: the rotated Jacobian (rows, O, out, in') and B Q_G (rows, O, out, R)
        width = max(1, CONV_BLOCK_NUMBERS // max(1, o * max(inv.numel(), out * b.shape[-1])))
        qg, qa, inv_dt = block["gvecs"].to(dt), block["avecs"].to(dt), inv.to(dt)
        for s in range(0, n, width):
            bq = torch.einsum("nokr,ka->noar", b[s : s + width], qg)
            aq = torch.einsum("nir,il->nrl", a[s : s + width], qa)
            jt = torch.einsum("noar,nrl->noal", bq, aq)  # J (Q_G ⊗ Q_A): (rows, O, out, in')
            if diagonal:
                cov[s : s + width] += (jt.square().flatten(2) @ inv_dt.reshape(-1)).double()
            else:
                w = (jt * inv_dt).flatten(2)
                cov[s : s + width] += (w @ jt.flatten(2).mT).double()


def _diagonal_blocks(module, grad, inp, roles, blocks, eig, cov, diagonal: bool) -> bool:
    """Add a module's diagonal blocks to ``cov``: per sample ``J = B ∂z/∂θ`` for its own
    parameters ``θ`` (``torch.func``: ``vjp`` of the module at each input, ``vmap`` over the
    ``O`` rows of ``B = ∂f/∂z`` and the samples), then ``J diag(1/m) Jᵀ``. ``False`` when the
    module does not map one sample to one output this way (the caller then takes the general
    route)."""
    from torch.func import functional_call, vjp, vmap

    params = {k: v.detach() for k, v in module.named_parameters(recurse=False)}
    b = grad.transpose(0, 1)  # (n, O, *z)

    def per_sample(xi, bi):
        _, pull = vjp(lambda p: functional_call(module, p, (xi[None],))[0], params)
        return vmap(pull)(bi)[0]

    try:
        jac = vmap(per_sample)(inp, b)  # name -> (n, O, *shape)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    for i, _, leaves in roles:
        j = torch.cat([jac[leaf].flatten(2) for leaf in leaves], 2).double()  # (n, O, numel)
        inv = eig[i].reciprocal()
        if diagonal:
            cov += j.square() @ inv
        else:
            cov += torch.einsum("nok,k,npk->nop", j, inv, j)
    return True


def _eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of a K-FAC factor (eigenvalues clamped at 0), overwriting ``m`` (the caller's
    own copy: `linalg.eigh_`)."""
    values, vectors = eigh_(m)
    return values.clamp_min(0), vectors


def _basis(sub) -> torch.Tensor:
    basis = getattr(sub, "basis", None)
    if basis is None or basis.dtype not in (torch.int64, torch.int32) or basis.dim() != 1:
        raise ValueError(
            f"hessian_structure: 'kron' needs a subset of weights (an index subspace), not a "
            f"{type(sub).__name__}; use hessian_structure='full', 'diag' or 'lowrank'"
        )
    return basis.long()


def _owning_modules(net: torch.nn.Module, basis: torch.Tensor) -> list[str]:
    """The names of the modules whose own parameters hold any of the flat indices ``basis``."""
    params = [p for _, p in flat_parameters(net)]
    hit = torch.zeros(sum(p.numel() for p in params), dtype=torch.bool)
    hit[basis.cpu()] = True
    owners, at = [], 0
    seen: dict[int, str] = {}
    for name, module in net.named_modules():
        for p in module.parameters(recurse=False):
            seen.setdefault(id(p), name)
    for p in params:
        if bool(hit[at : at + p.numel()].any()) and seen[id(p)] not in owners:
            owners.append(seen[id(p)])
        at += p.numel()
    return owners


def _columns(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
    """The feature columns ``j`` ``(in,)`` with ``rows[:, j] == pos[:, i]`` for every column
    ``i`` of ``pos`` ``(C, in)``, or ``None`` when the block is not laid out as a last layer's
    (each of ``pos``'s first row found in ``rows``' first by a binary search, then one
    ``(C, in)`` comparison: no ``(K,)`` maps)."""
    c, p = rows.shape
    if pos.shape[0] != c or pos.numel() == 0:
        return None
    first = rows[0]
    order = torch.argsort(first)
    at = torch.searchsorted(first[order], pos[0]).clamp_max_(p - 1)
    cols = order[at]
    if not torch.equal(first[cols], pos[0]):
        return None
    return cols if torch.equal(rows[:, cols], pos) else None
