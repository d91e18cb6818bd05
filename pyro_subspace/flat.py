"""A network as a function of one flat weight vector.

`FlatNet(net)(w, x)` evaluates ``net`` at the weights ``w`` without touching the network's own
parameters: ``torch.func.functional_call`` does the work, buffers (BatchNorm running statistics)
are passed through unchanged, and a batch of weight vectors ``(..., D)`` is evaluated at once with
``torch.func.vmap``. The flat order is that of
``torch.nn.utils.parameters_to_vector(net.parameters())``: every `Subspace`, index and basis in
this library refers to positions in it. `FlatNet.evaluate` takes a dict of some parameters (and
buffers, one set per draw if wanted) instead; `FlatNet.recompute_batchnorm` sets BatchNorm's
statistics to those of given data at given weights.

`preserved` is the library's one state restorer: it saves every module's train/eval flag (and
optionally every buffer) and puts them back on any exit, exceptions included; `eval_mode` and
`train_mode` are built on it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.func import functional_call, vmap

from . import batch as batching
from .validation import positive_int


class FlatNet:
    """View of ``net`` as ``f(w, x)`` for a flat weight vector ``w`` of length ``D``.

    Args:
        net: any ``torch.nn.Module`` whose forward takes one input tensor.
        batch_strategy: how a batch of weight vectors is evaluated: ``"vmap"``
            (``torch.func.vmap``, one batched call), ``"loop"`` (one functional call per
            vector), or ``"auto"``: vmap on accelerators, loop on CPU, where
            ``benchmarks/vectorised_predictions.py`` measures batched matmuls over draws to be
            slower than consecutive ones. All give the same numbers.

    Example:
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> flat = FlatNet(net)
        >>> w = torch.randn(5, flat.num_weights)          # five weight vectors
        >>> flat(w, torch.randn(10, 3)).shape
        torch.Size([5, 10, 1])
    """

    def __init__(self, net: nn.Module, batch_strategy: str = "auto") -> None:
        if not isinstance(net, nn.Module):
            raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        if batch_strategy not in ("auto", "vmap", "loop"):
            raise ValueError(
                f"batch_strategy: expected 'auto', 'vmap' or 'loop', got {batch_strategy!r}"
            )
        self.batch_strategy = batch_strategy
        params = flat_parameters(net)
        if not params:
            if any(True for _ in net.parameters()):
                raise ValueError(
                    "net: every parameter has requires_grad=False: no weights to infer (the "
                    "flat vector holds the trainable ones); unfreeze those to infer, e.g. "
                    "net[-1].requires_grad_(True)"
                )
            raise ValueError("net: the network has no parameters")
        self.net = net
        self.params = [p for _, p in params]
        self.names = [name for name, _ in params]
        self.shapes = [p.shape for _, p in params]
        self.numels = [p.numel() for _, p in params]
        self.num_weights = sum(self.numels)
        self._shape_of = dict(zip(self.names, self.shapes))
        self._plain = _plain_layers(net)
        ends = list(itertools.accumulate(self.numels))
        self._bounds = list(zip([0, *ends[:-1]], ends))
        self._modules_seen = list(net.modules()) if self._plain is not None else []

    def vector(self) -> torch.Tensor:
        """The network's current trainable weights as one detached vector, shape ``(D,)``."""
        return nn.utils.parameters_to_vector(self.params).detach().clone()

    def load_vector(self, w: torch.Tensor) -> None:
        """Copy the flat weights ``w`` (shape ``(D,)``) into the network's trainable
        parameters, in place (the frozen ones are not touched)."""
        self.check_weights(w, "w", batched=False)
        with torch.no_grad():  # in place: the parameters never become views of ``w``
            # (torch's vector_to_parameters rebinds each .data to a slice of the vector, so a
            # later write to either, a training step or the caller's, changed the other)
            for p, chunk in zip(self.params, torch.split(w.detach(), self.numels)):
                p.copy_(chunk.view_as(p))

    def unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split ``w`` of shape ``(..., D)`` into ``{name: (..., *param.shape)}`` views."""
        chunks = torch.split(w, self.numels, dim=-1)
        batch = w.shape[:-1]
        return {n: c.reshape(*batch, *s) for n, c, s in zip(self.names, chunks, self.shapes)}

    def check_weights(self, w: torch.Tensor, name: str = "w", batched: bool = True) -> None:
        """Raise ``TypeError``/``ValueError`` unless ``w`` is a float tensor ``(..., D)``."""
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            raise TypeError(
                f"{name}: expected a floating-point torch.Tensor, got {type(w).__name__}"
            )
        if w.dim() == 0 or w.shape[-1] != self.num_weights or (not batched and w.dim() != 1):
            want = f"(..., {self.num_weights})" if batched else f"({self.num_weights},)"
            raise ValueError(
                f"{name}: expected shape {want} for this network, got {tuple(w.shape)}"
            )

    def __call__(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Evaluate the network at weights ``w`` on inputs ``x``.

        Args:
            w: flat weights, shape ``(D,)`` or ``(*batch, D)``.
            x: inputs, shape ``(N, *in_shape)`` or a mapping of such tensors (passed by
                `batch.call_args`' rule), shared by every weight vector.

        Returns:
            Outputs of shape ``(N, *out_shape)`` or ``(*batch, N, *out_shape)`` (a tuple's first
            element, a ``ModelOutput``'s ``logits``: `batch.output`).

        The network runs in whatever mode it is in (see `eval_mode`); a batch in training mode
        is evaluated vector by vector, as in `evaluate`.
        """
        on_cpu = batching.device_of(x).type == "cpu"
        loop = self.batch_strategy == "loop" or (self.batch_strategy == "auto" and on_cpu)
        if (
            isinstance(x, torch.Tensor)
            and self._plain is not None
            and (w.dim() == 1 or (w.dim() == 2 and loop and w.shape[0] > 0))
            and (w.shape[-1] == self.num_weights)
        ):
            if not hooked(self._modules_seen):  # the flat vector's slices, no dict
                one = lambda v: self._plain_forward(dict(zip(self.names, self._slices(v))), x)
                return one(w) if w.dim() == 1 else torch.stack([one(v) for v in w])
        return self.evaluate(self.unflatten(w), x)

    def _slices(self, w: torch.Tensor):
        return (w[a:b].view(s) if w.is_contiguous() else w[a:b].reshape(s)
                for (a, b), s in zip(self._bounds, self.shapes))  # fmt: skip

    def evaluate(
        self,
        params: Mapping[str, torch.Tensor],
        x: torch.Tensor,
        buffers: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Evaluate the network with some or all of its parameters (and buffers) replaced.

        ``torch.func.functional_call`` does the work; the network's own tensors are never
        changed, except that BatchNorm in training mode updates the running statistics it is
        given in place (the network's own, unless ``buffers`` replaces them).

        Args:
            params: ``{parameter name: (*batch, *shape)}``, any subset of the network's
                parameters, all with the same leading ``batch`` shape; the others keep the
                network's values.
            x: inputs ``(N, *in_shape)``, shared by every draw.
            buffers: ``{buffer name: tensor}`` replacing those buffers, each either of the
                buffer's own shape (shared by all draws) or ``(*batch, *shape)`` (one per draw,
                e.g. an ensemble member's BatchNorm statistics).

        Returns:
            Outputs ``(*batch, N, *out_shape)``. A batch is evaluated with ``vmap`` or a loop as
            ``batch_strategy`` says, and always with a loop in training mode: BatchNorm then
            updates its statistics in place, which ``vmap`` refuses. In the loop, per-draw
            buffers are passed as views ``buffers[name][i]``, so their updates reach the tensor
            given.
        """
        batch = self._batch_shape(params)
        buffers = {} if buffers is None else dict(buffers)
        own = dict(self.net.named_buffers()) if buffers else {}
        for name in buffers:
            if name not in own:
                raise ValueError(f"buffers: the network has no buffer named {name!r}")
        plain = (
            self._plain is not None
            and isinstance(x, torch.Tensor)
            and not hooked(self._modules_seen)
        )
        args, kwargs = batching.call_args(self.net, x)
        if not batch:
            if plain:
                return self._plain_forward(params, x)
            return batching.output(functional_call(self.net, {**params, **buffers}, args, kwargs))
        per_draw = {k: v for k, v in buffers.items() if v.dim() > own[k].dim()}
        shared = {k: v for k, v in buffers.items() if k not in per_draw}
        size = math.prod(batch)
        flat_p = {k: v.reshape(size, *v.shape[len(batch) :]) for k, v in params.items()}
        flat_b = {k: v.reshape(size, *v.shape[len(batch) :]) for k, v in per_draw.items()}

        def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> torch.Tensor:
            if plain:
                return self._plain_forward(p, x)
            return batching.output(functional_call(self.net, {**p, **b, **shared}, args, kwargs))

        strategy = self.batch_strategy
        if strategy == "auto":
            strategy = "loop" if batching.device_of(x).type == "cpu" else "vmap"
        out = None
        if strategy == "vmap" and not self.net.training:
            try:
                out = vmap(one, in_dims=(0, 0))(flat_p, flat_b)
            except (RuntimeError, NotImplementedError):  # no batching rule (e.g. RNNs): loop
                out = None
        if out is None:
            out = torch.stack(
                [
                    one({k: v[i] for k, v in flat_p.items()}, {k: v[i] for k, v in flat_b.items()})
                    for i in range(size)
                ]
            )
        return out.reshape(*batch, *out.shape[1:])

    @property
    def mode_free(self) -> bool:
        """The network computes the same in training and eval mode: an ``nn.Sequential`` of
        ``nn.Linear`` and parameter-free elementwise activations (no Dropout, no BatchNorm)."""
        return self._plain is not None

    def _plain_forward(self, params: Mapping[str, torch.Tensor], x: torch.Tensor):
        """``nn.Sequential`` of ``nn.Linear`` and elementwise activations, evaluated layer by
        layer with ``F.linear`` (what ``nn.Linear.forward`` computes, so the same numbers as
        ``functional_call``) without its per-call swapping of every parameter: a small
        network's likelihood costs several times its arithmetic through ``functional_call``."""
        h = x
        for module, weight, bias in self._plain:
            if weight is None:
                h = module.forward(h)
            else:
                b = None if bias is None else params.get(bias, module.bias)
                h = nn.functional.linear(h, params.get(weight, module.weight), b)
        return h

    def _batch_shape(self, params: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
        """The common leading batch shape of ``params``; raises naming a wrong name or shape."""
        batch = None
        for name, value in params.items():
            shape = self._shape_of.get(name)
            if shape is None:
                raise ValueError(f"params: the network has no parameter named {name!r}")
            lead = value.dim() - len(shape)
            if lead < 0 or value.shape[lead:] != shape:
                raise ValueError(
                    f"params: {name!r} must have shape (*batch, {', '.join(map(str, shape))}), "
                    f"got {tuple(value.shape)}"
                )
            if batch is None:
                batch = tuple(value.shape[:lead])
            elif tuple(value.shape[:lead]) != batch:
                raise ValueError(
                    f"params: {name!r} has batch shape {tuple(value.shape[:lead])}, others {batch}"
                )
        return batch or ()

    def recompute_batchnorm(
        self,
        w: torch.Tensor | Mapping[str, torch.Tensor],
        x: torch.Tensor | Iterable[torch.Tensor],
        chunk_size: int | None = None,
    ) -> None:
        """Set every BatchNorm layer's running statistics to those of the data ``x`` at ``w``.

        The statistics are reset and recomputed by training-mode passes over ``x`` in chunks of
        ``chunk_size`` rows (``None``: one pass), each chunk weighted by its size (BatchNorm's
        ``momentum`` set to ``chunk / rows so far``; with one chunk the statistics are exactly
        the batch statistics of ``x``). Used to evaluate a network at weights it was not
        trained at (Subspace Inference C.3, curve losses; elliptical slice proposals). Modes
        and momenta are restored; the buffers are changed on purpose: wrap the call in
        ``preserved(net, buffers=True)`` to keep the user's. No-op without BatchNorm.

        Args:
            w: flat weights ``(D,)`` or a ``{parameter name: tensor}`` dict (as `evaluate`).
            x: data ``(N, *in_shape)``, or an iterable of such chunks (streamed data; then
                ``chunk_size`` is not used).
            chunk_size: rows per pass.
        """
        positive_int(chunk_size, "chunk_size", allow_none=True)
        bn = [m for m in self.net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if not bn:
            return
        params = self.unflatten(w) if isinstance(w, torch.Tensor) else dict(w)
        if isinstance(x, torch.Tensor) or batching.is_mapping(x):
            x = batching.split(x, batching.rows(x) if chunk_size is None else chunk_size)
        momenta = [m.momentum for m in bn]
        with torch.no_grad(), train_mode(self.net):
            try:
                for m in bn:
                    m.reset_running_stats()
                seen = 0
                for chunk in x:
                    seen += batching.rows(chunk)
                    for m in bn:  # a cumulative average over the chunks, weighted by size
                        m.momentum = batching.rows(chunk) / seen
                    self.evaluate(params, chunk)
            finally:
                for m, momentum in zip(bn, momenta, strict=True):
                    m.momentum = momentum

    def chunked(self, w: torch.Tensor, x: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
        """Like ``self(w, x)`` but runs the data in chunks of ``chunk_size`` rows.

        Memory is bounded by the chunk, not by ``N``; outputs are concatenated along the data
        dimension, shape ``(*batch, N, *out_shape)``.
        """
        positive_int(chunk_size, "chunk_size")
        n = batching.rows(x)
        if n <= chunk_size:
            return self(w, x)
        dim = w.dim() - 1
        parts = [self(w, batching.take(x, slice(i, i + chunk_size))) for i in range(0, n, chunk_size)]
        return torch.cat(parts, dim=dim)


class Preserved:
    """The saved state of some modules, as yielded by `preserved`.

    ``keep_changes()`` tells `preserved` not to put back the weights and buffers on exit (the
    modes still are): a training loop that diverges restores a checkpoint of its own and then
    keeps it (`fit_map`). ``restore()`` puts the saved state back now.
    """

    def __init__(
        self, modules: tuple[nn.Module, ...], modes: object, buffers: object, weights: object
    ) -> None:
        self.modules = modules
        self._modes = modes
        self._buffers = buffers
        self._weights = weights
        self._kept = False
        self.saved_modes = (
            [(m, m.training) for net in modules for m in net.modules()] if modes else []
        )
        tensors: list[torch.Tensor] = []
        if buffers:
            tensors += [b for net in modules for b in net.buffers()]
        if weights:
            tensors += [p for net in modules for p in net.parameters()]
        seen: set[int] = set()
        self.saved_tensors = []
        for t in tensors:  # a module listed twice (or a submodule of another) is saved once
            if id(t) not in seen:
                seen.add(id(t))
                self.saved_tensors.append((t, t.detach().clone()))

    def keep_changes(self) -> None:
        """Keep the current weights and buffers when the block exits (modes are restored)."""
        self._kept = True

    def refresh(self) -> None:
        """Save the current weights and buffers again, into the copies already held (one
        multi-tensor copy, no new memory): a training loop's per-epoch checkpoint."""
        if self.saved_tensors:
            with torch.no_grad():
                torch._foreach_copy_(
                    [v for _, v in self.saved_tensors], [t for t, _ in self.saved_tensors]
                )

    def restore(self, failed: bool = True) -> None:
        """Put back what was saved: all of it after a failure (``failed``), on a normal exit
        only what was asked to be restored always (``True``, not ``"error"``)."""

        def wanted(flag: object) -> bool:
            return bool(flag) and (failed or flag is True)

        if not self._kept:
            restore_buffers, restore_weights = wanted(self._buffers), wanted(self._weights)
            if restore_buffers or restore_weights:
                buffer_ids = {id(b) for net in self.modules for b in net.buffers()}
                with torch.no_grad():
                    for t, value in self.saved_tensors:
                        is_buffer = id(t) in buffer_ids
                        if (restore_buffers and is_buffer) or (restore_weights and not is_buffer):
                            t.copy_(value)
        if wanted(self._modes):
            for m, training in self.saved_modes:
                m.training = training


def _check_when(value: object, name: str) -> object:
    if value not in (True, False, "error"):
        raise ValueError(f"{name}: expected True, False or 'error', got {value!r}")
    return value


@contextlib.contextmanager
def preserved(
    *modules: nn.Module,
    modes: bool | str = True,
    buffers: bool | str = False,
    weights: bool | str = False,
) -> Iterator[Preserved]:
    """Save the state of ``modules`` on entry and put it back on exit, exceptions included.

    The one place in the library that saves and restores module state: `eval_mode`,
    `train_mode`, the training loops (`fit_map`, `PatchedNet.fit`, `fit_curve`), the
    BatchNorm refresh of `Evaluator` (elliptical slice sampling) and `PatchedNet` all go
    through it. Restoring happens in a ``finally`` clause, so it also runs on
    ``KeyboardInterrupt`` and other ``BaseException`` s: an interrupted method leaves the
    user's networks as it found them.

    Args:
        *modules: the networks whose state is kept (each with all its submodules).
        modes: restore every submodule's own ``training`` flag, so a mixed train/eval setting
            the user chose comes back exactly.
        buffers: restore the values of every buffer (BatchNorm running statistics and
            ``num_batches_tracked``), copied back in place into the same tensors.
        weights: restore the values of every parameter, in place.

        Each flag is ``True`` (restore on any exit), ``False`` (never) or ``"error"``
        (restore only when the block raises: a training loop keeps its result, an
        interrupted one leaves nothing half-done).

    Yields:
        A `Preserved` handle (``keep_changes()``: keep the weights and buffers as they are).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)).eval()
        >>> with preserved(net, buffers=True):
        ...     _ = net.train()
        ...     _ = net(torch.randn(8, 2))  # updates the BatchNorm statistics ...
        >>> net.training, net[1].running_mean  # ... which are restored, as is the mode
        (False, tensor([0., 0., 0.]))
    """
    state = Preserved(
        modules,
        _check_when(modes, "modes"),
        _check_when(buffers, "buffers"),
        _check_when(weights, "weights"),
    )
    failed = True
    try:
        yield state
        failed = False
    finally:
        state.restore(failed)


@contextlib.contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[nn.Module]:
    """Put ``modules`` in eval mode for the duration of the block, then restore every module's mode.

    The user's per-module ``training`` flags are saved and put back exactly (`preserved`), also
    when the block raises. Yields the first module.
    """
    with preserved(*modules):
        for m in modules:
            m.eval()
        yield modules[0]


@contextlib.contextmanager
def train_mode(*modules: nn.Module) -> Iterator[nn.Module]:
    """Put ``modules`` in training mode for the block, then restore every module's mode.

    Buffers are not restored: training updates BatchNorm running statistics on purpose (use
    ``preserved(net, buffers=True)`` to discard them). Yields the first module.
    """
    with preserved(*modules):
        for m in modules:
            m.train()
        yield modules[0]


#: Parameter-free modules that act elementwise (or only reshape) and do not depend on the mode.
ELEMENTWISE = (
    nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Softplus,
    nn.Identity, nn.Flatten,
)  # fmt: skip


def _plain_layers(net: nn.Module) -> list | None:
    """``[(module, weight name, bias name)]`` (names ``None`` for an activation) when ``net`` is
    exactly an ``nn.Sequential`` of ``nn.Linear`` and `ELEMENTWISE` modules, else ``None``."""
    if type(net) is not nn.Sequential:
        return None
    layers = []
    for name, m in net.named_children():
        if type(m) is nn.Linear:
            bias = f"{name}.bias" if m.bias is not None else None
            layers.append((m, f"{name}.weight", bias))
        elif type(m) in ELEMENTWISE and not list(m.parameters()) and not list(m.buffers()):
            layers.append((m, None, None))
        else:
            return None
    return layers


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooked(modules: list[nn.Module]) -> bool:
    """A hook on one of ``modules`` or on every module (``register_module_forward_hook``): such
    a network must run through its modules' ``__call__`` as they are (`FlatNet`'s plain path,
    K-FAC's folded Conv2d + BatchNorm pass)."""
    glob = torch.nn.modules.module
    if any(getattr(glob, f"_global{h}", None) for h in _HOOKS):
        return True
    return any(getattr(m, h) for m in modules for h in _HOOKS)


@torch.no_grad()
def flush_subnormal_(*tensors: torch.Tensor) -> int:
    """Set the subnormal entries (``0 < |x| < torch.finfo(dtype).tiny``) of floating-point
    ``tensors`` to zero, in place; returns how many there were.

    Weight decay drives the weights of dead ReLU units towards zero geometrically, so after a few
    thousand steps they become subnormal floats; a CPU computes with subnormals many times more
    slowly (a toy 2-200-50-50-50-1 network trained 2000 epochs with weight decay 1e-4 had 16% of
    its weights subnormal, and every later forward pass ran about 5 times slower). Their values
    are below 1.2e-38 (float32), so setting them to zero changes no output beyond rounding."""
    groups: dict = {}  # one test per dtype and device over all tensors laid end to end
    for t in tensors:
        if t is not None and t.is_floating_point() and t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    count = 0
    for (dtype, _), ts in groups.items():
        tiny = torch.finfo(dtype).tiny
        a = torch.cat([t.detach().reshape(-1) for t in ts]).abs_()
        if not bool(((a < tiny) & (a > 0)).any()):
            continue  # the usual case: a few operations for all the tensors
        for t in ts:
            sub = (t != 0) & (t.abs() < tiny)
            n = int(sub.sum())
            if n:
                t.masked_fill_(sub, 0)
                count += n
    return count


def per_coordinate(value: torch.Tensor, size: int) -> torch.Tensor:
    """``value`` (0-d or ``(size,)``) as a ``(size,)`` per-coordinate buffer: one number
    expanded (zero stride, one element of memory) when every entry is equal, as a scalar prior
    precision's is, else a contiguous copy. Such a buffer is written by replacement, never in
    place (`transaction` keeps expanded tensors by reference); a module holding one calls
    `writable_buffers_` before a ``state_dict`` is copied into it."""
    flat = value.detach().reshape(-1)
    if flat.numel() == 1 or (flat.numel() and 0 in flat.stride()) or bool((flat == flat[0]).all()):
        return flat[:1].clone().expand(size)
    return flat.clone()


def writable_buffers_(module: nn.Module, names: Iterable[str]) -> None:
    """Give the expanded (zero-stride) buffers ``names`` of ``module`` memory of their own, so
    that ``load_state_dict`` can copy into them."""
    for name in names:
        buf = module._buffers.get(name)
        if buf is not None and buf.numel() > 1 and 0 in buf.stride():
            module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=buf.device)


def flat_parameters(net: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``[(name, parameter)]`` of the flat weight vector, in order: the parameters with
    ``requires_grad``, in ``net.named_parameters()`` order (a shared one once).

    The one rule of the library (DESIGN, conventions): every subspace, index, basis,
    collector snapshot and ensemble member refers to positions in this vector. Frozen
    weights (a pretrained base under a LoRA adapter) are read where the network uses them
    and never copied, so memory follows the trainable weights. For a network with nothing
    frozen this is ``parameters_to_vector(net.parameters())``'s order."""
    return [(n, p) for n, p in net.named_parameters() if p.requires_grad]


def flat_offsets(net: nn.Module) -> dict[str, tuple[int, int]]:
    """``{parameter name: (start, stop)}`` of each trainable parameter in the flat vector
    (`flat_parameters`)."""
    out, start = {}, 0
    for name, p in flat_parameters(net):
        out[name] = (start, start + p.numel())
        start += p.numel()
    return out


def check_saved_length(name: str, saved: object, want: int) -> None:
    """A ``ValueError`` naming ``name`` when a saved flat vector ``(..., D')`` (a subspace's shift,
    a collector's mean) does not have this network's ``D`` entries: a state saved for another
    network, or, for a network with frozen weights, under the former convention in which the
    flat vector held every parameter. Refused rather than misread (indices would point at
    other weights)."""
    if isinstance(saved, torch.Tensor) and saved.dim() >= 1 and saved.shape[-1] != want:
        raise ValueError(
            f"{name}: the saved state is for a flat vector of {saved.shape[-1]} weights, this "
            f"network's holds {want} (its parameters with requires_grad, `flat_parameters`); a "
            "state saved for another network, or for a network with frozen weights before the "
            "flat vector held only the trainable ones, is refused rather than misread: rebuild "
            "it from the network, freezing the same parameters as when it was saved"
        )


def num_weights(net: nn.Module) -> int:
    """Length ``D`` of the flat weight vector of ``net`` (its trainable weights)."""
    return sum(math.prod(p.shape) for _, p in flat_parameters(net))
