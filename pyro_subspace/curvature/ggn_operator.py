"""The GGN at fixed weights as a reusable operator: the network's graphs built ONCE, where it pays.

`ggn_vector_product` is stateless: every call runs the network forward (the primal) again.
An eigensolver applies the same ``G = Σ_n J_nᵀ H_n J_n`` (Subnetwork Inference eq. 9) at the
same ``w`` dozens of times, so `GGNOperator` can build, per chunk of rows, the autograd graph of
``f(w)`` and of its pullback ``g(u) = J_cᵀ u`` (one forward and one backward pass with
``create_graph``) and keep them. Each product then reuses both graphs:

- ``J v = ∂(g(u)·v)/∂u`` (reverse over reverse: one backward pass through the graph of ``g``),
- ``H J v`` by the output Hessians ``H_n`` (also computed once),
- ``Jᵀ (H J v)`` (one backward pass through the graph of ``f``),

with no primal forward. A block ``V`` ``(D, b)`` goes through both passes at once
(``torch.autograd.grad(..., is_grads_batched=True)``, i.e. ``vmap`` over the cotangents).

``torch.func.linearize`` would also skip the primal, but tracing the network costs 250-350 ms
(``benchmarks/results/ggn_product_profile.txt``), more than the products it saves; building the
two graphs costs about one product.

**Cached or stateless** (``cache=None``, the default): the cached product trades the primal
forward for a double backward. Through matrix multiplies and elementwise ops that is a gain;
through a convolution it is not (the double backward of a convolution costs more than the
dual-number forward it replaces). So the operator first records the graphs on the first 2 and
4 rows (probes, then dropped) and caches unless the graph of ``f`` contains a convolution (an
autograd node whose name contains ``Conv``: ``nn.Conv1d/2d/3d``, transposed convolutions,
``F.conv*`` inside any module); with a convolution every product is `ggn_vector_product`'s
stateless one and nothing is cached. The rule depends only on the operations the network
records, never on timings, so a network always takes the same path. ``cache=True``/``False``
force either path. Measured (``benchmarks/results/ggn_operator_memory.txt``: one thread, best
of interleaved rounds, cached / stateless time per product over five runs on a shared 2-core
machine): the diabetes and digits MLPs of ``benchmarks/lanczos_vs_arpack.py`` 0.5-0.6x and
0.3-0.5x, an MLP 64-128-128-10 0.4-0.6x, with BatchNorm1d 0.5-0.8x, an LSTM 0.25-0.4x: cached;
with LayerNorm 0.9-1.1x and small transformer encoders 1.0-1.06x: even, cached as before;
small convolutional nets 0.95-1.6x, the ResNets of ``benchmarks/scale.py`` at N = 256
1.2-1.4x (in-place ReLU, 309k weights) and 0.9-1.6x (no in-place op, 187k weights), at
N = 1024 under the 1 GiB budget 1.2-1.3x and 1.1-1.5x: stateless.

**Memory budget** (``max_cached_bytes``, default `MAX_CACHED_BYTES` = 1 GiB): `cached_bytes`
is the sum of the sizes of the storages the cached graphs actually hold (every tensor saved
for backward, found by ``torch.autograd.graph.saved_tensors_hooks``, plus the outputs, ``Jᵀu``
and output Hessians kept beside them; each storage once), not counting storage that is held
anyway (``x`` when it is a tensor, ``w``, the network's parameters and buffers). It never
exceeds the budget: the probe graphs on 2 and 4 rows give the fixed bytes and the bytes per
row, each chunk caches only the rows that fit (a chunk is split into a cached part and a
stateless rest), and each graph's bytes are counted after its build; one that overshoots is
dropped (and rebuilt once on the rows its actual size allows). Rows not cached are
recomputed on every product (`ggn_vector_product`). The ResNets of ``benchmarks/scale.py``
on 3×32×32 images hold 1.4 and 2.4 MiB per cached row. The process's peak memory is that of
the stateless product plus `cached_bytes` plus allocator slack (measured there at N = 1024:
about 0.2 GiB over the 1 GiB cached).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from .. import batch as batching
from .. import distributed
from .autodiff import plain_kernels, strategy_of
from ..flat import eval_mode
from ..likelihoods import Likelihood
from .ggn import _inputs, _setup, ggn_matrix_product, ggn_vector_product
from .output_hessian import output_hessian

#: Default cache budget of `GGNOperator`, in bytes held by the cached graphs (1 GiB).
MAX_CACHED_BYTES = 2**30
#: Rows of the two probe graphs (bytes per row = the difference / 2).
PROBE_ROWS = (2, 4)


def has_convolution(out: torch.Tensor) -> bool:
    """Whether the autograd graph of ``out`` contains a convolution (a node named ``*Conv*``)."""
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "Conv" in node.name():
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


class GGNOperator:
    """``v ↦ G v`` and ``V ↦ G V`` at fixed ``w``, with the network's graphs built once where
    that is faster (see the module docstring for the rule and the budget).

    Args:
        net, likelihood, x, w, chunk_size: as in `ggn_vector_product`.
        max_cached_bytes: the most bytes the cached graphs may hold (`cached_bytes` never
            exceeds it); rows beyond it are recomputed on every product
            (`ggn_vector_product`). Default `MAX_CACHED_BYTES` (1 GiB).
        cache: ``None`` (default): cache unless the network's graph contains a convolution;
            ``True``: cache (within the budget) on any network; ``False``: never cache (every
            product stateless, nothing built).

    Attributes:
        dim: ``D``.
        dtype: ``w``'s dtype.
        device: ``w``'s device.
        products: operator-vector products so far (a block of ``b`` counts ``b``).
        cache: whether the cached path was chosen (``cache`` resolved by the rule).
        reason: why, in words.
        cached_bytes: bytes held by the cached graphs (<= ``max_cached_bytes``).
        max_cached_bytes: the budget.
        cached_rows, total_rows: rows of ``x`` covered by the cache, and all rows.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        >>> x = torch.randn(10, 3, dtype=torch.float64)
        >>> from pyro_subspace.likelihoods import Gaussian
        >>> op = GGNOperator(net, Gaussian(sigma=1.0), x)
        >>> op.cache, op.cached_rows
        (True, 10)
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
        cache: bool | None = None,
    ) -> None:
        flat, w = _setup(net, likelihood, x, w, chunk_size)
        budget = MAX_CACHED_BYTES if max_cached_bytes is None else max_cached_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"max_cached_bytes: expected an int >= 0, got {max_cached_bytes!r}")
        if cache is not None and not isinstance(cache, bool):
            raise TypeError(f"cache: expected True, False or None, got {cache!r}")
        self.net, self.likelihood, self.w, self.chunk_size = net, likelihood, w, chunk_size
        self.dim, self.dtype, self.device = w.numel(), w.dtype, w.device
        self.max_cached_bytes = budget
        self.products = self.cached_bytes = self.cached_rows = self.total_rows = 0
        self._graphs: list[tuple] = []  # (x rows, w leaf, out, u, g = Jᵀu, H) per cached part
        self._rest: list[torch.Tensor] = []  # rows not cached
        # storage the caller (or this operator) holds anyway: not counted as cached
        given = [x] if isinstance(x, torch.Tensor) else list(x.values()) if batching.is_mapping(x) else []
        held = [w, *net.parameters(), *net.buffers(), *given]
        self._held = {t.untyped_storage().data_ptr() for t in held}
        # fused kernels (mkldnn RNNs, the attention fast path) have no double backward
        self._plain = strategy_of(net) not in (None, "forward")
        self.cache = bool(cache)
        self.reason = "cache=True" if cache else "cache=False: every product stateless"
        model = None  # (fixed bytes, bytes per row) of a graph, from the probes
        caching = cache is not False
        with eval_mode(net):
            for xc in (c for xs in _inputs(x, chunk_size) for c in batching.split(xs, chunk_size)):
                n = batching.rows(xc)
                self.total_rows += n
                if caching and model is None:
                    model = self._probe(flat, xc, cache)
                    caching = self.cache and model is not None and budget > 0
                    if self.cache and budget == 0:
                        self.reason += " (max_cached_bytes=0: nothing cached)"
                if not caching:
                    self._rest.append(xc)
                    continue
                k = self._fit(model, n)
                graph = None
                for _ in range(2):  # one rebuild, with the rows the actual size allows
                    if k == 0:
                        break
                    graph = self._try_build(flat, xc[:k])
                    if graph is None or self.cached_bytes + graph[1] <= budget:
                        break
                    fixed, per_row = model
                    model = (fixed, max(per_row, (graph[1] - fixed) / k))
                    k, graph = min(k - 1, self._fit(model, n)), None  # dropped: over budget
                if graph is None:
                    self._rest.append(xc)
                    caching = False
                    continue
                fixed, per_row = model
                model = (fixed, max(per_row, (graph[1] - fixed) / k))
                self._graphs.append(graph[0])
                self.cached_bytes += graph[1]
                self.cached_rows += k
                if k < n:  # the budget is full: the rest of the chunk and the others recompute
                    self._rest.append(xc[k:])
                    caching = False

    def _fit(self, model: tuple[float, float], n: int) -> int:
        """The rows (<= ``n``) whose graph the model says fits in what is left of the budget."""
        fixed, per_row = model
        room = self.max_cached_bytes - self.cached_bytes - fixed
        return max(0, min(n, int(room // per_row))) if room > 0 else 0

    def _probe(self, flat, xc: torch.Tensor, cache: bool | None) -> tuple[float, float] | None:
        """Graphs on the first `PROBE_ROWS` rows (then dropped): resolve ``cache=None`` by the
        rule and return ``(fixed bytes, bytes per row)``; None if nothing is to be cached (a
        convolution under ``cache=None``) or no graph can be built."""
        sizes = []
        for rows in sorted({min(r, batching.rows(xc)) for r in PROBE_ROWS}):
            built = self._try_build(flat, xc[:rows])
            if built is None:
                self.cache, self.reason = False, "no double backward: every product stateless"
                return None
            if cache is None and not sizes:
                if has_convolution(built[0][2]):
                    self.cache = False
                    self.reason = "cache=None, a convolution in the graph: every product stateless"
                    return None
                self.cache, self.reason = True, "cache=None, no convolution in the graph: cached"
            sizes.append((rows, built[1]))
            del built
        (r1, b1), (r2, b2) = sizes[0], sizes[-1]
        per_row = (b2 - b1) / (r2 - r1) if r2 > r1 else b1 / r1
        if per_row <= 0:
            per_row = b2 / r2
        return max(0.0, b1 - r1 * per_row), max(per_row, 1.0)

    def _try_build(self, flat, xc: torch.Tensor) -> tuple[tuple, int] | None:
        """`_build`, retried with plain kernels if a fused kernel fails; None if that fails."""
        try:
            return self._build(flat, xc)
        except (RuntimeError, NotImplementedError):  # a fused kernel: retry plain
            if self._plain:
                return None
            self._plain = True
            try:
                return self._build(flat, xc)
            except (RuntimeError, NotImplementedError):
                return None

    def _build(self, flat, xc: torch.Tensor) -> tuple[tuple, int]:
        """The graphs of ``f`` and ``g(u) = Jᵀu`` on one chunk, and the bytes they hold: the
        storages of the saved tensors, outputs, ``Jᵀu`` and output Hessians, each once,
        without those in ``self._held``."""
        sizes: dict[int, int] = {}

        def count(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._held:
                sizes[storage.data_ptr()] = storage.nbytes()
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)
        with torch.enable_grad(), hooks, plain_kernels() if self._plain else nullcontext():
            wg = self.w.detach().requires_grad_(True)
            out = flat(wg, xc)
            u = torch.zeros_like(out, requires_grad=True)
            (g,) = torch.autograd.grad(out, wg, u, create_graph=True)
        hess = output_hessian(self.likelihood, out.detach().reshape(out.shape[0], -1))
        for t in (xc, out, u, g, hess):
            count(t)
        return (xc, wg, out, u, g, hess), sum(sizes.values())
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
