"""Per-sample Jacobians of a network's outputs, in memory-bounded blocks.

The primitives every curvature and predictive computation shares. ``torch.func`` does the
differentiation: ``vmap`` over data points of ``jacrev`` for per-sample Jacobians (optionally with
respect to only the parameter tensors that hold some selected weights), ``vmap`` over basis
columns of ``jvp`` for ``J P``. Networks are evaluated functionally at given flat weights; their
own parameters are never read or changed.

Selected weights of an ``nn.Linear`` layer ``z = W a + b`` need no per-sample Jacobian over the
whole tensor: ``∂f_c/∂W_ij = (∂f_c/∂z_i) a_j`` and ``∂f_c/∂b_i = ∂f_c/∂z_i``, so one forward
pass (hooks read every such layer's input ``a`` and output ``z``) and one batched backward pass
over the ``O`` output classes give ``g_c = ∂f_c/∂z`` for all rows, and only the ``K`` selected
products ``g_{c,i} a_j`` are formed (`linear_index_jacobians`). Selected weights anywhere else
(convolutions, normalisation layers, a layer called twice) take the generic path.
"""

from __future__ import annotations

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
    """Which selected weights sit in an ``nn.Linear`` (the fast path) and which do not.

    Returns ``plan`` ``{layer name: (pos, i, j)}`` (``pos``: positions in ``idx``; ``i``: output
    unit; ``j``: input unit, ``in_features`` for the bias; each ``(k_l,)`` long) and ``rest``
    ``(K_r,)``, the positions of every other selected weight. A Linear whose parameters are
    shared with another module goes to ``rest``.
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
        if type(module) is not nn.Linear or owners[id(params[flat.names[t]])] != 1:
            rest.append(pos)
            continue
        i, j = (local // module.in_features, local % module.in_features)
        if attr == "bias":
            i, j = local, torch.full_like(local, module.in_features)
        old = plan.get(layer)
        new = (pos, i, j)
        plan[layer] = new if old is None else tuple(torch.cat(ab) for ab in zip(old, new))
    rest_pos = torch.cat(rest) if rest else torch.zeros(0, dtype=torch.long)
    return plan, rest_pos


def linear_index_jacobians(
    flat: FlatNet, plan: dict, w: torch.Tensor, x: torch.Tensor, factor: Factor = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(outputs (n, O), columns (K_lin, C, n))`` for the Linear-layer weights of ``plan``.

    One forward pass at ``w`` with hooks that keep each planned layer's input ``a`` ``(n, in)``
    and output ``z`` ``(n, out)``, one backward pass per output class for
    ``g = ∂f_c/∂z`` ``(O, n, out)``, then the products ``g[c, n, i] · a[n, j]`` (``g[c, n, i]``
    for a bias), written into one preallocated ``(K_lin, C, n)`` block. With a ``factor`` ``L``
    ``(n, O, C)`` the backward passes seed ``L[n, :, c]``
    instead of the unit vectors, so ``L_nᵀ J_n`` comes out directly (``C`` classes). Columns
    come in the order of ``torch.cat`` over the plan's ``pos``, column-major, so that the
    transpose ``(K, C·n)`` of the GGN's ``A`` is a free reshape. Rows must not interact (eval
    mode), as for every Jacobian here. Returns ``None`` when the fast path does not apply to
    this forward (`_one_row_per_point`: a layer called more or less than once, or inputs and
    outputs that are not ``(n, in)`` and ``(n, out)`` with the chunk's ``n`` rows, as in a
    network that reshapes its batch); the caller then takes the generic path.
    """
    seen: dict[str, list] = {name: [] for name in plan}

    def hook(name: str):
        def keep(module, inp, out):
            seen[name].append((inp[0].detach(), out))
            return out.clone()  # later in-place ops must not rebase the saved output

        return keep

    handles = [flat.net.get_submodule(n).register_forward_hook(hook(n)) for n in plan]
    try:
        with torch.enable_grad():
            out = flat(w.detach().requires_grad_(True), x)
    finally:
        for h in handles:
            h.remove()
    out2 = as_2d(out)
    n, o = out2.shape
    if n != batching.rows(x) or not all(_one_row_per_point(v, n) for v in seen.values()):
        return None
    zs = [seen[name][0][1] for name in plan]
    if factor is None:
        seeds = torch.eye(o, dtype=out2.dtype, device=out2.device)[:, None, :].expand(o, n, o)
    else:
        seeds = factor(out2.detach()).to(out2).permute(2, 0, 1)  # shape: (C, n, O)
    # One plain backward pass per class of the scalar ``Σ seed ⊙ f``, not one batched pass
    # (`is_grads_batched`) nor explicit grad_outputs: as fast for a few classes, and neither
    # functorch's one-time initialisation nor the SymPy import that torch's grad_outputs
    # checks trigger (each about 35 MB of memory on first use). Under the caller's
    # ``torch.no_grad()`` too (laplace-torch's scripts predict inside one): the products
    # ``out2 * seed`` must join the graph.
    with torch.enable_grad():
        per_class = [
            torch.autograd.grad(
                (out2 * seed).sum(), zs, retain_graph=c + 1 < len(seeds), allow_unused=True
            )
            for c, seed in enumerate(seeds)
        ]
    jac = out2.new_empty(sum(i.numel() for _, i, _ in plan.values()), len(seeds), n)
    start = 0
    for layer, (name, (_, i, j)) in enumerate(plan.items()):
        cols = jac[start : start + i.numel()]  # shape: (k_l, C, n), contiguous
        start += i.numel()
        if per_class[0][layer] is None:  # the layer does not reach the outputs
            cols.zero_()
            continue
        g = torch.stack([grads[layer].T for grads in per_class], 1)  # shape: (out, C, n)
        i, j = i.to(g.device), j.to(g.device)
        a = seen[name][0][0]
        # Row gathers of contiguous rows (fast), not gathers along the last dimension.
        a1 = torch.cat([a.T, torch.ones_like(a[:, 0])[None]])  # (in + 1, n); the bias row
        torch.index_select(g, 0, i, out=cols)
        cols.mul_(a1.index_select(0, j)[:, None, :])
    return out2.detach(), jac.detach()


