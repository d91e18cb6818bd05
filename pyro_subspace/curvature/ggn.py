"""The generalised Gauss-Newton (GGN) matrix of a network, without ever forming it.

Subnetwork Inference (Daxberger et al., 2021), eq. (9): ``G = Σ_n J_nᵀ H_n J_n`` with the
Jacobian ``J_n = ∂f(x_n, w)/∂w`` of shape ``(O, D)`` and the output Hessian
``H_n = −∂² log p(y_n | f)/∂f²`` of shape ``(O, O)``; eq. (15) restricts it to a subnetwork,
``Pᵀ G P``. No prior precision ``λ`` and no temperature are added here: callers add them.

``torch.func`` does the differentiation: ``jvp``/``vjp`` for ``G v``, ``vmap`` over ``jvp`` for
``J P``, and ``vmap`` over data points of ``jacrev`` for per-sample Jacobians. The data are
processed in chunks of rows, so memory never depends on ``N``. Networks run in eval mode.

``x`` may be a tensor, a ``Dataset`` or a ``DataLoader`` (`data.DataSource`: read in chunks);
under ``torch.distributed`` it is the rank's shard and the sums are all-reduced
(`distributed`). Modules whose kernels lack forward-mode derivatives (LSTM, fused transformer
layers) fall back automatically to reverse-over-reverse products (`autodiff`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from functools import partial

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import vjp, vmap

from .. import batch as batching
from .. import distributed
from .autodiff import jvp_any, jvps, strategy_of
from ..data import DataSource
from ..flat import FlatNet, eval_mode
from .gram import gram_from_blocks
from .jacobians import (
    as_2d,
    factored_square_sums,
    full_jacobian_blocks,
    weighted,
)
from ..likelihoods import Likelihood, check_likelihood
from ..validation import check_finite_state, positive_int
from .blocks import JacobianBlockSource
from .output_hessian import hessian_factor, output_hessian

#: Networks on which the one-pass dual-number product failed (they use jvp, then vjp).
_NO_DUAL: weakref.WeakSet = weakref.WeakSet()


def _setup(
    net: nn.Module, likelihood: object, x: object, w: torch.Tensor | None, chunk_size: object
) -> tuple[FlatNet, torch.Tensor]:
    """Validate the common arguments; return the flat view and the weights ``(D,)``."""
    flat = FlatNet(net, batch_strategy="loop")
    if likelihood is not None:
        check_likelihood(likelihood)
    if batching.is_mapping(x):
        DataSource(x)  # a mapping of tensors: checked as one (rows, NaN)
    elif not isinstance(x, torch.Tensor):
        DataSource(x)  # a Dataset or DataLoader, else a TypeError naming x
    elif x.dim() == 0 or batching.rows(x) == 0:
        raise ValueError(f"x: expected at least one input row, got shape {tuple(x.shape)}")
    elif x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError("x: contains NaN or inf")
    positive_int(chunk_size, "chunk_size", allow_none=True)
    if w is not None:
        flat.check_weights(w, "w", batched=False)
    check_finite_state(net, w)  # NaN weights would surface as non-finite outputs after a pass
    return (flat, flat.vector()) if w is None else (flat, w.detach())


def _inputs(x: object, chunk_size: int | None) -> Iterator[torch.Tensor]:
    """The inputs themselves (a tensor or a mapping: the callers chunk them), or the chunks of
    a Dataset/DataLoader."""
    if isinstance(x, torch.Tensor) or batching.is_mapping(x):
        yield batching.check(x)
    else:
        yield from DataSource(x, None, chunk_size or 1024).inputs()


def ggn_vector_product(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """``G v = Σ_n J_nᵀ H_n J_n v`` (eq. 9 without ``λ``), forward then reverse mode; no Jacobian.

    Per chunk ONE forward pass with dual-number weights gives the outputs and ``J v`` together
    (forward-mode AD, with the autograd graph recorded), then one backward pass ``Jᵀ(H J v)``;
    networks whose kernels lack forward derivatives use the `autodiff.jvps` fallbacks and a
    separate ``vjp``. For many products at the same ``w`` use `GGNOperator` (graphs kept).

    Args:
        net: the network; evaluated in eval mode at ``w``.
        likelihood: `Gaussian`, `Categorical` or `Bernoulli` (see `output_hessian`).
        x: inputs, shape ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)``.
        v: the vector, shape ``(D,)``; cast to ``w``'s dtype and device.
        w: flat weights ``(D,)``; default the network's current weights.
        chunk_size: rows per ``jvp``/``vjp`` pair; memory is that of two passes on a chunk.

    Returns:
        ``G v``, shape ``(D,)``, detached, in ``w``'s dtype.
    """
    flat, w = _setup(net, likelihood, x, w, chunk_size)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        raise TypeError(f"v: expected a floating-point tensor ({w.numel()},), got {v!r}")
    if tuple(v.shape) != (w.numel(),):
        raise ValueError(f"v: expected shape ({w.numel()},), got {tuple(v.shape)}")
    if not torch.isfinite(v).all():
        raise ValueError("v: contains NaN or inf")
    v = v.detach().to(w)
    total = torch.zeros_like(w)
    with eval_mode(net):
        for xc in (c for xs in _inputs(x, chunk_size) for c in batching.split(xs, chunk_size)):

            def f(wv: torch.Tensor, xc: torch.Tensor = xc) -> torch.Tensor:
                return flat(wv, xc)

            if net not in _NO_DUAL and strategy_of(net) in (None, "forward"):
                try:
                    total += _dual_product(f, w, v, likelihood)
                    continue
                except (RuntimeError, NotImplementedError):  # a kernel without forward AD
                    _NO_DUAL.add(net)
            out, jv = jvp_any(net, f, w, v)
            out2 = as_2d(out)
            hjv = torch.einsum(
                "nop,np->no", output_hessian(likelihood, out2), jv.reshape(out2.shape)
            )
            _, pullback = vjp(f, w)
            total += pullback(hjv.reshape(out.shape))[0]
    return distributed.all_reduce_sum(total.detach())


def _dual_product(f, w: torch.Tensor, v: torch.Tensor, likelihood: Likelihood) -> torch.Tensor:
    """``J_cᵀ H_c J_c v`` on one chunk from ONE forward pass: the weights are a forward-mode
    dual number ``w + ε v`` that also requires grad, so the pass yields the outputs (with the
    autograd graph recorded) and ``J v`` together; one backward pass then gives ``Jᵀ (H J v)``.
    The primal is computed once, not once for ``jvp`` and again for ``vjp``."""
    with torch.enable_grad():
        wg = w.detach().requires_grad_(True)
        with fwAD.dual_level():
            out, jv = fwAD.unpack_dual(f(fwAD.make_dual(wg, v)))
        if jv is None:  # the outputs do not depend on the weights
            return torch.zeros_like(w)
        out2 = as_2d(out.detach())
        hjv = torch.einsum(
            "nop,np->no", output_hessian(likelihood, out2), jv.detach().reshape(out2.shape)
        )
        return torch.autograd.grad(out, wg, hjv.reshape(out.shape))[0]


def ggn_matrix_product(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """``G V`` for a block of ``b`` vectors at once, ``V`` ``(D, b)`` (eq. 9 without ``λ``).

    Column ``j`` equals ``ggn_vector_product(net, likelihood, x, V[:, j])``, but each chunk of
    rows takes ONE batched pass: ``vmap`` over the ``b`` tangents of ``jvp`` (``J V``), the output
    Hessians applied, and ``vmap`` over the ``b`` cotangents of one ``vjp`` pullback
    (``Jᵀ H J V``). Memory is that of ``b`` passes on a chunk. For `block_lanczos_eigh`.

    Args:
        net, likelihood, x, w, chunk_size: as in `ggn_vector_product`.
        v: the block, shape ``(D, b)``; cast to ``w``'s dtype and device.

    Returns:
        ``G V``, shape ``(D, b)``, detached, in ``w``'s dtype.
    """
    flat, w = _setup(net, likelihood, x, w, chunk_size)
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        raise TypeError(f"v: expected a floating-point tensor ({w.numel()}, b), got {v!r}")
    if v.dim() != 2 or v.shape[0] != w.numel() or v.shape[1] < 1:
        raise ValueError(f"v: expected shape ({w.numel()}, b) with b >= 1, got {tuple(v.shape)}")
    if not torch.isfinite(v).all():
        raise ValueError("v: contains NaN or inf")
    if v.shape[1] == 1:  # one vector: the unbatched product is cheaper than vmap over one
        return ggn_vector_product(net, likelihood, x, v[:, 0], w, chunk_size)[:, None]
    tangents = v.detach().to(w).T.contiguous()  # (b, D)
    total = torch.zeros_like(tangents)
    with eval_mode(net):
        for xc in (c for xs in _inputs(x, chunk_size) for c in batching.split(xs, chunk_size)):

            def f(wv: torch.Tensor, xc: torch.Tensor = xc) -> torch.Tensor:
                return flat(wv, xc)

            out, pullback = vjp(f, w)
            jv = jvps(net, f, w, tangents)[1]  # (b, n, ...): forward AD, else a fallback
            out2 = as_2d(out)
            hjv = torch.einsum(
                "nop,bnp->bno", output_hessian(likelihood, out2), jv.reshape(-1, *out2.shape)
            ).reshape(jv.shape)
            try:
                total += vmap(lambda c: pullback(c)[0])(hjv)
            except (RuntimeError, NotImplementedError):  # no batching rule (e.g. fused RNNs)
                total += torch.stack([pullback(c)[0] for c in hjv])
    return distributed.all_reduce_sum(total.T.detach())  # summed over ranks' shards


def ggn_in_subspace(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    subspace: JacobianBlockSource,
    chunk_size: int = 1024,
    *,
    w: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Pᵀ G P = Σ_n (J_n P)ᵀ H_n (J_n P)``: the GGN in a subspace (eq. 15 without ``λ_S``).

    Accumulated as ``Σ_n A_nᵀ A_n`` with ``A_n = L_nᵀ J_n P`` (``H_n = L_n L_nᵀ``), so the
    result is symmetric positive semi-definite by construction.

    The blocks ``L_nᵀ J_n P`` come from `subspace_jacobians`: ``K`` forward-mode passes per
    chunk for a dense basis; for an index basis (a subnetwork) the selected columns of Linear
    layers from one backward pass seeded with ``L_n`` (others: per-sample Jacobians through only
    the parameter tensors that hold them). ``Σ AᵀA`` is one matrix multiply per block. The full
    ``(N·O, D)`` Jacobian and the dense ``(D, K)`` basis of a subnetwork are never formed.

    Args:
        net, likelihood, x: as in `ggn_vector_product`.
        subspace: a `Subspace` of this network (``subspace.dim == D``); its shift is not used.
        chunk_size: rows per block.
        w: flat weights ``(D,)`` at which ``J`` and ``H`` are evaluated; default the network's
            current weights.

    Returns:
        Shape ``(K, K)``, in ``w``'s dtype.
    """
    flat, w = _setup(net, likelihood, x, w, chunk_size)
    _check_subspace(subspace, w)
    factor, total = partial(hessian_factor, likelihood), None
    for xs in _inputs(x, chunk_size):
        total = subspace.ggn_sum(flat, xs, w, chunk_size, factor, False, total)
    total = distributed.all_reduce_sum(total)
    return ((total + total.T) / 2).detach()


