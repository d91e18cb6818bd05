"""The K-FAC pass, `kfac`: one forward pass with hooks per chunk, ``C`` backward passes to the
layers' outputs, the sums added in float64 and reduced over ranks (the package docstring)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from ... import batch as batching
from ... import distributed
from ...data import DataSource
from ...flat import eval_mode
from ...likelihoods import Likelihood, check_likelihood
from ...threads import thread_policy
from ...linalg import symmetrize_
from ...validation import check_inputs, choice, positive_int
from ..jacobians import as_2d
from ..output_hessian import hessian_factor
from .blocks import KronFactors, _assemble
from .convolution import _grad_gram, _input_sum
from .diagonal import (
    _check_local_calls,
    _diagonal_sums,
    _local_diagonal_sums,
    _usable_local,
)
from .fold import _affine_batchnorm, _Fold, _fold_pairs, _identity, _uses_running_stats
from .layers import _check_calls, _check_modules, _fill_zeros, _Layer, _plan, _settle
from .mc import _check_generator, _mc_factor
from ...validation import check_finite_state

__all__ = ["kfac"]

#: ``fisher`` choices: the exact type-2 Fisher (= GGN) or its Monte Carlo estimate.
FISHERS = ("type-2", "mc")

#: ``conv`` choices: how a shared dimension (conv locations, sequence positions) is treated.
CONVS = ("expand", "reduce", "backpack")

#: ``bias`` choices: a block of its own, or a column of ones appended to the inputs.
BIASES = ("separate", "augment")

#: At most this many numbers in one layer's output per forward/backward pass: the ``C``
#: backward passes of a pass then work in cache-sized tensors (a CNN's first stages at 1024
#: rows run them about 1.6 times slower than at 256), and each pass frees little enough that
#: glibc keeps it for the next instead of returning it and faulting it in again (resnet4, 1024
#: rows, fresh processes: 128-row passes 8.2-8.6 s, 256-row passes 10.4-10.8 s).
PASS_NUMBERS = 2**21

#: ...but at least this many rows a pass (fewer than the chunk only if the chunk is smaller):
#: below it the per-layer, per-column overhead of the ``C`` backward passes dominates
#: (ResNet-18, whose widest output is 64·32·32 numbers a row: 32-row passes 250 s, 64-row 221 s).
MIN_PASS_ROWS = 64

#: On CPU, with the ``"expand"`` convention, a network with a ``Conv2d`` runs the K-FAC pass on
#: a channels-last copy of each chunk of 4-D inputs (the user's inputs and network are
#: untouched; a network that cannot take that layout, one that views its input or a
#: convolution's output, gets the pass in its own, `_channels_last_forward`): the convolutions then work in NHWC, whose input-gradient kernels (the ``C``
#: backward passes) run up to 4 times faster than the NCHW ones on this machine's CPU (a 16→32,
#: stride-2 convolution at 32×32: 6.2 against 24.5 ms), and the expand A factor's channels-last
#: row patches become a cheap copy (``"reduce"``'s ``F.unfold`` wants NCHW: 10% slower there).
CHANNELS_LAST_ON_CPU = True

#: Run each ``Conv2d`` whose output only an eval-mode BatchNorm uses as one function of the
#: convolution's input (`_FoldedConvBN`) after the first chunk: the ``C`` backward passes then
#: skip the BatchNorm's elementwise product (the factors are the same, to rounding).
FOLD_BATCHNORM = True


@thread_policy
def kfac(
    net: nn.Module,
    likelihood: Likelihood,
    x: object,
    y: torch.Tensor | None = None,
    *,
    modules: nn.Module | str | Sequence[nn.Module | str] | None = None,
    fisher: str = "type-2",
    conv: str = "expand",
    bias: str = "separate",
    chunk_size: int = 1024,
    generator: torch.Generator | int | None = None,
    mc_samples: int = 1,
    dtype: torch.dtype | None = None,
    on_outputs: Callable[[torch.Tensor, torch.Tensor | None], None] | None = None,
) -> KronFactors:
    """K-FAC factors of the GGN (type-2 Fisher) for ``nn.Linear``/``nn.Conv2d`` layers, the
    exact GGN diagonal for every other covered parameter, in one pass over the data.

    Martens & Grosse (2015); Ritter et al. (2018) eq. 7 (the Laplace use); Grosse & Martens
    (2016) and Eschenhagen et al. (2023) eqs. 10-13 for convolutions and weight sharing (the
    package docstring states every convention and which laplace-torch backend it equals).
    No prior and no temperature are added. The network runs in eval mode.

    Args:
        net: the network; its current weights are used. Outputs ``(N, O)`` (or ``(N,)``).
        likelihood: a `Likelihood`; its `Likelihood.hessian_factor` (or, for ``"mc"``, its
            ``distribution``) gives the back-propagated columns.
        x: inputs ``(N, ...)``, or a ``Dataset``/``DataLoader`` of ``(x, y)`` (its batches
            are split further into ``chunk_size`` rows and moved to the network's device).
        y: targets ``(N, ...)`` with tensor ``x``: accepted and checked for length only; the
            type-2 and MC Fishers do not depend on them.
        modules: what to cover: ``None`` (every parameter of ``net`` that requires grad), or a
            module, a name from ``net.named_modules()`` or a list of them (everything inside
            them, e.g. ``[net[-1]]`` for a last-layer Laplace).
        fisher: ``"type-2"`` (the exact GGN's factors) or ``"mc"`` (sampled targets).
        conv: ``"expand"``, ``"reduce"`` or ``"backpack"`` for weight sharing (package
            docstring); irrelevant for layers without it.
        bias: ``"separate"`` (bias block ``G``) or ``"augment"`` (one block for ``[W | b]``).
        chunk_size: at most this many rows per forward/backward pass (fewer where one layer's
            output would exceed `PASS_NUMBERS` numbers, and, for a ``DataLoader``, where the
            float64 factor sums beside a pass's graph would hold more than a training step on
            the loader's batch: `_rows_within_memory`); the factors do not depend on it.
        generator: for ``"mc"``: a ``torch.Generator`` (on the network's device, or on the
            CPU: draws are then moved), an int seed, or ``None``: a new generator seeded with
            ``MC_SEED`` plus the process's rank. Torch's global generators are not advanced.
        mc_samples: draws per data point for ``"mc"`` (must be 1 for ``"type-2"``).
        dtype: dtype of the returned factors (default the network's). Each chunk's products
            are formed in the network's dtype and added up in float64.
        on_outputs: called with each pass's outputs ``(n, O)`` (detached) and its rows of the
            targets (``None`` without targets), so that a caller computes statistics of the
            same forward pass (the Laplace evidence's ``log p(D | θ)``) without a second one.

    Returns:
        `KronFactors`: for each K-FAC layer a ``"kron"`` block ``G ⊗ A`` of the weight (plus a
        ``"full"`` block ``G`` of the bias with ``bias="separate"``), and one ``"diagonal"``
        block per other module owning covered parameters.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        >>> factors = kfac(net, Categorical(), torch.randn(20, 3))
        >>> [(b.module, b.kind, b.numel) for b in factors.blocks]
        [('0', 'kron', 15), ('0', 'full', 5), ('2', 'kron', 10), ('2', 'full', 2)]
        >>> factors.to_dense().shape
        torch.Size([32, 32])
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    params = list(net.parameters())
    if not params:
        raise ValueError("net: the network has no parameters")
    check_likelihood(likelihood)
    choice(fisher, "fisher", FISHERS)
    choice(conv, "conv", CONVS)
    choice(bias, "bias", BIASES)
    positive_int(chunk_size, "chunk_size")
    positive_int(mc_samples, "mc_samples")
    if fisher == "type-2" and mc_samples != 1:
        raise ValueError(f"mc_samples: only fisher='mc' draws samples, got {mc_samples}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype: expected a floating-point torch.dtype or None, got {dtype!r}")
    check_finite_state(net)  # NaN weights would surface as non-finite outputs after a pass
    device = params[0].device
    gen = _check_generator(generator, device) if fisher == "mc" else None
    if isinstance(x, torch.Tensor) or batching.is_mapping(x):
        check_inputs(net, x, "x")
    source = DataSource(x, y, chunk_size)  # a Dataset/DataLoader, else a TypeError naming x
    layers, diagonal = _plan(net, _check_modules(net, modules), bias == "augment")

    out_dtype = dtype or params[0].dtype
    named = dict(net.named_parameters())
    diag_sums = {p: 0.0 for names in diagonal.values() for p in names}
    count, first = 0, True
    folds: dict[str, _Fold] = {}
    modules = dict(net.named_modules())
    # diagonal blocks of a module's own parameters: per-sample Jacobians of the module alone,
    # from the same backward passes (`_local_diagonal_sums`); others through the whole network
    local = [_Layer(name, modules[name], None, None, False, {}) for name in diagonal]
    nhwc = (
        CHANNELS_LAST_ON_CPU
        and conv == "expand"
        and device.type == "cpu"
        and any(isinstance(m, nn.Conv2d) for m in net.modules())
    )
    with eval_mode(net), torch.enable_grad():
        for xs, ys in source:
            xs = batching.to_device(xs, device)
            if first and batching.rows(xs):  # a forward pass of one row, before the first chunk
                probe, graph_row = _one_row_pass(net, layers + local, xs)
                # the chunk, or fewer rows where a layer's output is large
                rows = _rows_per_pass(probe, chunk_size)
                if isinstance(x, DataLoader):  # its batch is the user's training step:
                    # no larger a pass than fits beside the factor sums in the step's graph
                    batch = min(chunk_size, batching.rows(xs))
                    rows = min(rows, _rows_within_memory(graph_row, _sums_bytes(layers), batch))
                chunk_size = rows
            ycs = ys.split(chunk_size) if ys is not None else None
            for i, xc in enumerate(batching.split(xs, chunk_size)):
                links: dict | None = {} if first and FOLD_BATCHNORM else None
                out = None
                if nhwc and isinstance(xc, torch.Tensor) and xc.dim() == 4:
                    # channels last: the C backward passes' convolutions run faster on CPU,
                    # if the network takes that layout (not where it views its input or a
                    # convolution's output: then the user's layout, from now on)
                    out, seen = _channels_last_forward(net, layers + local, xc, folds, links)
                    nhwc = out is not None
                if out is None:
                    out, seen = _hooked_forward(net, layers + local, xc, folds, links)
                n = batching.rows(xc)
                if first:
                    layers = _settle(layers, seen, diagonal, diag_sums)
                    # rows that are the data points (one row in the one-row pass, too)
                    local = [
                        m for m in local
                        if _usable_local(m, seen[m.name], n) and _usable_local(m, probe[m.name], 1)
                    ]  # fmt: skip
                    first, probe = False, None
                    keep = {lay.name for lay in layers} | {m.name for m in local}
                    seen = {k: v for k, v in seen.items() if k in keep}
                    if links:  # the next chunks run each Conv2d + BatchNorm pair as one
                        once = [lay for lay in layers if len(seen[lay.name]) == 1]
                        folds = _fold_pairs(once, local, links, out)
                    links = None
                _check_calls(layers, seen)
                _check_local_calls(local, seen, n)
                out2 = as_2d(out)
                if on_outputs is not None:
                    on_outputs(out2.detach(), None if ycs is None else ycs[i])
                for lay in layers:  # every call's rows (a reshaped batch, a layer used twice)
                    if lay.weight is not None:
                        for a, _ in seen[lay.name]:
                            lay.A = lay.A + _input_sum(lay, a, conv)
                # a layer whose output is the network's (J_z = I) gets G = Σ_n H_n directly:
                # no backward pass, and no C·out² per row for a last layer of many classes
                last = [lay for lay in layers if fisher == "type-2" and _is_output(lay, seen, out2)]
                for lay in last:
                    _add_sum(lay, likelihood.output_hessian_sum(out2.detach()))
                rest = [lay for lay in layers if lay not in last]
                whole = [m for m in diagonal if m not in {q.name for q in local}]
                if rest or local or whole:  # the factor's columns (not needed for `last` alone)
                    if fisher == "mc":
                        factor = _mc_factor(likelihood, out2.detach(), mc_samples, gen)
                    else:
                        factor = hessian_factor(likelihood, out2.detach()).to(out2)
                    scales = {n: f.scale for n, f in folds.items() if f.used}
                    local_grads = _backward(out2, factor, rest, seen, conv, local, scales)
                    # a folded BatchNorm's input is the convolution's output its fold kept
                    pre = {f.bn_name: f.pre for f in folds.values() if f.used}
                    for m, cols in zip(local, local_grads):
                        _local_diagonal_sums(
                            m, pre.get(m.name, seen[m.name][0][0]), cols, diagonal[m.name],
                            diag_sums,
                        )  # fmt: skip
                    if whole:  # modules without a local Jacobian: through the whole network
                        others = {n: diag_sums[n] for m in whole for n in diagonal[m]}
                        _diagonal_sums(net, named, others, xc, factor)
                        diag_sums.update(others)
                for f in folds.values():
                    f.pre = f.scale = None
                del out, seen
                count += n

    for lay in layers:  # `_backward` adds the columns' products into the lower triangle
        if lay.G is not None:
            symmetrize_(lay.G, upper=False)
    _fill_zeros(layers, diag_sums, named, device)  # a shard without rows adds zeros
    # one all_reduce over the ranks for every sum (float64)
    sums = [count] + [t for lay in layers for t in (lay.A, lay.G)] + list(diag_sums.values())
    reduced = distributed.all_reduce_sum(*sums)  # a tuple: there are always two or more
    count, rest = round(reduced[0]), list(reduced[1:])
    for lay in layers:
        lay.A, lay.G = rest.pop(0), rest.pop(0)
    for name in diag_sums:
        diag_sums[name] = rest.pop(0)
    if count == 0:
        raise ValueError("x: the data source yielded no rows")
    return _assemble(net, layers, diagonal, diag_sums, count, out_dtype, fisher, conv, bias)


def _hooked_forward(
    net: nn.Module,
    layers: list[_Layer],
    x: torch.Tensor,
    folds: dict[str, _Fold] | None = None,
    links: dict | None = None,
):
    """``net(x)`` with forward hooks keeping every K-FAC layer's ``(input, output)``; the
    outputs require grad (a leaf where nothing before them does), and the network continues
    with a clone, so later in-place ops (``ReLU(inplace=True)``) do not rebase them.

    ``folds`` (`_fold_pairs`): each folded convolution runs as `_FoldedConvBN` and its
    BatchNorm as the identity, for this pass. ``links``: filled with each layer's raw input and
    the clone it returned (``{name: (input, clone)}``), from which `_fold_pairs` finds the
    pairs."""
    seen: dict[str, list] = {lay.name: [] for lay in layers}
    folds = folds or {}

    def hook(name: str):
        def keep(module, inp, out):
            if not isinstance(out, torch.Tensor) or not inp or not isinstance(inp[0], torch.Tensor):
                seen[name].append((None, None))
                return None
            z = out if out.requires_grad else out.detach().requires_grad_(True)
            seen[name].append((inp[0].detach(), z))
            clone = z.clone()
            if links is not None:
                links[name] = (inp[0], clone)
            return clone

        return keep

    # first (hooks run in order): an eval-mode BatchNorm's output as `_affine_batchnorm`'s
    folded_bns = {id(f.bn) for f in folds.values()}
    handles = [
        m.register_forward_hook(_affine_batchnorm)
        for m in net.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and _uses_running_stats(m)
        and id(m) not in folded_bns
    ]
    handles += [lay.module.register_forward_hook(hook(lay.name)) for lay in layers]
    try:
        for f in folds.values():  # instance attributes: the classes' forward is untouched
            f.conv.forward, f.bn.forward = f.forward, _identity
        out = batching.call(net, x)  # a mapping by `batch`'s rule; a ModelOutput's logits
    finally:
        for f in folds.values():
            del f.conv.forward, f.bn.forward
        for h in handles:
            h.remove()
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"net: expected a tensor output (N, O), got {type(out).__name__}")
    return out, seen


def _channels_last_forward(
    net: nn.Module, layers: list[_Layer], x: torch.Tensor, folds: dict, links: dict | None
):
    """`_hooked_forward` on a channels-last copy of the 4-D inputs ``x``, or ``(None, None)``
    where the network does not take that layout (it raised: ``.view`` of its input or of a
    convolution's output, whose strides are no longer those of a contiguous tensor, or a check
    of its own); the caller then runs the pass on ``x`` as it is (an error of the network's
    own is raised there)."""
    fast = x.contiguous(memory_format=torch.channels_last)
    try:
        return _hooked_forward(net, layers, fast, folds, links)
    except Exception:
        if fast is x:  # already the user's layout: the network's own error
            raise
        if links:
            links.clear()
        for f in folds.values():  # what a folded convolution kept of the failed pass
            f.pre = f.scale = None
        return None, None


def _one_row_pass(net: nn.Module, layers: list[_Layer], x) -> tuple[dict, int]:
    """`_hooked_forward`'s ``seen`` (every hooked call's input and output) for the first row of
    ``x``, and the bytes its autograd graph would save for a backward pass (activations; a
    storage shared with a parameter is not counted, and a storage saved twice while alive
    once). Nothing is kept for the backward pass: the probe's peak is a no-grad forward's."""
    own = {p.untyped_storage().data_ptr() for p in net.parameters()}
    alive: dict[int, weakref.ref] = {}  # storage address -> the tensor last saved there
    total = 0

    def pack(t: torch.Tensor) -> None:
        nonlocal total
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in own:
            return None
        last = alive.get(ptr)
        if last is None or last() is None:  # a new storage (or a freed one's address reused)
            total += storage.nbytes()
        alive[ptr] = weakref.ref(t)
        return None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, seen = _hooked_forward(net, layers, batching.take(x, slice(0, 1)))
    del out
    detached = {k: [(a, None if z is None else z.detach()) for a, z in v] for k, v in seen.items()}
    return detached, total


def _sums_bytes(layers: list[_Layer]) -> int:
    """The float64 factor sums' bytes: ``A`` ``(in, in)`` and ``G`` ``(out, out)`` per layer."""
    total = 0
    for lay in layers:
        w = lay.weight
        if w is None:  # the bias alone: its G only
            total += 8 * lay.bias.shape[0] ** 2
            continue
        if lay.transposed:  # GPT-2's Conv1D stores W as (in, out)
            fan_in, fan_out = w.shape[0], w.shape[1]
        else:
            fan_in, fan_out = w[0].numel(), w.shape[0]
        total += 8 * ((fan_in + lay.augment) ** 2 + fan_out**2)
    return total


def _rows_within_memory(graph_row: int, sums: int, batch: int) -> int:
    """Rows per pass so that the pass's graph and the factor sums together hold no more than
    one training step's graph on ``batch`` rows (``graph_row`` bytes a row), within one row's
    graph. A LoRA adapter on GPT-2 small sums 12 × 2304² float64 numbers for its ``B``
    factors (0.5 GB) beside a graph of 57 MB a sequence: with passes of the loader's 8
    sequences it peaked at 1.84 times the adapter's training step. Never fewer than a quarter
    of ``batch``, where the sums alone exceed the step's graph: smaller passes would save
    little and run the ``C`` backward passes many more times (ResNet-18 from a loader of 128
    images: 32-image passes, its 0.7 GB of sums beside 4.6 MB a row). A network whose sums are
    small beside its graph keeps its passes; tensors and datasets are passed in ``chunk_size``
    rows as asked (`kfac`)."""
    if graph_row <= 0 or batch <= 1:
        return max(1, batch)
    spare = -(-(batch * graph_row - sums) // graph_row)  # rounded up: within one row's graph
    return max(1, -(-batch // 4), min(batch, spare))


def _rows_per_pass(seen: dict, chunk: int) -> int:
    """``chunk``, or fewer rows so that no K-FAC layer's output holds more than `PASS_NUMBERS`
    numbers (measured by `_one_row_pass`'s ``seen``), but not fewer than `MIN_PASS_ROWS`."""
    widest = max(
        (z.numel() for calls in seen.values() for _, z in calls if z is not None), default=1
    )
    return max(1, min(chunk, max(MIN_PASS_ROWS, PASS_NUMBERS // widest)))


def _backward(
    out2, factor, layers, seen, conv: str, local=(), scales=None
) -> list[list[torch.Tensor]]:
    """``G += Σ_c g_cᵀ g_c`` per layer: one backward pass per column ``c`` of ``factor``
    ``(n, O, C)`` to the layers' outputs (curvlinops does the same per column); each column's
    products are added in float64 straight into the layer's sum, its lower triangle (BLAS
    ``syrk``; `kfac` symmetrises the sums after the pass): no ``(out, out)`` sum per chunk and
    layer beside it (LoRA's ``B`` on GPT-2 small: 12 × 2304² numbers). ``scales``
    ``{layer name: s}``: a folded convolution's columns were taken at its BatchNorm's output
    (`_Fold`), so its sum is ``diag(s) (Σ g'ᵀg') diag(s)``."""
    if not layers and not local:
        return []
    # every call's output: a layer applied twice sums the products of both calls
    owner = [i for i, lay in enumerate(layers) for _ in seen[lay.name]]
    zs = [z for lay in layers for _, z in seen[lay.name]]
    local_zs = [seen[m.name][0][1] for m in local]
    local_cols: list[list[torch.Tensor]] = [[] for _ in local]
    cols = factor.shape[-1]
    chunk_sums: list[torch.Tensor | None] = [None for _ in layers]
    for c in range(cols):
        grads = torch.autograd.grad(
            (out2 * factor[:, :, c]).sum(), zs + local_zs, retain_graph=c + 1 < cols,
            allow_unused=True,
        )  # fmt: skip
        for i, g in enumerate(grads[len(zs):]):
            local_cols[i].append(torch.zeros_like(local_zs[i]) if g is None else g.detach())
        for i, g in zip(owner, grads[: len(zs)]):
            if g is None:  # the call does not reach the outputs
                continue
            lay = layers[i]
            if lay.name in (scales or {}):  # a folded convolution: this chunk's sum is scaled
                chunk_sums[i] = _grad_gram(lay, g, conv, chunk_sums[i])  # in place
            else:  # straight into the float64 sum: no (out, out) sum per chunk and layer
                lay.G = _grad_gram(lay, g.double(), conv, lay.G)  # its lower triangle
    for lay, total in zip(layers, chunk_sums):
        if total is not None:
            symmetrize_(total, upper=False)  # the rows' products fill the lower triangle
            s = scales[lay.name]
            _add_sum(lay, total * s[:, None] * s[None, :])
    return local_cols


def _is_output(lay: _Layer, seen: dict, out2: torch.Tensor) -> bool:
    """The network's outputs are this Linear layer's (the clone its hook returned, possibly
    reshaped to 2-D): then ``∂f/∂z = I``."""
    if len(seen[lay.name]) != 1:
        return False
    z = seen[lay.name][0][1]
    fn = out2.grad_fn
    while fn is not None and type(fn).__name__ in ("ViewBackward0", "ReshapeAliasBackward0"):
        fn = fn.next_functions[0][0]
    if lay.conv or z.shape != out2.shape or fn is None or type(fn).__name__ != "CloneBackward0":
        return False
    return fn.next_functions[0][0] is z.grad_fn


def _add_sum(lay: _Layer, g: torch.Tensor) -> None:
    """``lay.G += g`` in float64, in place after the first chunk (no ``(out, out)`` float64
    temporary per chunk)."""
    lay.G = g.double() if lay.G is None else lay.G.add_(g)