def _one_row_per_point(calls: list, n: int) -> bool:
    """The fast path's precondition for one Linear layer: called once, on an input ``(n, in)``
    giving ``(n, out)``, row ``r`` being data point ``r``'s. A network that reshapes its batch
    (pairs ``(B, 2, d) → (2B, d)``, sets, tokens ``(B·L, d)``, a batch cut into rows and
    joined again) gives a layer more (or fewer) rows than data points, and a layer called
    twice sums two inputs' products: both take the generic path."""
    if len(calls) != 1:
        return False
    a, z = calls[0]
    return a.dim() == 2 and z.dim() == 2 and a.shape[0] == n and z.shape[0] == n


def index_jacobian_blocks(
    flat: FlatNet,
    x: torch.Tensor,
    idx: torch.Tensor,
    chunk_size: int | None,
    w: torch.Tensor,
    factor: Factor = None,
) -> Blocks:
    """``(outputs (n, O), ∂f/∂w[idx] (n, O, K))`` per block (``L_nᵀ ∂f/∂w[idx]`` ``(n, C, K)``
    with a `Factor`); Linear-layer columns come as a view of a column-major ``(K, C, n)`` tensor.

    Selected weights of ``nn.Linear`` layers: output-gradient × input products
    (`linear_index_jacobians`, ``O·K`` numbers per row). Any others: per-sample Jacobians
    through only the parameter tensors that hold them (``D_t`` numbers), then indexed. Blocks
    of at most ``min(chunk_size, INDEX_JACOBIAN_NUMBERS // (O·K),
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
        budget = min(MAX_JACOBIAN_NUMBERS // width, INDEX_JACOBIAN_NUMBERS // idx.numel())
        rows = max(1, budget // o)
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