def ggn_from_blocks(
    likelihood: Likelihood,
    blocks: Iterator[tuple[torch.Tensor, torch.Tensor]],
    diagonal: bool = False,
    total: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Accumulate ``Σ_n (L_nᵀ J_n P)ᵀ (L_nᵀ J_n P)`` (``(K, K)``, or its diagonal ``(K,)``)
    over blocks ``(outputs (n, O), J_n P (n, O, K))`` onto ``total`` (``None``: start at zero;
    returns ``None`` for no blocks). Positive semi-definite by construction."""
    return gram_from_blocks(weighted(blocks, partial(hessian_factor, likelihood)), diagonal, total)


def subspace_jacobians(
    net: nn.Module,
    x: torch.Tensor,
    subspace: JacobianBlockSource,
    chunk_size: int | None = 1024,
    *,
    w: torch.Tensor | None = None,
    factor=None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Blocks of outputs and subspace Jacobians ``J_n P``, never the full ``(N·O, D)`` Jacobian.

    The subspace's kind produces them (`Subspace.jacobian_blocks`):

    - dense basis: ``J_c P`` for a chunk of rows by ``vmap`` over the ``K`` basis columns of
      ``jvp``: memory ``chunk_size·K·(O + activations)``;
    - index basis (a subnetwork): for weights of ``nn.Linear`` layers, only the selected
      columns, as products of the back-propagated output gradient at the layer's output and
      its input (one forward and one backward pass batched over the ``O`` outputs); for any
      other weights, per-sample Jacobians (``vmap`` of ``jacrev``) with respect to only the
      parameter tensors that hold them (``D_t`` numbers), then indexed: blocks of at most
      ``min(chunk_size, MAX_JACOBIAN_NUMBERS // (O·(K + D_t)))`` rows;
    - last layer: from the penultimate features in one forward pass, no differentiation.

    Args:
        net: the network; evaluated in eval mode at ``w``.
        x: inputs, shape ``(N, ...)``.
        subspace: a `Subspace` of this network (``subspace.dim == D``); its shift is not used.
        chunk_size: rows per block (``None``: as many as the memory budget allows).
        w: flat weights ``(D,)``; default the network's current weights.
        factor: optional ``outputs (n, O) -> L (n, O, C)``; the blocks then hold ``L_nᵀ J_n P``
            ``(n, C, K)`` (with the output-Hessian factor: the rows of the GGN's ``A``).

    Yields:
        ``(outputs, jp)`` per block of ``n`` rows: ``outputs`` ``(n, O)`` at ``w`` and
        ``jp = ∂f/∂w · P`` of shape ``(n, O, K)``, both detached, in ``w``'s dtype.
    """
    flat, w = _setup(net, None, x, w, chunk_size)
    _check_subspace(subspace, w)
    return subspace.jacobian_blocks(flat, x, w, chunk_size, factor)


def _check_subspace(subspace: object, w: torch.Tensor) -> None:
    if not isinstance(subspace, JacobianBlockSource):
        raise TypeError(f"subspace: expected a Subspace, got {type(subspace).__name__}")
    if subspace.dim != w.numel():
        raise ValueError(f"subspace: has D={subspace.dim}, the network has {w.numel()} weights")


def full_jacobians(
    net: nn.Module, x: torch.Tensor, chunk_size: int | None = None, *, w: torch.Tensor | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Blocks of outputs ``(n, O)`` and per-sample Jacobians ``∂f(x_n)/∂w`` ``(n, O, D)``.

    Rows per block: at most ``chunk_size`` and ``MAX_JACOBIAN_NUMBERS // (O·D)``; ``vmap`` over
    data points of ``jacrev``. For the diagonal of the GGN and the isotropic remainder of a
    low-rank Laplace; memory about twice one block.
    """
    flat, w = _setup(net, None, x, w, chunk_size)
    return full_jacobian_blocks(flat, x, chunk_size, w)


def ggn_diagonal(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    chunk_size: int | None = None,
    *,
    w: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact diagonal of the GGN, ``diag(G)_d = Σ_n Σ_{o,o'} J_{n,o,d} H_{n,o,o'} J_{n,o',d}``.

    Computed as ``Σ_n Σ_c (L_nᵀ J_n)_{c,d}²`` from the factor ``H_n = L_n L_nᵀ`` (see
    `output_hessian`; Categorical uses a rank-``(C−1)`` factor), so every entry is ``>= 0``.
    The per-sample rows ``L_nᵀ J_n`` ``(rows, C, D)`` come from ``vmap`` over data points of
    ``jacrev`` of ``L_nᵀ f(x_n, w)``, one parameter tensor at a time
    (`jacobians.factored_square_sums`); memory is about twice ``rows·C·D`` numbers. Used by
    the diagonal Laplace selection of Subnetwork Inference (section 5).

    Args:
        net, likelihood, x: as in `ggn_vector_product`.
        chunk_size: rows per block; ``None`` picks the largest with
            ``rows·C·D <= jacobians.SQUARE_SUM_NUMBERS`` (8M numbers).
        w: flat weights ``(D,)``; default the network's current weights.

    Returns:
        Shape ``(D,)``, in ``w``'s dtype.
    """
    flat, w = _setup(net, likelihood, x, w, chunk_size)
    diag = torch.zeros_like(w)
    for xs in _inputs(x, chunk_size):
        diag += factored_square_sums(flat, xs, w, partial(hessian_factor, likelihood), chunk_size)
    return distributed.all_reduce_sum(diag.detach())
