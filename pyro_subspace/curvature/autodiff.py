"""Jacobian-vector products and per-sample Jacobians on any differentiable module.

Forward-mode AD (``torch.func.jvp``) is the cheap way to get ``J v``, but some fused kernels
have no forward derivative: ``nn.LSTM`` in float32 on CPU runs ``mkldnn_rnn_layer``, and an
``nn.TransformerEncoder`` in eval mode takes its fused fast path
(``aten::_transformer_encoder_layer_fwd``, flash attention). ``vmap`` over data points fails
on RNNs (their in-place state updates). When a step fails, the next one is tried, and the one
that works is remembered per network:

1. ``jvp`` as is;
2. ``jvp`` under `plain_kernels` (MHA fast path and mkldnn off, attention by its math kernel:
   composite ops that have forward derivatives; same numbers up to rounding);
3. reverse over reverse (the double-backward trick), under `plain_kernels`: with
   ``g(u) = Jᵀu`` (a vjp that is linear in the cotangent ``u``), ``J v = ∂(g(u)·v)/∂u``: one
   forward pass, one backward with graph, one double backward per vector.

Per-sample Jacobians (``vmap`` of ``jacrev`` over rows) fall back to ``jacrev`` row by row.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.func import jacrev, jvp, vmap

from .. import batch as batching

#: The strategy that worked, per network: "forward", "plain-forward" or "double-backward".
_STRATEGY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
STRATEGIES = ("forward", "plain-forward", "double-backward")


@contextlib.contextmanager
def plain_kernels() -> Iterator[None]:
    """Fused kernels off inside the block: the multi-head-attention fast path, mkldnn (RNNs),
    and scaled-dot-product attention restricted to its math (composite) kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.backends.mkldnn.flags(enabled=False), sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def strategy_of(net: nn.Module) -> str | None:
    """The strategy remembered for ``net`` (None before its first product)."""
    return _STRATEGY.get(net)


def _double_backward(
    f: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, tangents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``f(w)`` and ``J v`` for each row ``v`` of ``tangents`` ``(K, D)`` by reverse over
    reverse; returns ``(out, jv)`` with ``jv`` of shape ``(K, *out.shape)``."""
    with torch.enable_grad():
        wg = w.detach().requires_grad_(True)
        out = f(wg)
        u = torch.zeros_like(out, requires_grad=True)
        (g,) = torch.autograd.grad(out, wg, u, create_graph=True)  # g = Jᵀu, shape (D,)
        jv = [
            torch.autograd.grad(g, u, v, retain_graph=i < len(tangents) - 1)[0]
            for i, v in enumerate(tangents)
        ]
    return out.detach(), torch.stack(jv)


def _batched(strategy: str, f: Callable, w: torch.Tensor, tangents: torch.Tensor):
    if strategy == "double-backward":
        with plain_kernels():
            return _double_backward(f, w, tangents)
    context = plain_kernels() if strategy == "plain-forward" else contextlib.nullcontext()
    with context:
        if tangents.shape[0] == 1:
            out, jv = jvp(f, (w,), (tangents[0],))
            return out, jv.unsqueeze(0)
        outs, jv = vmap(lambda u: jvp(f, (w,), (u,)))(tangents)
        return outs[0], jv


def jvps(
    net: nn.Module,
    f: Callable[[torch.Tensor], torch.Tensor],
    w: torch.Tensor,
    tangents: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f(w), J v_k for each k)`` for ``tangents`` ``(K, D)``: ``out`` and ``jv`` of shape
    ``(K, *out.shape)``, by the first strategy (module docstring) that works for ``net``."""
    known = _STRATEGY.get(net)
    if known is not None:
        return _batched(known, f, w, tangents)
    first = None
    for strategy in STRATEGIES:
        try:
            result = _batched(strategy, f, w, tangents)
        except (RuntimeError, NotImplementedError) as err:
            first = first or err
            continue
        _STRATEGY[net] = strategy
        return result
    raise first  # type: ignore[misc]


def jvp_any(
    net: nn.Module, f: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f(w), J v)`` for one tangent ``v`` ``(D,)`` (`jvps` with ``K = 1``)."""
    out, jv = jvps(net, f, w, v.unsqueeze(0))
    return out, jv[0]


def per_sample_jacobians_rowwise(one: Callable, theta: torch.Tensor, x: torch.Tensor):
    """``∂one(θ, x_n)/∂θ`` for every row, stacked ``(n, O, len(θ))``: ``jacrev`` row by row
    (the fallback when ``vmap`` over rows fails, e.g. RNNs), under `plain_kernels`."""
    with plain_kernels():
        return torch.stack([jacrev(one)(theta, xn) for xn in batching.each_row(x)])
