"""The top eigenvectors of the GGN at the MAP as a subspace: the basis of a low-rank Laplace.

Subspace Inference, appendix E, finds the eigenstructure of the Hessian/GGN with Lanczos
(GPyTorch); Subnetwork Inference discusses the low-rank Laplace as the alternative to a
subnetwork. Here ``G = Σ_n J_nᵀ H_n J_n`` is only ever applied to vectors
(`curvature.ggn_vector_product`), so memory is that of a few network passes.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _checks as ck
from ..curvature import block_lanczos_eigh, ggn_matrix_product, ggn_vector_product, lanczos_eigh
from ..flat import FlatNet
from ..likelihoods import Likelihood, check_likelihood
from ..threads import thread_policy
from .base import Subspace


@thread_policy
def ggn_eigen(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    rank: int,
    *,
    w: torch.Tensor | None = None,
    num_iter: int | None = None,
    chunk_size: int = 1024,
    seed: int = 0,
    block_size: int = 1,
    tol: float | None = None,
) -> Subspace:
    """The ``rank`` leading GGN eigenvectors at ``w`` as a dense, orthonormal `Subspace`.

    ``G u_k = γ_k u_k`` with ``γ_1 >= … >= γ_K`` by Lanczos (`curvature.lanczos_eigh`, float64
    Lanczos vectors, full reorthogonalisation); the subspace is ``w = ŵ + U t`` with
    ``U = [u_1 … u_K]`` of shape ``(D, K)`` and ``UᵀU = I``. Under the isotropic prior
    ``N(0, λ⁻¹ I)`` the Laplace posterior precision in this subspace is ``diag(γ)/T + λ I``
    (`infer.AutoSubspaceLaplace`), and the directions left out keep precision ``λ``.

    Args:
        net: the network (at its MAP); evaluated in eval mode.
        likelihood: `Gaussian`, `Categorical` or `Bernoulli`.
        x: training inputs, shape ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)``
            (the GGN does not depend on the targets). Under ``torch.distributed``, the rank's
            shard: each product is all-reduced, every rank runs the same Lanczos.
        rank: ``K``, the number of eigenvectors, ``1 <= K <= D``.
        w: flat weights ``(D,)`` (the shift ``ŵ``); default the network's current weights.
        num_iter: Lanczos iterations (GGN-vector products); default ``max(2K + 20, 3K)``.
        chunk_size: rows per ``jvp``/``vjp`` pass.
        seed: seed of Lanczos' random start vector.
        block_size: ``1``: single-vector Lanczos (`curvature.lanczos_eigh`), ``num_iter``
            products. ``b > 1``: block Lanczos (`curvature.block_lanczos_eigh`) on
            `curvature.ggn_matrix_product`, ``b`` GGN-vector products per batched pass (each
            about 3x cheaper per vector than one at a time), stopping at ``tol``;
            ``num_iter`` is then a budget, default ``D``.
        tol: stop when every Ritz pair has ``‖G u − γ u‖ <= tol · |γ|`` (ARPACK's test);
            ``None``: use ``num_iter``. With ``block_size = 1`` a ``tol`` runs
            `curvature.block_lanczos_eigh` on blocks of one vector (one ``jvp`` + ``vjp`` pass
            each, no ``vmap``) with ``num_iter`` (default ``max(2K + 20, 3K)``) as the cap, so
            it can only save products: on the 309k-weight ResNet of ``benchmarks/scale.py``
            ``tol = 1e-2`` stopped after 46 of 60 (eigenvalues within 5e-4). On convolutional
            nets on CPU the batched products of ``block_size > 1`` measured 1.5x SLOWER per
            vector than single ones (functorch's conv rules for batched weight tangents).

    Returns:
        A `Subspace` with ``shift = ŵ`` ``(D,)`` and ``basis = U`` ``(D, K)`` in ``ŵ``'s dtype,
        carrying the eigenvalues ``γ`` ``(K,)`` (descending) as the buffer ``eigenvalues``.
    """
    check_likelihood(likelihood)
    ck.positive_int(num_iter, "num_iter", allow_none=True)
    ck.positive_int(chunk_size, "chunk_size")
    ck.check_int(seed, "seed", minimum=0)
    ck.check_data(net, x, dtype=None if w is None else getattr(w, "dtype", None))
    flat = FlatNet(net)
    if w is None:
        w = flat.vector()
    flat.check_weights(w, "w", batched=False)
    d = flat.num_weights
    ck.check_int(rank, "rank", 1, d)
    w = w.detach()

    def matvec(v: torch.Tensor) -> torch.Tensor:
        return ggn_vector_product(net, likelihood, x, v.to(w), w=w, chunk_size=chunk_size)

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if block_size == 1 and tol is None:
        values, vectors = lanczos_eigh(
            matvec, d, rank, num_iter=num_iter, dtype=torch.float64, device=w.device, seed=seed
        )
    elif block_size == 1:  # single-vector products, stopping at tol within the usual budget
        budget = min(d, max(2 * rank + 20, 3 * rank)) if num_iter is None else num_iter
        values, vectors, _ = block_lanczos_eigh(
            lambda v: matvec(v[:, 0])[:, None], d, rank, 1, budget, tol,
            torch.float64, w.device, seed,
        )  # fmt: skip
    else:

        def matmat(v: torch.Tensor) -> torch.Tensor:
            return ggn_matrix_product(net, likelihood, x, v.to(w), w=w, chunk_size=chunk_size)

        values, vectors, _ = block_lanczos_eigh(
            matmat, d, rank, min(block_size, d), d if num_iter is None else num_iter, tol,
            torch.float64, w.device, seed,
        )
    sub = Subspace(w.clone(), vectors.to(w.dtype))
    sub.register_buffer("eigenvalues", values.clamp_min(0).to(w.dtype))
    return sub
