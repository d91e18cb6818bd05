"""The top eigenvectors of K-FAC's GGN as a subspace: a curvature subspace at the cost of a
K-FAC pass (a few epochs), stored as Kronecker factors.

K-FAC (Martens & Grosse 2015; `curvature.kfac`) approximates a layer's GGN block by
``G ⊗ A`` (``G`` ``(q, q)`` on the layer's outputs, ``A`` ``(p, p)`` on its inputs, row-major
``vec W``). With ``G = Σ_i μ_i v_i v_iᵀ`` and ``A = Σ_j λ_j u_j u_jᵀ`` the block's eigenpairs are
``(μ_i λ_j, v_i ⊗ u_j)``; a bias block ``G`` alone has ``(μ_i, v_i)`` and an exact-diagonal
block (BatchNorm, ...) ``(d_m, e_m)``. The ``K`` largest of all of them, across layers, span the
subspace. EK-FAC (George et al. 2018, eq. 9) re-estimates the eigenvalue of each chosen
direction ``p_k = v_i ⊗ u_j`` as the second moment of the per-example gradients projected onto
it; for the GGN (the type-2 Fisher) that is ``s_k = Σ_n Σ_c (p_kᵀ J_nᵀ L_{n,c})² = p_kᵀ G p_k``
with ``L_n L_nᵀ = H_n`` (curvlinops' ``EKFACLinearOperator(fisher_type="type-2")``'s corrected
eigenvalue of the same direction): the exact GGN's Rayleigh quotient.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import batch as batches
from .. import validation as ck
from ..curvature import kfac
from ..curvature.kfac import BIASES, CONVS, FISHERS
from ..data import DataSource
from ..flat import FlatNet, eval_mode, preserved
from ..likelihoods import Likelihood, check_likelihood
from ..threads import thread_policy
from ..validation import check_finite_state
from .ekfac import ekfac_eigenvalues
from .kronecker import KroneckerSubspace

#: ``eigenvalues`` choices: K-FAC's ``μ_i λ_j``, or EK-FAC's re-estimates ``p_kᵀ G p_k``.
EIGENVALUES = ("kfac", "ekfac")


@thread_policy
def kfac_eigen(
    net: nn.Module,
    likelihood: Likelihood,
    x: object,
    rank: int,
    *,
    w: torch.Tensor | None = None,
    eigenvalues: str = "kfac",
    conv: str = "auto",
    bias: str = "separate",
    fisher: str = "type-2",
    mc_samples: int = 1,
    candidates: int | None = None,
    chunk_size: int = 1024,
) -> KroneckerSubspace:
    """The ``rank`` leading eigenvectors of the K-FAC GGN at ``w`` as a `KroneckerSubspace`.

    One K-FAC pass (`curvature.kfac`: a forward and ``C`` backward passes per chunk), then per
    block the eigendecompositions of its factors (``torch.linalg.eigh`` in float64:
    ``G v_i = μ_i v_i``, ``A u_j = λ_j u_j``); the directions ``v_i ⊗ u_j`` with the ``K``
    largest ``μ_i λ_j`` across all blocks (a bias block's ``μ_i`` and a diagonal block's
    entries compete too) are the columns, ordered by eigenvalue. Columns are orthonormal:
    within a block ``(v_i ⊗ u_j)ᵀ(v_k ⊗ u_l) = δ_ik δ_jl``, across blocks disjoint. Compared with
    `ggn_eigen` (Lanczos on the exact GGN, tens of epochs) the directions are those of the
    block-diagonal Kronecker approximation; ``benchmarks/results/kfac_eigen.txt`` measures the
    share of the GGN's top-``K`` eigenvalue mass they capture.

    Args:
        net: the network (at its MAP); evaluated in eval mode.
        likelihood: `Gaussian`, `Categorical` or `Bernoulli`.
        x: training inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)`` (the GGN
            does not depend on the targets).
        rank: ``K``, the number of columns, ``1 <= K <= D``.
        w: flat weights ``(D,)`` (the shift ``ŵ``); default the network's current weights
            (written into the network for the K-FAC pass and put back afterwards).
        eigenvalues: ``"kfac"``: ``μ_i λ_j``; ``"ekfac"``: each chosen direction's eigenvalue
            re-estimated as ``p_kᵀ G p_k = Σ_n Σ_c (p_kᵀ J_nᵀ L_{n,c})²`` (EK-FAC, George et
            al. 2018, eq. 9) by one more pass over the data (`ekfac.ekfac_eigenvalues`: a
            forward and ``C`` backward passes per chunk, the per-example gradients projected
            onto each ``v``, ``u``; ``K`` forward-mode products where a layer's rows are not the
            data points), the columns then re-ordered by it. The directions are the same.
        conv: K-FAC's weight-sharing convention (``"expand"``, ``"reduce"``, ``"backpack"``;
            `curvature.kfac`), or ``"auto"`` (default): ``"reduce"`` when the network gives one
            output row per data point, so every shared dimension (a convolution's locations,
            a sequence's tokens) is pooled or flattened before the likelihood, the case in
            which Eschenhagen et al. (2023, sec. 3) derive K-FAC-reduce as the exact one;
            ``"expand"`` when it gives more rows than points (per-token or per-location
            outputs, expand's case). Read from one forward pass on two points. On the
            ``scale.py`` CNN of width 8 (global average pooling) the top-20 directions capture
            60.5% of the GGN's top-20 eigenvalue mass with ``"reduce"`` and 35.6% with
            ``"expand"``, whose eigenvalues there are 14 times too small (a layer's location
            gradients add up coherently through the pooling); no subspace of directions
            within single layers captures more than 63.8% (``benchmarks/results/
            kfac_eigen.txt``).
        bias: ``"separate"`` (a bias block ``G`` of its own) or ``"augment"`` (``[W | b]``).
        fisher: ``"type-2"`` (K-FAC of the GGN itself: ``C`` backward passes per chunk) or
            ``"mc"`` (``mc_samples`` sampled targets per point: ``mc_samples`` backward passes,
            the factors' expectation the GGN's; seeded by `curvature.kfac`'s ``MC_SEED``, so
            repeatable and torch's global generators untouched). EK-FAC's re-estimates are
            exact GGN moments either way.
        mc_samples: draws per data point for ``fisher="mc"`` (must be 1 for ``"type-2"``).
        candidates: with ``"ekfac"``: re-estimate the ``candidates >= rank`` directions of
            largest K-FAC eigenvalue and keep the ``rank`` of largest EK-FAC eigenvalue
            (``candidates = D``: the top of EK-FAC's whole spectrum, as George et al. rank the
            directions; the pass costs ``candidates`` forward-mode products per chunk).
            Default ``rank``: the K-FAC directions, re-estimated.
        chunk_size: rows per pass.

    Returns:
        A `KroneckerSubspace` with ``shift = ŵ`` ``(D,)``, ``K`` columns stored as factors
        (``O(K · Σ (q + p))`` numbers, never ``(D, K)``) in ``ŵ``'s dtype, carrying the
        eigenvalues ``(K,)`` (descending) as the buffer ``eigenvalues``.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
        >>> sub = kfac_eigen(net, likelihoods.Categorical(), torch.randn(50, 3), rank=4)
        >>> sub.rank, sub.kind, sub.eigenvalues.shape
        (4, 'kron', torch.Size([4]))
    """
    check_likelihood(likelihood)
    ck.choice(eigenvalues, "eigenvalues", EIGENVALUES)
    ck.choice(conv, "conv", ("auto", *CONVS))
    ck.choice(bias, "bias", BIASES)
    ck.choice(fisher, "fisher", FISHERS)
    ck.positive_int(mc_samples, "mc_samples")
    if fisher == "type-2" and mc_samples != 1:
        raise ValueError(f"mc_samples: only fisher='mc' draws samples, got {mc_samples}")
    ck.positive_int(chunk_size, "chunk_size")
    flat = FlatNet(net)
    d = flat.num_weights
    ck.check_int(rank, "rank", 1, d)
    ck.check_int(candidates, "candidates", rank, d, allow_none=True)
    if candidates is not None and eigenvalues != "ekfac":
        raise ValueError("candidates: only eigenvalues='ekfac' re-ranks candidate directions")
    if w is not None:
        flat.check_weights(w, "w", batched=False)
    check_finite_state(net, w)  # the weights, frozen parameters and buffers: before any pass
    ck.check_data(net, x, dtype=None if w is None else w.dtype)
    w = flat.vector() if w is None else w.detach()
    conv = weight_sharing(net, x) if conv == "auto" else conv

    with preserved(net, modes=False, weights=True):  # the passes read the net's own weights
        with torch.no_grad():  # in place (`FlatNet.load_vector` would alias ``w``'s storage)
            for p, part in zip(flat.params, w.split([p.numel() for p in flat.params])):
                p.copy_(part.view_as(p))
        factors = kfac(net, likelihood, x, conv=conv, bias=bias, fisher=fisher,
                       mc_samples=mc_samples, chunk_size=chunk_size, dtype=torch.float64)  # fmt: skip
        return _select(net, likelihood, x, w, factors, rank, eigenvalues, candidates, chunk_size)


def weight_sharing(net: nn.Module, x: object) -> str:
    """``conv="auto"``'s choice for ``net`` on the data ``x`` (tensors, mapping, ``Dataset`` or
    ``DataLoader``): ``"expand"`` when one forward pass on its first two points (eval mode, no
    gradient) gives more output rows than points, else ``"reduce"``."""
    xc, _ = next(iter(DataSource(x, chunk_size=2)))
    xc = batches.take(xc, slice(0, 2))
    with torch.no_grad(), eval_mode(net):
        out = batches.call(net, xc)
    return "expand" if out.shape[0] > batches.rows(xc) else "reduce"


def _select(net, likelihood, x, w, factors, rank, eigenvalues, candidates, chunk_size):
    """The top directions of the factors' Kronecker eigenbases (re-estimated for ``"ekfac"``)."""
    pool = rank if candidates is None else candidates
    values, picks = [], []  # per block: its candidate eigenvalues and how to build each
    for b, block in enumerate(factors.blocks):
        if block.kind == "diagonal":
            vals = block.diagonal
            top = torch.topk(vals, min(pool, vals.numel()))
            values.append(top.values)
            picks += [(b, None, int(m)) for m in top.indices]
            continue
        mu, vg = torch.linalg.eigh(block.G)
        if block.A is None:
            lam, ua = mu.new_ones(1), mu.new_ones(1, 1)
        else:
            lam, ua = torch.linalg.eigh(block.A)
        prod = mu.clamp_min(0)[:, None] * lam.clamp_min(0)[None, :]  # shape: (q, p)
        top = torch.topk(prod.reshape(-1), min(pool, prod.numel()))
        values.append(top.values)
        picks += [(b, (vg, ua), int(m)) for m in top.indices]
    best = torch.topk(torch.cat(values), pool)  # descending, across blocks
    chosen = [picks[int(i)] for i in best.indices]
    if eigenvalues == "kfac":
        return _subspace(w, factors, chosen, best.values.clamp_min(0))
    # EK-FAC: p_kᵀ G p_k of every candidate (the diagonal of the GGN in their span), the top kept
    sub = _subspace(w, factors, chosen, best.values.clamp_min(0))
    s = ekfac_eigenvalues(net, likelihood, x, factors, chosen, sub, chunk_size).clamp_min(0)
    order = torch.argsort(s.double(), descending=True, stable=True)[:rank].tolist()
    return _subspace(w, factors, [chosen[i] for i in order], s[order])


def _subspace(w: torch.Tensor, factors, chosen: list, values: torch.Tensor) -> KroneckerSubspace:
    """The `KroneckerSubspace` at ``w`` whose coordinate ``k`` is the direction ``chosen[k]``
    (``(block, (eigenvectors of G, of A), m)``, ``m = i·p + j`` for ``v_i ⊗ u_j``, or
    ``(block, None, m)``: the entry ``m`` of a diagonal block) with eigenvalue ``values[k]``:
    one stored block per K-FAC block with chosen columns, one per chosen diagonal entry."""
    by_block: dict[int, list[tuple[int, int]]] = {}
    eigs: dict[int, tuple] = {}
    blocks, coords = [], []
    for coord, (b, eig, m) in enumerate(chosen):
        block = factors.blocks[b]
        if eig is None:
            one = torch.ones(1, 1, dtype=torch.float64)
            blocks.append((block.index[m : m + 1], one, one))
            coords.append([coord])
        else:
            by_block.setdefault(b, []).append((coord, m))
            eigs[b] = eig
    for b, cols in by_block.items():
        vg, ua = eigs[b]
        p = ua.shape[0]
        rows = torch.tensor([m // p for _, m in cols])
        ins = torch.tensor([m % p for _, m in cols])
        blocks.append((factors.blocks[b].index, vg[:, rows], ua[:, ins]))
        coords.append([c for c, _ in cols])
    columns = torch.tensor([c for cs in coords for c in cs])
    return KroneckerSubspace(w.clone(), blocks, columns=columns, eigenvalues=values.to(w.dtype))
