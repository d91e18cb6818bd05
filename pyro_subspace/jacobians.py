"""Per-sample Jacobians of a network's outputs, in memory-bounded blocks.

The primitives every curvature and predictive computation shares. ``torch.func`` does the
differentiation: ``vmap`` over data points of ``jacrev`` for per-sample Jacobians (optionally with
respect to only the parameter tensors that hold some selected weights), ``vmap`` over basis
columns of ``jvp`` for ``J P``. Networks are evaluated functionally at given flat weights; their
own parameters are never read or changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.func import functional_call, jacrev, vmap

from .autodiff import jvps, per_sample_jacobians_rowwise
from .flat import FlatNet, eval_mode

#: Budget (in numbers) for one block of per-sample Jacobians ``(rows, O, D)``: 50M numbers is
#: 200 MB in float32, 400 MB in float64.
MAX_JACOBIAN_NUMBERS = 50_000_000

Blocks = Iterator[tuple[torch.Tensor, torch.Tensor]]


def as_2d(out: torch.Tensor) -> torch.Tensor:
    """Network outputs as ``(N, O)`` (a 1-D output gets ``O = 1``)."""
    if out.dim() == 1:
        return out.unsqueeze(-1)
    if out.dim() != 2:
        raise ValueError(f"net: expected outputs of shape (N, O) or (N,), got {tuple(out.shape)}")
    return out


def restricted_call(flat: FlatNet, w: torch.Tensor, idx: torch.Tensor):
    """The net as a function of only the parameter tensors that hold the flat indices ``idx``.

    Returns ``theta`` (the concatenated touched tensors, ``(D_t,)``), the positions of ``idx`` in
    ``theta`` (``(K,)``) and ``fn(theta, x)``; the other parameters stay at ``w``.
    """
    params = flat.unflatten(w)
    starts = torch.tensor([0, *flat.numels], device=w.device).cumsum(0)
    pos = torch.full((w.numel(),), -1, dtype=torch.long, device=w.device)
    touched, offset = [], 0
    for j, name in enumerate(flat.names):
        a, b = int(starts[j]), int(starts[j + 1])
        if ((idx >= a) & (idx < b)).any():
            touched.append(j)
            pos[a:b] = torch.arange(offset, offset + b - a, device=w.device)
            offset += b - a
    theta = torch.cat([params[flat.names[j]].reshape(-1) for j in touched])
    buffers = dict(flat.net.named_buffers())

    def fn(th: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(th, [flat.numels[j] for j in touched])
        new = {flat.names[j]: p.reshape(flat.shapes[j]) for j, p in zip(touched, pieces)}
        return functional_call(flat.net, {**params, **new, **buffers}, (x,))

    return theta, pos[idx], fn


def per_sample_jacobians(fn: Callable, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``∂f(x_n)/∂θ`` for every row, shape ``(n, O, len(θ))`` (``vmap`` of ``jacrev``)."""

    def one(th: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        return fn(th, xn.unsqueeze(0)).reshape(-1)

    try:
        return vmap(jacrev(one), in_dims=(None, 0))(theta, x)
    except (RuntimeError, NotImplementedError):  # e.g. RNNs under vmap: row by row (autodiff)
        return per_sample_jacobians_rowwise(one, theta, x)


def block_rows(fn: Callable, theta: torch.Tensor, x: torch.Tensor, chunk_size: int | None) -> int:
    """Rows per block so that ``rows·O·len(θ) <= MAX_JACOBIAN_NUMBERS`` (and ``<= chunk_size``)."""
    with torch.no_grad():
        o = as_2d(fn(theta, x[:1])).shape[1]
    rows = max(1, MAX_JACOBIAN_NUMBERS // (o * theta.numel()))
    return min(rows, chunk_size) if chunk_size is not None else rows


def index_jacobian_blocks(
    flat: FlatNet, x: torch.Tensor, idx: torch.Tensor, chunk_size: int | None, w: torch.Tensor
) -> Blocks:
    """``(outputs (n, O), ∂f/∂w[idx] (n, O, K))`` per block: per-sample Jacobians through only
    the parameter tensors that hold a selected weight (``D_t`` numbers), then indexed; blocks of
    at most ``min(chunk_size, MAX_JACOBIAN_NUMBERS // (O·D_t))`` rows."""
    with eval_mode(flat.net):
        theta, local, fn = restricted_call(flat, w, idx.to(w.device))
        for xc in x.split(block_rows(fn, theta, x, chunk_size)):
            jac = per_sample_jacobians(fn, theta, xc)[..., local]  # shape: (n, O, K)
            with torch.no_grad():
                out = as_2d(fn(theta, xc))
            yield out, jac.detach()


def dense_jacobian_blocks(
    flat: FlatNet, x: torch.Tensor, basis: torch.Tensor, chunk_size: int | None, w: torch.Tensor
) -> Blocks:
    """``(outputs (n, O), J P (n, O, K))`` per chunk of rows, by ``vmap`` over the ``K`` basis
    columns of ``jvp``: memory ``chunk_size·K·(O + activations)``."""
    k = basis.shape[1]
    tangents = basis.T.to(w)  # shape: (K, D)
    with eval_mode(flat.net):
        for xc in x.split(chunk_size or 1024):

            def f(wv: torch.Tensor, xc: torch.Tensor = xc) -> torch.Tensor:
                return flat(wv, xc)

            out, jp = jvps(flat.net, f, w, tangents)  # forward AD, else a fallback (autodiff)
            out = as_2d(out)
            yield out.detach(), jp.reshape(k, *out.shape).permute(1, 2, 0).detach()


def full_jacobian_blocks(
    flat: FlatNet, x: torch.Tensor, chunk_size: int | None, w: torch.Tensor
) -> Blocks:
    """``(outputs (n, O), ∂f/∂w (n, O, D))`` per block of at most ``chunk_size`` and
    ``MAX_JACOBIAN_NUMBERS // (O·D)`` rows; memory about twice one block."""
    with eval_mode(flat.net):
        for xc in x.split(block_rows(flat, w, x, chunk_size)):
            jac = per_sample_jacobians(flat, w, xc)  # shape: (n, O, D)
            with torch.no_grad():
                out = as_2d(flat(w, xc))
            yield out, jac.detach()
