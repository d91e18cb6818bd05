"""`minibatch_loop`: the one minibatch training loop of the library.

`fit_map` (MAP and the SWA phase), `fit_curve` (the Bezier control point) and `PatchedNet.fit`
(plain torch or Pyro's ``SVI``) differ only in what one step computes; the epochs, the shuffling,
the optimiser calls, the divergence check, the per-epoch loss, the per-epoch callback and the
progress bar live here.

Data-parallel training (``data_parallel=True`` under an initialised process group, see
`distributed`): every rank runs this loop over its own shard, in lockstep; after each backward
pass `distributed.reduce_gradients` turns the ranks' gradients into that of the mean loss over
all of their minibatches (one ``all_reduce``), so every rank takes the same optimiser step. A
step on two ranks with minibatches ``b_0`` and ``b_1`` is then the step one process takes on
the minibatch ``b_0 ∪ b_1`` (full batch: the same training, to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from . import batch as batching
from . import distributed
from .exceptions import TrainingDivergedError
from .data import split_batch
from .flat import flush_subnormal_

EPOCH_LOSSES = ("points", "batches")


def _kernel_option(params: Iterable[Any], kernel: str) -> dict[str, bool]:
    """``{kernel: True}`` when every parameter (tensors, or param-group dicts holding them) is
    floating point on CPU or CUDA, the devices torch has its fused and multi-tensor optimiser
    kernels for; else ``{}`` (the default per-tensor implementation)."""
    tensors = []
    for p in params:
        tensors += list(p["params"]) if isinstance(p, dict) else [p]
    supported = {"cpu", "cuda"}
    ok = bool(tensors) and all(
        isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type in supported
        for t in tensors
    )
    return {kernel: True} if ok else {}


def fused_option(params: Iterable[Any]) -> dict[str, bool]:
    """``{"fused": True}`` for ``torch.optim.Adam``/``SGD`` when every parameter (tensors, or
    param-group dicts holding them) can take PyTorch's fused kernel: floating point, on one of
    the devices torch has fused optimiser kernels for (CPU and CUDA); else ``{}`` (the default
    per-tensor implementation). The same update rule, to rounding (float32: a few ulps after
    100 steps), in one kernel per step instead of about ten operations per tensor: Adam on the
    digits MLP's ten tensors takes 74 instead of 264 µs a step on one CPU thread, a fifth of a
    plain training step."""
    return _kernel_option(params, "fused")


def foreach_option(params: Iterable[Any]) -> dict[str, bool]:
    """``{"foreach": True}`` for ``torch.optim.Adam``/``SGD`` under the same condition as
    `fused_option`: the multi-tensor implementation, one ``torch._foreach_*`` call per
    operation for all the tensors instead of one Python call per operation and tensor.

    Unlike the fused kernel it computes **the same numbers bit for bit** as the default
    per-tensor implementation on CPU (there the ``_foreach_*`` operations run the per-tensor
    kernels one after the other in C++; test: equal weights after 30 steps of Adam and SGD), so
    a fit keeps the exact trajectory of a user's own loop; on CUDA it is what torch already
    chooses by default. Adam on the digits MLP's ten tensors: about a tenth of a plain training
    step less, on one CPU thread."""
    return _kernel_option(params, "foreach")


def shuffle_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for the minibatch order, seeded by ``seed``.

    With ``seed=None`` its seed is one draw from torch's global generator, so that
    ``torch.manual_seed`` alone makes training reproducible; the global generator advances by
    that one draw and is never re-seeded.
    """
    gen = torch.Generator(device="cpu")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    gen.manual_seed(seed)
    return gen


