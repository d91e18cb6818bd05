"""The top eigenvectors of the GGN at the MAP as a subspace: the basis of a low-rank Laplace.

Subspace Inference, appendix E, finds the eigenstructure of the Hessian/GGN with Lanczos
(GPyTorch); Subnetwork Inference discusses the low-rank Laplace as the alternative to a
subnetwork. Here ``G = Σ_n J_nᵀ H_n J_n`` is only ever applied to vectors
(`curvature.GGNOperator`: the network's graphs built once, two backward passes per product), so
memory is that of those graphs, never a ``D × D`` matrix.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import validation as ck
from ..curvature import (
    GGNOperator,
    block_lanczos_eigh,
    lanczos_eigh,
    thick_restart_lanczos_eigh,
)
from ..validation import check_finite_state
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

    ``G u_k = γ_k u_k`` with ``γ_1 >= … >= γ_K`` by Lanczos (float64 Lanczos vectors, full
    reorthogonalisation) on `curvature.GGNOperator` (for a network without convolutions its
    cached graphs, about three times the activations of a forward pass, hold at most 1 GiB of
    counted bytes, rows beyond are recomputed; convolutional nets use the stateless product,
    faster there); the subspace is ``w = ŵ + U t`` with
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
            With ``tol``: the most products (default ``D``).
        chunk_size: rows per ``jvp``/``vjp`` pass.
        seed: seed of Lanczos' random start vector.
        block_size: ``1``: single-vector Lanczos: with ``tol``, thick-restart Lanczos
            (`curvature.thick_restart_lanczos_eigh`, the fewest products: fewer than ARPACK's
            ``eigsh``, ``benchmarks/results/lanczos_vs_arpack.txt``); without, `curvature.lanczos_eigh`
            with ``num_iter`` products. ``b > 1``: block Lanczos (`curvature.block_lanczos_eigh`),
            ``b`` products per batched pass (not cheaper per vector than single products on the
            cached operator, and more products: kept for compatibility), stopping at ``tol``;
            ``num_iter`` is then a budget, default ``D``.
        tol: stop when every Ritz pair has ``‖G u − γ u‖ <= tol · |γ|`` (ARPACK's test);
            ``None``: use ``num_iter`` products. On convolutional nets on CPU the batched
            products of ``block_size > 1`` measured 1.5x SLOWER per vector than single ones
            (functorch's conv rules for batched weight tangents): keep ``block_size=1`` there.

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
    if w is not None:
        flat.check_weights(w, "w", batched=False)
    check_finite_state(net, w)  # the weights, frozen parameters and buffers: before any pass
    if w is None:
        w = flat.vector()
    d = flat.num_weights
    ck.check_int(rank, "rank", 1, d)
    w = w.detach()

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0):
        raise ValueError(f"tol: expected a float >= 0 or None, got {tol!r}")
    op = GGNOperator(net, likelihood, x, w=w, chunk_size=chunk_size)

    def matvec(v: torch.Tensor) -> torch.Tensor:
        return op.matvec(v.to(w)).to(v)

    def matmat(v: torch.Tensor) -> torch.Tensor:
        return op.matmat(v.to(w)).to(v)

    if block_size == 1 and tol is not None:
        values, vectors, _ = thick_restart_lanczos_eigh(
            matvec,
            d,
            rank,
            tol=tol,
            max_products=max(d if num_iter is None else num_iter, 1),
            dtype=torch.float64,
            device=w.device,
            seed=seed,
        )
    elif block_size == 1:
        values, vectors = lanczos_eigh(
            matvec, d, rank, num_iter=num_iter, dtype=torch.float64, device=w.device, seed=seed
        )
    else:
        values, vectors, _ = block_lanczos_eigh(
            matmat,
            d,
            rank,
            min(block_size, d),
            d if num_iter is None else num_iter,
            tol,
            torch.float64,
            w.device,
            seed,
        )
    sub = Subspace(w.clone(), vectors.to(w.dtype))
    sub.register_buffer("eigenvalues", values.clamp_min(0).to(w.dtype))
    return sub
