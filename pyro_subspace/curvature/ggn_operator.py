"""The GGN at fixed weights as a reusable operator: the network's graph is built ONCE.

`ggn_vector_product` is stateless: every call runs the network forward (the primal) again.
An eigensolver applies the same ``G = Σ_n J_nᵀ H_n J_n`` (Subnetwork Inference eq. 9) at the
same ``w`` dozens of times, so `GGNOperator` builds, per chunk of rows, the autograd graph of
``f(w)`` and of its pullback ``g(u) = J_cᵀ u`` (one forward and one backward pass with
``create_graph``) and keeps them. Each product then reuses both graphs:

- ``J v = ∂(g(u)·v)/∂u`` (reverse over reverse: one backward pass through the graph of ``g``),
- ``H J v`` by the output Hessians ``H_n`` (also computed once),
- ``Jᵀ (H J v)`` (one backward pass through the graph of ``f``),

with no primal forward. A block ``V`` ``(D, b)`` goes through both passes at once
(``torch.autograd.grad(..., is_grads_batched=True)``, i.e. ``vmap`` over the cotangents).

``torch.func.linearize`` would also skip the primal, but tracing the network costs 250-350 ms
(``benchmarks/results/ggn_product_profile.txt``), more than the products it saves; building the
two graphs costs about one product.

Memory: the saved tensors of both graphs (activations, about three times those of a plain
forward pass, on all ``N`` rows); `GGNOperator.cached_bytes` reports them. Chunks beyond
``max_cached_bytes`` are not cached: their products use `ggn_vector_product`'s stateless path.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from .. import distributed
from ..autodiff import plain_kernels, strategy_of
from ..flat import eval_mode
from ..likelihoods import Likelihood
from .ggn import _inputs, _setup, ggn_matrix_product, ggn_vector_product
from .output_hessian import output_hessian

#: Default cache budget of `GGNOperator`, in bytes of saved tensors (1 GiB).
MAX_CACHED_BYTES = 2**30


class GGNOperator:
    """``v ↦ G v`` and ``V ↦ G V`` at fixed ``w``, with the network's graphs built once.

    Args:
        net, likelihood, x, w, chunk_size: as in `ggn_vector_product`.
        max_cached_bytes: the most bytes of saved tensors to keep; rows beyond it are
            recomputed on every product (`ggn_vector_product`). Default `MAX_CACHED_BYTES`.

    Attributes:
        dim: ``D``.
        dtype: ``w``'s dtype.
        device: ``w``'s device.
        products: operator-vector products so far (a block of ``b`` counts ``b``).
        cached_bytes: bytes of the saved tensors held by the cached graphs.
        cached_rows, total_rows: rows of ``x`` covered by the cache, and all rows.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        >>> x = torch.randn(10, 3, dtype=torch.float64)
        >>> from pyro_subspace.likelihoods import Gaussian
        >>> op = GGNOperator(net, Gaussian(sigma=1.0), x)
        >>> v = torch.randn(op.dim, dtype=torch.float64)
        >>> bool(torch.allclose(op.matvec(v), ggn_vector_product(net, Gaussian(sigma=1.0), x, v)))
        True
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        x: torch.Tensor,
        w: torch.Tensor | None = None,
        chunk_size: int = 1024,
        max_cached_bytes: int | None = None,
    ) -> None:
        flat, w = _setup(net, likelihood, x, w, chunk_size)
        budget = MAX_CACHED_BYTES if max_cached_bytes is None else max_cached_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"max_cached_bytes: expected an int >= 0, got {max_cached_bytes!r}")
        self.net, self.likelihood, self.w, self.chunk_size = net, likelihood, w, chunk_size
        self.dim, self.dtype, self.device = w.numel(), w.dtype, w.device
        self.products = self.cached_bytes = self.cached_rows = self.total_rows = 0
        self._graphs: list[tuple] = []  # (w leaf, out, u, g = Jᵀu, H) per cached chunk
        self._rest: list[torch.Tensor] = []  # chunks of rows not cached
        # fused kernels (mkldnn RNNs, the attention fast path) have no double backward
        self._plain = strategy_of(net) not in (None, "forward")
        with eval_mode(net):
            for xc in (c for xs in _inputs(x, chunk_size) for c in xs.split(chunk_size)):
                self.total_rows += xc.shape[0]
                if self.cached_bytes >= budget:
                    self._rest.append(xc)
                    continue
                try:
                    graph, nbytes = self._build(flat, xc)
                except (RuntimeError, NotImplementedError):  # a fused kernel: retry plain
                    if self._plain:
                        self._rest.append(xc)
                        continue
                    self._plain = True
                    graph, nbytes = self._build(flat, xc)
                self._graphs.append(graph)
                self.cached_bytes += nbytes
                self.cached_rows += xc.shape[0]

    def _build(self, flat, xc: torch.Tensor) -> tuple[tuple, int]:
        """The graphs of ``f`` and ``g(u) = Jᵀu`` on one chunk, and the bytes they save (the
        chunk's inputs themselves not counted)."""
        sizes: dict[int, int] = {}
        skip = id(xc.untyped_storage())

        def pack(t: torch.Tensor) -> torch.Tensor:
            if id(t.untyped_storage()) != skip:
                sizes[id(t.untyped_storage())] = t.untyped_storage().nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with torch.enable_grad(), hooks, plain_kernels() if self._plain else nullcontext():
            wg = self.w.detach().requires_grad_(True)
            out = flat(wg, xc)
            u = torch.zeros_like(out, requires_grad=True)
            (g,) = torch.autograd.grad(out, wg, u, create_graph=True)
        hess = output_hessian(self.likelihood, out.detach().reshape(out.shape[0], -1))
        nbytes = sum(sizes.values()) + hess.numel() * hess.element_size()
        return (xc, wg, out, u, g, hess), nbytes

    def _uncache(self) -> None:
        """Drop the cached graphs (double backward failed): every chunk goes stateless."""
        self._rest = [graph[0] for graph in self._graphs] + self._rest
        self._graphs, self.cached_bytes, self.cached_rows = [], 0, 0

    def _check(self, v: object, block: bool) -> torch.Tensor:
        want = f"({self.dim}, b)" if block else f"({self.dim},)"
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            raise TypeError(f"v: expected a floating-point tensor {want}, got {v!r}")
        ok = (
            (v.dim() == 2 and v.shape[0] == self.dim and v.shape[1] >= 1)
            if block
            else (tuple(v.shape) == (self.dim,))
        )
        if not ok:
            raise ValueError(f"v: expected shape {want}, got {tuple(v.shape)}")
        if not torch.isfinite(v).all():
            raise ValueError("v: contains NaN or inf")
        return v.detach().to(self.w)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """``G v`` for ``v`` ``(D,)``: shape ``(D,)``, detached, in ``w``'s dtype."""
        v = self._check(v, False)
        self.products += 1
        total = torch.zeros_like(self.w)
        try:
            for _, wg, out, u, g, hess in self._graphs:
                with plain_kernels() if self._plain else nullcontext():
                    (jv,) = torch.autograd.grad(g, u, v, retain_graph=True)
                    hjv = torch.einsum("nop,np->no", hess, jv.reshape(hess.shape[0], -1))
                    total += torch.autograd.grad(
                        out, wg, hjv.reshape(out.shape), retain_graph=True
                    )[0]
        except (RuntimeError, NotImplementedError):  # no double backward through some kernel
            self._uncache()
            total.zero_()
        with distributed.local():  # per-chunk sums; one reduction below
            for xc in self._rest:
                total += ggn_vector_product(
                    self.net, self.likelihood, xc, v, self.w, self.chunk_size
                )
        return distributed.all_reduce_sum(total.detach())

    def matmat(self, v: torch.Tensor) -> torch.Tensor:
        """``G V`` for ``V`` ``(D, b)`` in one batched pass per chunk: shape ``(D, b)``."""
        v = self._check(v, True)
        if v.shape[1] == 1:  # one vector: the unbatched path is cheaper than vmap over one
            return self.matvec(v[:, 0])[:, None]
        total = self._batched(v)
        if total is None:  # some kernel has no batching rule (or double backward): one by one
            return torch.stack([self.matvec(c) for c in v.unbind(1)], 1)
        self.products += v.shape[1]
        with distributed.local():
            for xc in self._rest:
                total += ggn_matrix_product(
                    self.net, self.likelihood, xc, v, self.w, self.chunk_size
                )
        return distributed.all_reduce_sum(total.detach())

    def _batched(self, v: torch.Tensor) -> torch.Tensor | None:
        """``Σ`` over the cached chunks of ``G_c V`` ``(D, b)``, both passes batched over the
        ``b`` vectors (``vmap``); None if some kernel has no batching rule."""
        tangents, b = v.T.contiguous(), v.shape[1]
        total = torch.zeros_like(tangents)
        try:
            for _, wg, out, u, g, hess in self._graphs:
                with plain_kernels() if self._plain else nullcontext():
                    jv = torch.autograd.grad(
                        g, u, tangents, retain_graph=True, is_grads_batched=True
                    )[0]
                    hjv = torch.einsum("nop,bnp->bno", hess, jv.reshape(b, hess.shape[0], -1))
                    total += torch.autograd.grad(
                        out,
                        wg,
                        hjv.reshape(b, *out.shape),
                        retain_graph=True,
                        is_grads_batched=True,
                    )[0]
        except (RuntimeError, NotImplementedError):
            return None
        return total.T

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        """`matvec` for ``(D,)``, `matmat` for ``(D, b)``."""
        return self.matmat(v) if isinstance(v, torch.Tensor) and v.dim() == 2 else self.matvec(v)