def minibatch_loop(
    step: Callable[[torch.Tensor], torch.Tensor | float],
    num_data: int,
    *,
    epochs: int,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: torch.device | str | None = None,
    min_batch_size: int = 1,
    epoch_loss: str = "points",
    on_epoch: Callable[[int, float], None] | None = None,
    desc: str = "training",
    progress: bool = False,
    data_parallel: bool = False,
) -> list[float]:
    """Run ``epochs`` shuffled passes over ``num_data`` points in minibatches.

    Each epoch draws one permutation ``torch.randperm(num_data, generator=generator)`` and cuts
    it into consecutive minibatches of ``batch_size`` indices; the last one may be smaller, and
    one smaller than ``min_batch_size`` is skipped (BatchNorm in training mode needs two
    points). For each minibatch ``idx`` (a ``LongTensor`` on ``device``):

    - with an ``optimizer``: ``optimizer.zero_grad()``, ``loss = step(idx)`` (a scalar tensor),
      ``loss.backward()``, ``optimizer.step()``;
    - without: ``loss = step(idx)``, a step that updates the parameters itself (e.g.
      ``pyro.infer.SVI.step``) and returns a number.

    Random numbers: the permutation is drawn at the start of each epoch, before any step; a
    step that draws from the same ``generator`` (the Bezier parameter of `fit_curve`) does so
    after it, in minibatch order.

    Args:
        step: the minibatch computation, ``idx (B,) -> loss``.
        num_data: ``N``, the number of data points.
        epochs: number of passes (``0``: nothing happens).
        batch_size: minibatch size (``None``: the full batch, still shuffled).
        generator: the shuffling generator (default: `shuffle_generator` ``(None)``).
        optimizer: see above.
        device: where the indices live (the data's device; default CPU).
        min_batch_size: smaller minibatches are skipped (unless ``N`` itself is smaller).
        epoch_loss: the loss recorded per epoch: ``"points"``, ``Σ_b loss_b |b| / Σ_b |b|``
            (the mean per point when a step returns its minibatch mean); ``"batches"``, the
            mean of the steps' losses.
        on_epoch: called as ``on_epoch(epoch, loss)`` after each epoch (``epoch`` from 0),
            e.g. to collect an SWA snapshot.
        desc, progress: a ``tqdm`` progress bar over the epochs, with the last loss.
        data_parallel: under an initialised process group (`distributed`), reduce the
            gradients over the ranks before each optimiser step (``step`` must return its
            minibatch mean; needs an ``optimizer``; every rank must take equally many steps per
            epoch, checked first). Without a process group: no effect.

    Returns:
        One loss per epoch.

    Raises:
        TrainingDivergedError: (a ``FloatingPointError``) a step's loss is NaN or infinite
            (before the optimiser moves on it), or the step raised a ``FloatingPointError``;
            ``.epoch`` is the epoch, counted from 1.
    """
    if epoch_loss not in EPOCH_LOSSES:
        raise ValueError(f"epoch_loss: expected one of {EPOCH_LOSSES}, got {epoch_loss!r}")
    gen = shuffle_generator(None) if generator is None else generator
    bs = num_data if batch_size is None else min(batch_size, num_data)
    smallest = min(min_batch_size, num_data)
    if epochs > 0 and bs < smallest:  # every minibatch would be skipped: nothing trained
        raise ValueError(
            f"batch_size: minibatches of {bs} are all smaller than {smallest}, the least a step "
            "takes here (BatchNorm in training mode needs two points), so nothing would be "
            f"trained: use batch_size >= {smallest}"
        )
    if data_parallel and distributed.active():  # equally many steps per rank, before any work
        sizes = [min(bs, num_data - start) for start in range(0, num_data, bs)]
        check_lockstep(sum(s >= smallest for s in sizes), optimizer, "batch_size")
    history: list[float] = []
    since_flush = 0  # steps since the optimiser's subnormals were last flushed
    bar = tqdm(total=epochs, desc=desc, disable=not progress or epochs == 0, leave=False, mininterval=0.5)
    try:
        for epoch in range(epochs):
            order = torch.randperm(num_data, generator=gen).to(device)
            batches = (idx for idx in order.split(bs) if idx.numel() >= smallest)
            total, count, steps_taken = 0.0, 0, 0
            for value, size in take_steps(
                step, batches, len, optimizer, epoch=epoch, desc=desc, data_parallel=data_parallel
            ):
                steps_taken += 1
                if epoch_loss == "points":
                    total += value * size
                    count += size
                else:
                    total += value
                    count += 1
            _check_trained(count, epoch, desc)
            history.append(total / count)
            since_flush = _flush_now(optimizer, since_flush + steps_taken, epoch == epochs - 1)
            if on_epoch is not None:
                on_epoch(epoch, history[-1])
            bar.update()
            bar.set_postfix(loss=f"{history[-1]:.4f}", refresh=False)
    finally:
        bar.close()
    return history


def check_lockstep(steps: int, optimizer: object, argument: str) -> None:
    """Data-parallel training: check that every rank takes ``steps`` steps per epoch (one
    ``all_reduce``; every rank raises the same ``ValueError`` naming ``argument`` otherwise)
    and that there is an optimiser whose gradients can be reduced."""
    if optimizer is None:
        raise ValueError("optimizer: data-parallel training needs a torch optimizer")
    counts = distributed.gather_ints(steps)
    if len(set(counts)) > 1:
        raise ValueError(
            f"{argument}: data-parallel training takes one step on every rank at once, but the "
            f"ranks' shards give {counts} minibatches per epoch; use shards of equal size "
            "(e.g. N divisible by the number of ranks) or a batch size that splits them "
            "into equally many minibatches"
        )


