"""Per-sample Jacobians of a network's outputs, in memory-bounded blocks.

The primitives every curvature and predictive computation shares. ``torch.func`` does the
differentiation: ``vmap`` over data points of ``jacrev`` for per-sample Jacobians (optionally with
respect to only the parameter tensors that hold some selected weights), ``vmap`` over basis
columns of ``jvp`` for ``J P``. Networks are evaluated functionally at given flat weights; their
own parameters are never read or changed.

Selected weights of a layer whose parameters enter linearly through its output ``z`` need no
per-sample Jacobian over the whole tensor (BackPack's per-sample-gradient construction): one
forward pass (hooks read every such layer's input ``a`` and output ``z``) and one backward pass
per output class give ``g_c = ∂f_c/∂z`` for all rows, and only the ``K`` selected products are
formed (`linear_index_jacobians`, the layers `linear_plan` picks):

- ``nn.Linear`` ``z = W a + b``: ``∂f_c/∂W_ij = g_{c,i} a_j``, ``∂f_c/∂b_i = g_{c,i}``;
- ``nn.Conv1d``/``nn.Conv2d`` with zero padding: ``∂f_c/∂W[o, col] = Σ_L g[c, n, o, L] ·
  U[n, col, L]`` with ``U = unfold(a)`` over the ``L`` output positions (a Conv1d as a 2-D
  convolution of height 1), ``∂f_c/∂b[o] = Σ_L g[c, n, o, L]``;
- ``nn.BatchNorm1d``/``nn.BatchNorm2d`` in eval mode with running statistics:
  ``∂f_c/∂γ[o] = Σ_L g[c, n, o, L] · x̂[n, o, L]``, ``x̂ = (a − running_mean) /
  sqrt(running_var + eps)``, ``∂f_c/∂β[o] = Σ_L g[c, n, o, L]``.

Selected weights anywhere else (other layers, parameters shared between modules) take the
generic path, and so does a whole forward that breaks the per-row construction (a planned
layer called twice or on a reshaped batch, a BatchNorm normalising by its batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.func import jacrev, vmap

from .. import batch as batching
from .autodiff import jvps, per_sample_jacobians_rowwise, plain_kernels
from ..flat import FlatNet, eval_mode

#: Budget (in numbers) for one block of per-sample Jacobians ``(rows, O, D)``: 50M numbers is
#: 200 MB in float32, 400 MB in float64.
MAX_JACOBIAN_NUMBERS = 50_000_000

#: Budget (in numbers) for one block of selected-column Jacobians ``(rows, O, K)``
#: (`index_jacobian_blocks`): 1M numbers is 4 MB in float32, so the peak memory of a
#: subnetwork GGN or predictive does not grow with the chunk size or ``N``; BLAS ``syrk`` is at
#: full speed from a few hundred rows of ``A`` on.
INDEX_JACOBIAN_NUMBERS = 1_000_000

#: ...but at least this many data points a block of the layer fast path, whose forward and
#: ``C`` backward passes cost per block more than per point: a subnetwork of 42,438 ResNet-18
#: weights (10 classes) would get blocks of 2 images from the budget alone, 0.39-0.58 s an
#: image against 0.31-0.35 s at 8 (benchmarks/results/subnetwork_resnet18.txt); 8 points are
#: 3.4M numbers there (14 MB in float32).
MIN_INDEX_POINTS = 8

Blocks = Iterator[tuple[torch.Tensor, torch.Tensor]]
#: ``outputs (n, O) -> L (n, O, C)``, e.g. the factor ``H_n = L_n L_nᵀ`` of the output Hessian:
#: a Jacobian block ``J_n P`` is then returned as ``L_nᵀ J_n P`` ``(n, C, K)``.
Factor = Callable[[torch.Tensor], torch.Tensor] | None


def weighted(blocks: Blocks, factor: Factor) -> Blocks:
    """Blocks ``(outputs, J_n P (n, O, K))`` as ``(outputs, L_nᵀ J_n P (n, C, K))``."""
    if factor is None:
        yield from blocks
        return
    for out, jp in blocks:
        yield out, torch.bmm(factor(out).transpose(1, 2).to(jp), jp)


def as_2d(out: torch.Tensor) -> torch.Tensor:
    """Network outputs as ``(N, O)`` (a 1-D output gets ``O = 1``)."""
    if out.dim() == 1:
        return out.unsqueeze(-1)
    if out.dim() != 2:
        raise ValueError(f"net: expected outputs of shape (N, O) or (N,), got {tuple(out.shape)}")
    return out


def selected_jacobians(flat: FlatNet, w: torch.Tensor, idx: torch.Tensor):
    """Per-sample Jacobian columns of the flat indices ``idx`` ``(K,)``, differentiating only
    the parameter tensors that hold them, each on its own (no concatenated ``θ``: its split's
    backward would zero-fill and copy a ``(n·O, D_t)`` block per call).

    Returns ``D_t`` (the number of weights in the touched tensors: the per-row memory) and
    ``jac(x) -> (n, O, K)``, ``∂f(x_n)/∂w[idx]`` at ``w`` for the rows of ``x``; the other
    parameters stay at ``w``. ``vmap`` over rows of ``jacrev``; where ``vmap`` fails (RNNs),
    ``jacrev`` row by row under `autodiff.plain_kernels`.
    """

    params = flat.unflatten(w.detach())
    starts = torch.tensor([0, *flat.numels]).cumsum(0)
    which = torch.searchsorted(starts[1:], idx.cpu(), right=True)  # the tensor of each index
    touched = {}  # name -> (positions in idx, offsets inside the tensor)
    for t in which.unique().tolist():
        pos = (which == t).nonzero().squeeze(1)
        touched[flat.names[t]] = (pos.to(w.device), (idx.cpu()[pos] - starts[t]).to(w.device))
    sub = {name: params[name] for name in touched}

    def one(p: dict, xn: torch.Tensor) -> torch.Tensor:
        return flat.evaluate({**params, **p}, batching.unsqueeze(xn)).reshape(-1)

    def jac(x: torch.Tensor) -> torch.Tensor:
        try:
            parts = vmap(jacrev(one), in_dims=(None, 0))(sub, x)
        except (RuntimeError, NotImplementedError):  # e.g. RNNs under vmap: row by row
            with plain_kernels():
                per_row = [jacrev(one)(sub, xn) for xn in batching.each_row(x)]
            parts = {k: torch.stack([r[k] for r in per_row]) for k in sub}
        n, o = batching.rows(x), next(iter(parts.values())).shape[1]
        out = w.new_empty(n, o, idx.numel())
        for name, (pos, local) in touched.items():
            out[..., pos] = parts[name].reshape(n, o, -1)[..., local]
        return out.detach()

    return sum(p.numel() for p in sub.values()), jac


def per_sample_jacobians(fn: Callable, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``∂f(x_n)/∂θ`` for every row, shape ``(n, O, len(θ))`` (``vmap`` of ``jacrev``)."""

    def one(th: torch.Tensor, xn: torch.Tensor) -> torch.Tensor:
        return fn(th, batching.unsqueeze(xn)).reshape(-1)

    try:
        return vmap(jacrev(one), in_dims=(None, 0))(theta, x)
    except (RuntimeError, NotImplementedError):  # e.g. RNNs under vmap: row by row (autodiff)
        return per_sample_jacobians_rowwise(one, theta, x)