def take_steps(
    step: Callable[[Any], torch.Tensor | float],
    batches: Iterable[Any],
    size: Callable[[Any], int],
    optimizer: torch.optim.Optimizer | None,
    *,
    epoch: int,
    desc: str,
    data_parallel: bool = False,
) -> Iterator[tuple[float, int]]:
    """One epoch of steps (`minibatch_loop`'s inner loop, also used over a ``DataLoader``).

    For each ``batch``: ``optimizer.zero_grad()``, ``loss = step(batch)``, the divergence
    check, ``loss.backward()`` and ``optimizer.step()`` (without an optimizer the step updates
    the parameters itself). With ``data_parallel`` under an active process group the gradient
    is first reduced over the ranks (`distributed.reduce_gradients`; ``loss`` must be the
    minibatch mean) and the check uses the loss of the global minibatch, so all ranks raise
    together; the ranks must take equally many steps (`check_lockstep`).

    Yields:
        ``(loss, rows)`` per step: this process's minibatch, or with reductions the global one.
    """
    reduce = data_parallel and distributed.active()
    params = (
        [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    )
    for batch in batches:
        if optimizer is not None:
            optimizer.zero_grad()
        failure = None
        try:
            loss = step(batch)
        except FloatingPointError as err:  # a step's own check (non-finite outputs)
            if not reduce:
                if isinstance(err, TrainingDivergedError):
                    raise
                raise TrainingDivergedError(f"{err} (epoch {epoch + 1})", epoch + 1) from err
            failure, loss = err, float("nan")  # the other ranks are waiting in the reduction
        value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        rows = size(batch)
        if reduce:
            if math.isfinite(value):
                loss.backward()
            rows, value = distributed.reduce_gradients(params, rows, value)
        if not math.isfinite(value):
            message = f"{desc}: the loss became {value} at epoch {epoch + 1}"
            if failure is not None:
                message = f"{failure} (epoch {epoch + 1})"
            elif reduce:
                message += " (on some rank)"
            raise TrainingDivergedError(
                message + "; lower the learning rate or check the data", epoch + 1
            )
        if optimizer is not None:
            if not reduce:
                loss.backward()
            optimizer.step()
        yield value, rows


def flush_optimizer_subnormals(optimizer: torch.optim.Optimizer | None) -> None:
    """At the end of an epoch (every `FLUSH_STEPS` steps and after the last epoch): the
    subnormal entries of the optimiser's parameters and of its state (Adam's moments) set to
    zero (`flat.flush_subnormal_`). Weight decay drives a dead unit's
    weights and moments towards zero geometrically until they are subnormal, and a CPU computes
    with subnormals several times more slowly, in this loop and in every later use of the
    network; their values (below ``finfo.tiny``) change nothing else."""
    if optimizer is None:
        return
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    flush_subnormal_(*tensors)


#: `flush_optimizer_subnormals` runs at the end of an epoch once this many steps were taken
#: since the last flush, and after the last epoch: often enough that subnormals (which take
#: thousands of steps of weight decay to appear) cannot slow the training, rarely enough that
#: the flush (a few operations over every parameter and state tensor) costs nothing per step on
#: small data (digits: 12 minibatches an epoch)
FLUSH_STEPS = 256


def _flush_now(optimizer: torch.optim.Optimizer | None, steps: int, last: bool) -> int:
    """Flush the optimiser's subnormals when ``steps >= FLUSH_STEPS`` or on the ``last`` epoch;
    returns the steps since the last flush."""
    if steps < FLUSH_STEPS and not last:
        return steps
    flush_optimizer_subnormals(optimizer)
    return 0


def _check_trained(count: int, epoch: int, desc: str, argument: str = "batch_size") -> None:
    """Once per epoch: an epoch that took no step trained nothing, an error rather than a
    loss of 0.0 reported as success."""
    if count == 0:
        raise ValueError(
            f"{argument}: {desc} took no step in epoch {epoch + 1} (every minibatch was empty "
            "or skipped as too small for BatchNorm), so nothing was trained: give data with "
            "minibatches of at least two rows"
        )


def loader_loop(
    batch_loss, loader, epochs: int, optimizer, on_epoch, desc: str, offset: int = 0
) -> list[float]:
    """Epochs over a ``DataLoader`` of ``(x, y)`` batches, ``batch_loss(x_b, y_b)`` per step
    (`take_steps`, data-parallel under a process group); the mean loss per point per epoch.
    A ``DistributedSampler`` gets ``set_epoch(offset + epoch)`` before each epoch, so that it
    reshuffles. A non-finite loss or output raises `TrainingDivergedError` with the epoch
    (from 1)."""
    if distributed.active():
        try:
            steps = len(loader)
        except TypeError as err:
            raise ValueError(
                "x: data-parallel training needs a DataLoader with a length (the ranks step "
                "together)"
            ) from err
        check_lockstep(steps, optimizer, "x")
    history, since_flush = [], 0
    for epoch in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(offset + epoch)
        total, count, steps_taken = 0.0, 0, 0
        pairs = (split_batch(batch) for batch in loader)  # (x, y) pairs or dict batches
        for value, rows in take_steps(
            lambda pair: batch_loss(*pair), pairs, lambda pair: batching.rows(pair[0]),
            optimizer, epoch=epoch, desc=desc, data_parallel=True,
        ):  # fmt: skip
            total, count, steps_taken = total + value * rows, count + rows, steps_taken + 1
        _check_trained(count, epoch, desc, argument="x")
        history.append(total / count)
        since_flush = _flush_now(optimizer, since_flush + steps_taken, epoch == epochs - 1)
        on_epoch(epoch, history[-1])
    return history