def block_rows(fn: Callable, theta: torch.Tensor, x: torch.Tensor, chunk_size: int | None) -> int:
    """Rows per block so that ``rows·O·len(θ) <= MAX_JACOBIAN_NUMBERS`` (and ``<= chunk_size``)."""
    with torch.no_grad():
        o = as_2d(fn(theta, batching.take(x, slice(0, 1)))).shape[1]
    rows = max(1, MAX_JACOBIAN_NUMBERS // (o * theta.numel()))
    return min(rows, chunk_size) if chunk_size is not None else rows


def linear_plan(flat: FlatNet, idx: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Which selected weights take the output-gradient × input fast path and which do not.

    The fast path covers ``nn.Linear``, ``nn.Conv1d``/``nn.Conv2d`` with
    ``padding_mode="zeros"`` (any padding, stride, dilation, groups) and
    ``nn.BatchNorm1d``/``nn.BatchNorm2d`` with running statistics (`_FAST_LAYERS`). Returns
    ``plan`` ``{layer name: (pos, i, j)}``, each ``(k_l,)`` long: ``pos``, positions in ``idx``;
    ``i``, the output unit or channel; ``j``, the column: a Linear's input unit
    (``in_features`` for the bias), a convolution's column of ``unfold(a)``, i.e.
    ``group(i)·(in/groups)·kk + local`` for a weight ``W[i].view(-1)[local]`` of a kernel of
    ``kk`` taps (``in_channels·kk`` for the bias), a BatchNorm's ``0`` for ``γ`` and ``1`` for
    ``β``. ``rest`` ``(K_r,)`` holds the positions of every other selected weight, among them
    those of parameters shared with another module and of BatchNorm without running statistics
    (it normalises by the batch's: rows interact).
    """
    owners: dict[int, int] = {}
    for m in flat.net.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    params = dict(flat.net.named_parameters())
    starts = torch.tensor([0, *flat.numels]).cumsum(0).tolist()
    which = torch.searchsorted(torch.tensor(starts[1:]), idx.cpu(), right=True)
    plan, rest = {}, []
    for t in which.unique().tolist():
        pos = (which == t).nonzero().squeeze(1)
        local = idx.cpu()[pos] - starts[t]
        layer, _, attr = flat.names[t].rpartition(".")
        module = flat.net.get_submodule(layer) if layer else flat.net
        ij = _plan_columns(module, attr, local)
        if ij is None or owners[id(params[flat.names[t]])] != 1:
            rest.append(pos)
            continue
        old = plan.get(layer)
        new = (pos, *ij)
        plan[layer] = new if old is None else tuple(torch.cat(ab) for ab in zip(old, new))
    rest_pos = torch.cat(rest) if rest else torch.zeros(0, dtype=torch.long)
    return plan, rest_pos


#: Layers of the fast path, with the input (and output) dimensions each accepts batched.
_FAST_LAYERS = {
    nn.Linear: (2,),
    nn.Conv1d: (3,),
    nn.Conv2d: (4,),
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
}


def _plan_columns(module: nn.Module, attr: str, local: torch.Tensor):
    """``(i, j)`` of `linear_plan` for the flat offsets ``local`` inside ``module``'s ``attr``
    (``"weight"`` or ``"bias"``), or ``None`` when the fast path does not cover them."""
    kind = type(module)
    if kind not in _FAST_LAYERS or attr not in ("weight", "bias"):
        return None
    if kind is nn.Linear:
        if attr == "bias":
            return local, torch.full_like(local, module.in_features)
        return local // module.in_features, local % module.in_features
    if kind in (nn.Conv1d, nn.Conv2d):
        if module.padding_mode != "zeros":
            return None
        taps = math.prod(module.kernel_size)
        if attr == "bias":
            return local, torch.full_like(local, module.in_channels * taps)
        per_out = module.weight[0].numel()  # (in/groups)·taps
        i = local // per_out
        group = i // (module.out_channels // module.groups)
        return i, group * per_out + local % per_out
    if not (module.track_running_stats and module.running_mean is not None):
        return None  # batch statistics: rows interact
    return local, torch.full_like(local, int(attr == "bias"))


def linear_index_jacobians(
    flat: FlatNet, plan: dict, w: torch.Tensor, x: torch.Tensor, factor: Factor = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(outputs (n, O), columns (K_fast, C, n))`` for the weights of ``plan`` (`linear_plan`:
    Linear, Conv1d/Conv2d, BatchNorm1d/2d).

    One forward pass at ``w`` with hooks that keep each planned layer's input ``a`` (``(n, in)``,
    ``(n, C, L)``, ``(n, C, H, W)``) and output ``z``, one backward pass per output class for
    ``g = ∂f_c/∂z`` (the shape of ``z``), then per class and layer the selected products
    (`_layer_columns`: ``g[c, n, i] · a[n, j]`` for a Linear, ``Σ_L g[c, n, o, L] ·
    unfold(a)[n, col, L]`` for a convolution, ``Σ_L g[c, n, o, L] · x̂[n, o, L]`` for a
    BatchNorm's ``γ``; ``Σ_L g`` for a convolution's or BatchNorm's bias), written into one
    preallocated ``(K_fast, C, n)`` block; each class's ``g`` is dropped before the next.
    With a ``factor`` ``L`` ``(n, O, C)`` the backward passes seed ``L[n, :, c]`` instead of
    the unit vectors, so ``L_nᵀ J_n`` comes out directly (``C`` classes). Columns come in the
    order of ``torch.cat`` over the plan's ``pos``, column-major, so that the transpose
    ``(K, C·n)`` of the GGN's ``A`` is a free reshape. Rows must not interact (eval mode), as
    for every Jacobian here. Returns ``None`` when the fast path does not apply to this
    forward (`_one_row_per_point`: a layer called more or less than once, or inputs and
    outputs that are not batched with the chunk's ``n`` rows first, as in a network that
    reshapes its batch; or a BatchNorm anywhere in the network normalising by its batch:
    training mode or no running statistics); the caller then takes the generic path.
    """
    seen: dict[str, list] = {name: [] for name in plan}

    def hook(name: str):
        def keep(module, inp, out):
            seen[name].append((inp[0].detach() if inp else None, out))
            return out.clone()  # later in-place ops must not rebase the saved output

        return keep

    modules = {name: flat.net.get_submodule(name) for name in plan}
    if any(_batch_statistics(m) for m in flat.net.modules()):
        return None  # a BatchNorm normalising by the batch: rows interact
    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    try:
        with torch.enable_grad():
            out = flat(w.detach().requires_grad_(True), x)
    finally:
        for h in handles:
            h.remove()
    out2 = as_2d(out)
    n, o = out2.shape
    if n != batching.rows(x) or not all(
        _one_row_per_point(seen[name], n, _FAST_LAYERS[type(m)]) for name, m in modules.items()
    ):
        return None
    zs = [seen[name][0][1] for name in plan]
    if factor is None:
        seeds = torch.eye(o, dtype=out2.dtype, device=out2.device)[:, None, :].expand(o, n, o)
    else:
        seeds = factor(out2.detach()).to(out2).permute(2, 0, 1)  # shape: (C, n, O)
    jac = out2.new_empty(sum(i.numel() for _, i, _ in plan.values()), len(seeds), n)
    layers, start = [], 0  # (fill, that layer's columns (k_l, C, n): a contiguous block)
    with torch.no_grad():
        for name, (_, i, j) in plan.items():
            a, z = seen[name][0]
            i, j = i.to(a.device), j.to(a.device)
            fill = _layer_columns(modules[name], i, j, a, z)
            layers.append((fill, jac[start : start + i.numel()]))
            start += i.numel()
    # One plain backward pass per class of the scalar ``Σ seed ⊙ f``, not one batched pass
    # (`is_grads_batched`) nor explicit grad_outputs: as fast for a few classes, and neither
    # functorch's one-time initialisation nor the SymPy import that torch's grad_outputs
    # checks trigger (each about 35 MB of memory on first use). Each class's ``g`` is used and
    # dropped before the next (a convolution's ``g`` is as large as its output). Under the
    # caller's ``torch.no_grad()`` too (laplace-torch's scripts predict inside one): the
    # products ``out2 * seed`` must join the graph.
    for c, seed in enumerate(seeds):
        with torch.enable_grad():
            grads = torch.autograd.grad(
                (out2 * seed).sum(), zs, retain_graph=c + 1 < len(seeds), allow_unused=True
            )
        with torch.no_grad():
            for (fill, cols), g in zip(layers, grads):
                if g is None:  # the layer does not reach the outputs
                    cols[:, c].zero_()
                else:
                    fill(g.detach(), cols[:, c])
    return out2.detach(), jac.detach()


def _batch_statistics(module: nn.Module) -> bool:
    """A BatchNorm that normalises by its batch's statistics (training mode, or no running
    statistics): the rows of one forward interact, so no fast column of that forward is any
    row's alone."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or (module.running_mean is None and module.running_var is None)
    )


def _one_row_per_point(calls: list, n: int, dims: tuple[int, ...] = (2,)) -> bool:
    """The fast path's precondition for one layer: called once, on a batched input ``(n, ...)``
    giving ``(n, ...)`` (a Linear's ``(n, in) → (n, out)``, a Conv2d's ``(n, C, H, W)``; the
    input's number of dimensions one of ``dims``), row ``r`` being data point ``r``'s. A
    network that reshapes its batch (pairs ``(B, 2, d) → (2B, d)``, sets, tokens
    ``(B·L, d)``, a batch cut into rows and joined again, a convolution over a reshaped batch
    of images) gives a layer more (or fewer) rows than data points, and a layer called twice
    sums two inputs' products: both take the generic path."""
    if len(calls) != 1:
        return False
    a, z = calls[0]
    if not isinstance(a, torch.Tensor) or not isinstance(z, torch.Tensor):
        return False
    return a.dim() in dims and z.dim() == a.dim() and a.shape[0] == n and z.shape[0] == n


#: Budget (in numbers) for one temporary of a convolution's products (`_conv_columns`): a
#: gather's ``(n, k, L)`` operands, a matmul's ``(n, O_u, cols_u)`` result; 256K numbers is
#: 1 MB in float32, so that the gather's three passes over it stay in cache (measured about
#: 1 ns a product's element against 1.5-2 ns with 8 MB temporaries).
PRODUCT_NUMBERS = 262_144

#: The cost rule of a convolution's selected weights (`_conv_columns`), per row and class:
#: gathering the ``k_l`` selected pairs' products costs ``MATMUL_RATIO·k_l·L`` (each a copy,
#: a multiply and a sum of ``L`` numbers, memory-bound), one batched matmul over the unique
#: selected output channels × unique selected columns ``O_u·cols_u·(L + MATMUL_RESULT_COST)``
#: (``L`` multiply-adds at BLAS speed per result, then writing and gathering the result); the
#: cheaper one is taken. Measured on one CPU thread (2026-11-28, 2 rows, ResNet-18's 3×3
#: convolutions at densities 0.4% to 100%): about 1.2 ns a product's element, 0.04 ns a
#: multiply-add and 0.8 ns a result, so the crossover ``O_u·cols_u / k_l`` is near 30 for
#: ``L >= 256``, 20 at ``L = 64``, 13 at ``L = 16``.
MATMUL_RATIO = 30
MATMUL_RESULT_COST = 20


def _layer_columns(module: nn.Module, i: torch.Tensor, j: torch.Tensor, a, z) -> Callable:
    """``fill(g, cols)``: one class's columns of ``module``'s planned weights ``(i, j)``
    (`linear_plan`), ``cols[k, n] = ∂(seed·f)(x_n)/∂w_k`` ``(k_l, n)``, from ``g`` the
    gradient of ``Σ seed ⊙ f`` with respect to the layer's output ``z``; ``a`` is its input.
    What does not depend on the class (a Linear's selected inputs, a convolution's selected
    columns of ``unfold(a)``, a BatchNorm's ``x̂``) is formed here, once per forward."""
    if type(module) is nn.Linear:
        n = a.shape[0]
        a1 = torch.cat([a.T, a.new_ones(1, n)])  # (in + 1, n); the bias row
        a_sel = a1.index_select(0, j)  # shape: (k_l, n)

        def fill_linear(g: torch.Tensor, cols: torch.Tensor) -> None:
            # Row gathers of contiguous rows (fast), not gathers along the last dimension.
            torch.mul(g.T.contiguous().index_select(0, i), a_sel, out=cols)

        return fill_linear
    if type(module) in (nn.Conv1d, nn.Conv2d):
        return _conv_columns(module, i, j, a, z)
    return _batchnorm_columns(module, i, j, a)


def _batchnorm_columns(module, i: torch.Tensor, j: torch.Tensor, a: torch.Tensor) -> Callable:
    """Eval-mode BatchNorm ``z = γ x̂ + β`` per channel, ``x̂ = (a − running_mean) /
    sqrt(running_var + eps)``: ``∂f_c/∂γ[o] = Σ_L g[c, n, o, L] · x̂[n, o, L]``, ``∂f_c/∂β[o] =
    Σ_L g[c, n, o, L]`` over the ``L`` positions of a channel (one for ``(n, C)`` inputs)."""
    n, ch = a.shape[:2]
    shape = (1, ch) + (1,) * (a.dim() - 2)
    mean, var = module.running_mean.to(a).view(shape), module.running_var.to(a).view(shape)
    xhat = ((a - mean) / torch.sqrt(var + module.eps)).reshape(n, ch, -1)
    at = j * ch + i  # into (n, 2C): [γ columns, β columns]

    def fill_batchnorm(g: torch.Tensor, cols: torch.Tensor) -> None:
        g = g.reshape(n, ch, -1)
        both = torch.cat([(g * xhat).sum(-1), g.sum(-1)], 1)  # shape: (n, 2C)
        cols.copy_(both.index_select(1, at).T)

    return fill_batchnorm


def _conv_columns(module, i: torch.Tensor, j: torch.Tensor, a: torch.Tensor, z) -> Callable:
    """A zero-padded convolution (a Conv1d as a 2-D one of height 1):
    ``∂f_c/∂W[o, col] = Σ_L g[c, n, o, L] · U[n, col, L]``, ``U = unfold(a)`` ``(n, cols, L)``
    (``L`` output positions; ``col`` counts every group's input channels, so that a grouped
    weight reads its own group's), ``∂f_c/∂b[o] = Σ_L g[c, n, o, L]``. Only the selected
    columns of ``U`` are formed (`_unfolded_columns`). By the cost rule `MATMUL_RATIO`,
    either the ``k_l`` pairs' products are formed, in chunks of `PRODUCT_NUMBERS`, or one
    batched matmul of ``g`` at the unique selected channels by ``U`` at the unique selected
    columns (``(n, O_u, L) @ (n, L, cols_u)``, in blocks of channels) is gathered."""
    one_d = type(module) is nn.Conv1d

    def two_d(v: tuple) -> tuple:  # a Conv1d's (k,) as (1, k)
        return (1, *v) if one_d else tuple(v)

    if one_d:  # (n, C, L) as (n, C, 1, L)
        a = a.unsqueeze(2)
    n = a.shape[0]
    out_hw = (1, z.shape[-1]) if one_d else tuple(z.shape[-2:])
    length = math.prod(out_hw)
    pad = list(module._reversed_padding_repeated_twice) + ([0, 0] if one_d else [])
    kernel = two_d(module.kernel_size)
    is_bias = j == module.in_channels * math.prod(kernel)
    wpos, bpos = (~is_bias).nonzero().squeeze(1), is_bias.nonzero().squeeze(1)
    iw, ib = i[wpos], i[bpos]
    cols_u, col_at = torch.unique(j[wpos], return_inverse=True)
    u = _unfolded_columns(
        a, cols_u, kernel, two_d(module.stride), two_d(module.dilation), pad, out_hw
    )  # shape: (n, cols_u, L)
    chans, chan_at = torch.unique(iw, return_inverse=True)
    k_w, cu = iw.numel(), cols_u.numel()
    matmul = k_w > 0 and (
        chans.numel() * cu * (length + MATMUL_RESULT_COST) <= MATMUL_RATIO * k_w * length
    )
    step = max(1, PRODUCT_NUMBERS // max(1, n * cu))  # channels per matmul block
    blocks = []  # (first channel, rows of cols, entries in the block's (n, ≤step·cu))
    if matmul:  # one block: the plan's order; several: the entries sorted by channel
        order = torch.arange(k_w).to(wpos)
        if chans.numel() > step:
            order = torch.argsort(chan_at, stable=True)
        firsts = torch.arange(0, chans.numel() + step, step).to(wpos)
        edges = torch.searchsorted(chan_at[order], firsts) if chans.numel() > step else None
        for b, lo in enumerate(firsts.tolist()[:-1]):
            sel = order if edges is None else order[int(edges[b]) : int(edges[b + 1])]
            if sel.numel():
                blocks.append((lo, _rows(wpos[sel]), (chan_at[sel] - lo) * cu + col_at[sel]))
    rows = max(1, PRODUCT_NUMBERS // max(1, n * length))  # pairs per chunk of the gather
    chunks = [(s, _rows(wpos[s : s + rows])) for s in range(0, 0 if matmul else k_w, rows)]
    bias_rows = _rows(bpos)

    def fill_conv(g: torch.Tensor, cols: torch.Tensor) -> None:
        g = g.reshape(n, -1, length)  # shape: (n, O, L)
        if bpos.numel():
            _put(cols, bias_rows, g.sum(-1).index_select(1, ib).T)
        if matmul:
            gu = g.index_select(1, chans)  # shape: (n, O_u, L)
            for lo, where, at in blocks:
                prods = torch.bmm(gu[:, lo : lo + step], u.transpose(1, 2))  # (n, ≤step, cu)
                _put(cols, where, prods.reshape(n, -1).index_select(1, at).T)
        for s, where in chunks:
            prods = g.index_select(1, iw[s : s + rows])  # shape: (n, k, L)
            prods.mul_(u.index_select(1, col_at[s : s + rows]))
            _put(cols, where, prods.sum(-1).T)

    return fill_conv


def _rows(where: torch.Tensor) -> torch.Tensor | slice:
    """Row positions as a ``slice`` when they are consecutive (a copy into a strided block is
    several times faster than a scatter), else as they are."""
    if where.numel() and int(where[-1]) - int(where[0]) + 1 == where.numel():
        if where.numel() == 1 or bool((where.diff() == 1).all()):
            return slice(int(where[0]), int(where[-1]) + 1)
    return where


def _put(cols: torch.Tensor, where: torch.Tensor | slice, values: torch.Tensor) -> None:
    """``cols[where] = values`` along the first dimension (`_rows`)."""
    if isinstance(where, slice):
        cols[where].copy_(values)
    else:
        cols.index_copy_(0, where, values)


def _unfolded_columns(a, cols, kernel, stride, dilation, pad, out_hw) -> torch.Tensor:
    """Columns ``cols`` of ``unfold(a)`` ``(n, len(cols), L)`` for a 2-D convolution, without
    the others: column ``c·kh·kw + p·kw + q`` (input channel ``c``, kernel tap ``(p, q)``) is
    the zero-padded input's channel ``c`` seen at that tap's offset with the stride, so one
    channel gather per tap present."""
    a = nn.functional.pad(a, pad) if any(pad) else a
    n, taps = a.shape[0], kernel[0] * kernel[1]
    (sh, sw), (dh, dw), (ho, wo) = stride, dilation, out_hw
    u = a.new_empty(n, cols.numel(), ho, wo)
    chan, tap = cols // taps, cols % taps
    for t in tap.unique().tolist():
        p, q = divmod(t, kernel[1])
        down = slice(p * dh, p * dh + sh * (ho - 1) + 1, sh)
        across = slice(q * dw, q * dw + sw * (wo - 1) + 1, sw)
        slab = a[:, :, down, across]  # shape: (n, C, Ho, Wo)
        sel = (tap == t).nonzero().squeeze(1)
        u.index_copy_(1, sel, slab.index_select(1, chan[sel]))
    return u.reshape(n, cols.numel(), ho * wo)


def index_jacobian_blocks(
    flat: FlatNet,
    x: torch.Tensor,
    idx: torch.Tensor,
    chunk_size: int | None,
    w: torch.Tensor,
    factor: Factor = None,
) -> Blocks:
    """``(outputs (n, O), ∂f/∂w[idx] (n, O, K))`` per block (``L_nᵀ ∂f/∂w[idx]`` ``(n, C, K)``
    with a `Factor`); fast-path columns come as a view of a column-major ``(K, C, n)`` tensor.

    Selected weights of ``nn.Linear``, zero-padded ``nn.Conv1d``/``nn.Conv2d`` and
    ``nn.BatchNorm1d``/``nn.BatchNorm2d`` with running statistics (`linear_plan`):
    output-gradient × input products (`linear_index_jacobians`, ``O·K`` numbers per row, one
    forward and ``C`` backward passes per block). Any others: per-sample Jacobians
    through only the parameter tensors that hold them (``D_t`` numbers), then indexed. Blocks
    of at most ``min(chunk_size, max(MIN_INDEX_POINTS, INDEX_JACOBIAN_NUMBERS // (O·K)),
    MAX_JACOBIAN_NUMBERS // (O·(K + D_t)))`` rows.
    """
    idx = idx.to(w.device)
    plan, rest = linear_plan(flat, idx)
    if not plan:
        yield from weighted(_generic_index_blocks(flat, x, idx, chunk_size, w), factor)
        return
    lin_pos = torch.cat([p for p, _, _ in plan.values()]).to(w.device)
    rest = rest.to(w.device)
    with eval_mode(flat.net):
        generic = selected_jacobians(flat, w, idx[rest]) if rest.numel() else None
        with torch.no_grad():
            o = as_2d(flat(w, batching.take(x, slice(0, 1)))).shape[1]
        width = idx.numel() + (generic[0] if generic else 0)
        rows = max(MIN_INDEX_POINTS, INDEX_JACOBIAN_NUMBERS // (idx.numel() * o))
        rows = max(1, min(rows, MAX_JACOBIAN_NUMBERS // (width * o)))
        rows = min(rows, chunk_size) if chunk_size is not None else rows
        in_order = generic is None and torch.equal(lin_pos, torch.arange(idx.numel()).to(lin_pos))
        for start in range(0, batching.rows(x), rows):
            xc = batching.take(x, slice(start, start + rows))
            fast = linear_index_jacobians(flat, plan, w, xc, factor)
            if fast is None:  # this net's forward does not fit the fast path
                rest_x = _generic_index_blocks(flat, batching.take(x, slice(start, None)), idx, chunk_size, w)
                yield from weighted(rest_x, factor)
                return
            out, cols = fast  # shape: (k_lin, C, n)
            if in_order:
                yield out, cols.permute(2, 1, 0)
                continue
            jac = cols.new_empty(idx.numel(), *cols.shape[1:])
            jac[lin_pos] = cols
            if generic is not None:
                other = generic[1](xc)
                jac[rest] = next(weighted(iter([(out, other)]), factor))[1].permute(2, 1, 0)
            yield out, jac.permute(2, 1, 0)


def _generic_index_blocks(
    flat: FlatNet, x: torch.Tensor, idx: torch.Tensor, chunk_size: int | None, w: torch.Tensor
) -> Blocks:
    """Per-sample Jacobians (``vmap`` of ``jacrev``) through only the parameter tensors that
    hold a selected weight, then indexed; at most ``MAX_JACOBIAN_NUMBERS // (O·D_t)`` rows."""
    with eval_mode(flat.net):
        d_t, jac = selected_jacobians(flat, w, idx)
        with torch.no_grad():
            o = as_2d(flat(w, batching.take(x, slice(0, 1)))).shape[1]
        rows = max(1, MAX_JACOBIAN_NUMBERS // (o * d_t))
        for xc in batching.split(x, min(rows, chunk_size) if chunk_size is not None else rows):
            block = jac(xc)  # shape: (n, O, K)
            with torch.no_grad():
                out = as_2d(flat(w, xc))
            yield out, block


def dense_jacobian_blocks(
    flat: FlatNet, x: torch.Tensor, basis: torch.Tensor, chunk_size: int | None, w: torch.Tensor
) -> Blocks:
    """``(outputs (n, O), J P (n, O, K))`` per chunk of rows, by ``vmap`` over the ``K`` basis
    columns of ``jvp``: memory ``chunk_size·K·(O + activations)``."""
    k = basis.shape[1]
    tangents = basis.T.to(w)  # shape: (K, D)
    with eval_mode(flat.net):
        for xc in batching.split(x, chunk_size or 1024):

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
        for xc in batching.split(x, block_rows(flat, w, x, chunk_size)):
            jac = per_sample_jacobians(flat, w, xc)  # shape: (n, O, D)
            with torch.no_grad():
                out = as_2d(flat(w, xc))
            yield out, jac.detach()


#: Budget (in numbers) for one block of factored per-sample Jacobians ``(rows, C, D)`` in
#: `factored_square_sums`: 8M numbers (32 MB in float32). Smaller blocks than
#: `MAX_JACOBIAN_NUMBERS` are faster here: each block is squared and summed at once, and blocks
#: above glibc's mmap threshold (32 MB) are fresh pages every time (benchmarks/scale.py notes).
SQUARE_SUM_NUMBERS = 8_000_000


def factored_square_sums(
    flat: FlatNet, x: torch.Tensor, w: torch.Tensor, factor: Callable, chunk_size: int | None
) -> torch.Tensor:
    """``Σ_n Σ_c (L_nᵀ J_n)_{c,d}²`` ``(D,)``: the GGN diagonal from ``L_n = factor(f(x_n))``.

    Per-sample Jacobians of ``L_nᵀ f(x_n, w)`` (``L_n`` held fixed at ``w``), so the reverse
    passes are seeded with the factor's columns directly (no ``(n, O, D)`` Jacobian and no
    ``bmm`` with ``L``), taken with respect to each parameter tensor separately (no
    concatenation of a ``(n, C, D)`` block). ``vmap`` over rows of
    ``jacrev``; rows that ``vmap`` cannot batch (RNNs) fall back to ``jacrev`` row by row under
    `autodiff.plain_kernels`. Blocks of at most ``chunk_size`` and
    ``SQUARE_SUM_NUMBERS // (C·D)`` rows.
    """

    params = flat.unflatten(w.detach())
    sums = {name: torch.zeros_like(p) for name, p in params.items()}

    def one(p: dict, xn: torch.Tensor, ln: torch.Tensor) -> torch.Tensor:
        return ln.T @ flat.evaluate(p, batching.unsqueeze(xn)).reshape(-1)  # shape: (C,)

    with eval_mode(flat.net):
        with torch.no_grad():  # C from the first row's factor
            c = factor(as_2d(flat(w, batching.take(x, slice(0, 1))))).shape[-1]
        rows = max(1, SQUARE_SUM_NUMBERS // (c * w.numel()))
        for xc in batching.split(x, min(rows, chunk_size) if chunk_size is not None else rows):
            with torch.no_grad():
                lc = factor(as_2d(flat(w, xc))).to(w)  # shape: (n, O, C)
            add_row_jacobian_squares(one, params, xc, lc, sums)
    return torch.cat([sums[name].reshape(-1) for name in flat.names])


def add_row_jacobian_squares(one: Callable, params: dict, x, factor, sums: dict) -> None:
    """``sums[k] += Σ_n Σ_c (∂ one(params, x_n, L_n)_c / ∂ params[k])²`` over the rows of ``x``
    and ``factor`` ``(n, O, C)``: ``vmap`` over rows of ``jacrev``, and row by row under
    `autodiff.plain_kernels` where ``vmap`` cannot batch (RNNs); not in place (a sum may alias
    a parameter), in each sum's dtype."""
    try:
        jac = vmap(jacrev(one), in_dims=(None, 0, 0))(params, x, factor)
    except (RuntimeError, NotImplementedError):  # e.g. RNNs under vmap: row by row
        with plain_kernels():
            per_row = [jacrev(one)(params, xn, ln) for xn, ln in zip(batching.each_row(x), factor)]
        jac = {k: torch.stack([r[k] for r in per_row]) for k in params}
    for name, j in jac.items():
        sums[name] = sums[name] + j.detach().square().sum((0, 1)).to(sums[name].dtype)
