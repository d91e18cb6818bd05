"""Data-parallel evaluation over ``torch.distributed``: each rank holds a shard of the data.

With an initialised process group of more than one rank (``torchrun --nproc_per_node 2 ...``,
or ``torch.distributed.init_process_group`` yourself: gloo on CPU, NCCL on GPU), every
full-data sum the package computes (the tempered log-likelihood and its gradient, GGN-vector
products, ``PᵀGP``, the GGN diagonal, the Laplace MAP statistics) is the sum over the rank's
own shard followed by one ``all_reduce``: every rank then holds the full-data value and takes
the same decisions (L-BFGS steps, Lanczos vectors, slice-sampler moves). The data each rank
passes is its shard: tensors (e.g. ``x[rank::world]``, see `shard`), a ``Dataset``, or a
``DataLoader`` with a ``DistributedSampler`` (``drop_last=True``, or ``N`` divisible by the
number of ranks: the sampler's padding would count rows twice) or any sharded loader.

Training (`fit_map` and its SWA phase, `PatchedNet.fit`) is data-parallel through the same
``all_reduce``, not through ``DistributedDataParallel``: the trainers own their optimiser loop
(one `minibatch.minibatch_loop`) and train parameters outside the network (a learned noise
scale, PatchedNet's component means), so after each backward pass `reduce_gradients` replaces
every gradient by the gradient of the mean loss over all ranks' minibatches, weighted by their
sizes (exact, also for unequal shards; DDP's average of the ranks' means is exact only for
equal ones). Every rank then takes the same optimiser step. `broadcast_state` gives every rank
rank 0's starting weights first (as DDP does at construction) and `sync_buffers` keeps the
BatchNorm running statistics equal across ranks.

Without a process group (or with one rank) nothing changes. Inside `local()` the data are
treated as each rank's full copy (no reductions), e.g. to evaluate validation data that every
rank holds entirely.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, IterableDataset, Subset

_LOCAL = [False]


def world() -> tuple[int, int]:
    """``(rank, world size)``; ``(0, 1)`` without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def active() -> bool:
    """True when sums over the data must be reduced across ranks (a process group of more than
    one rank, outside `local`)."""
    return not _LOCAL[0] and world()[1] > 1


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Treat data given inside the block as each rank's full copy: no reductions."""
    saved, _LOCAL[0] = _LOCAL[0], True
    try:
        yield
    finally:
        _LOCAL[0] = saved


def _device(*values: object) -> torch.device:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(*values: object):
    """Sum each of ``values`` (floats, ints or tensors) over the ranks with ONE ``all_reduce``
    (packed into a float64 vector); returns them in their original types and shapes (one value
    alone is returned as is, several as a tuple). Without `active` reductions: unchanged."""
    if active():
        device = _device(*values)
        parts = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(-1) for v in values]
        packed = torch.cat(parts)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        out, start = [], 0
        for v, p in zip(values, parts, strict=True):
            chunk = packed[start : start + p.numel()]
            start += p.numel()
            if isinstance(v, torch.Tensor):
                out.append(chunk.reshape(v.shape).to(v.dtype))
            else:
                out.append(type(v)(chunk.item()))
        values = tuple(out)
    return values[0] if len(values) == 1 else tuple(values)


def share_random_stream() -> None:
    """Give every rank rank 0's state of torch's global generator (and of the current CUDA
    device's, when CUDA is initialised), so random draws agree across ranks: the elliptical
    slice sampler calls it in ``setup`` and then every rank takes the same accept and shrink
    decisions. A single process (or inside `local`) is left untouched."""
    if not active():
        return
    states = [torch.get_rng_state()]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        states.append(torch.cuda.get_rng_state())
    device = _device()
    for i, state in enumerate(states):
        buf = state.to(device)
        dist.broadcast(buf, src=0)
        if i == 0:
            torch.set_rng_state(buf.cpu())
        else:
            torch.cuda.set_rng_state(buf.cpu())


def shard(data: object) -> object:
    """This rank's shard of a data set: rows ``rank, rank + R, rank + 2R, …`` of a tensor or a
    ``Dataset`` (a ``Subset``); unchanged without a process group. No padding: the shards
    together hold every row exactly once."""
    rank, size = world()
    if isinstance(data, torch.Tensor):
        return data[rank::size]
    if isinstance(data, IterableDataset) or (isinstance(data, Dataset) and not _has_len(data)):
        raise TypeError(
            f"data: a {type(data).__name__} without a length cannot be sharded by rows; give "
            "each rank its own stream (e.g. an IterableDataset that reads "
            "torch.distributed.get_rank()'s part), or a map-style Dataset"
        )
    if isinstance(data, Dataset):
        return Subset(data, range(rank, len(data), size))  # type: ignore[arg-type]
    raise TypeError(f"data: expected a tensor or a Dataset, got {type(data).__name__}")


def _has_len(data: object) -> bool:
    try:
        len(data)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def gather_ints(value: int) -> list[int]:
    """Every rank's ``value``, in rank order, on every rank (one ``all_reduce`` of a one-hot
    vector); ``[value]`` without `active` reductions."""
    if not active():
        return [int(value)]
    rank, size = world()
    onehot = torch.zeros(size, dtype=torch.float64, device=_device())  # NCCL: on the GPU
    onehot[rank] = value
    return [int(v) for v in all_reduce_sum(onehot).tolist()]


def _state(modules: tuple[nn.Module, ...], parameters: bool = True) -> list[torch.Tensor]:
    """The distinct parameters (if ``parameters``) and buffers of ``modules``."""
    seen, out = set(), []
    for m in modules:
        for t in (list(m.parameters()) if parameters else []) + list(m.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


@torch.no_grad()
def broadcast_state(*modules: nn.Module) -> None:
    """Copy rank 0's parameters and buffers of ``modules`` into every rank's, in place (one
    ``broadcast``), as ``DistributedDataParallel`` does when it wraps a module. Without
    `active` reductions: nothing happens."""
    if not active():
        return
    tensors = _state(modules)
    if not tensors:
        return
    packed = torch.cat([t.detach().to(torch.float64).reshape(-1) for t in tensors])
    dist.broadcast(packed, src=0)
    start = 0
    for t in tensors:
        t.copy_(packed[start : start + t.numel()].view(t.shape))
        start += t.numel()


@torch.no_grad()
def sync_buffers(*modules: nn.Module) -> None:
    """Make the buffers of ``modules`` equal on every rank (one ``all_reduce``): floating ones
    (BatchNorm running means and variances) become their mean over the ranks, the others
    (``num_batches_tracked``) rank 0's. Without `active` reductions: nothing happens.

    Each rank normalises its minibatch with its own batch statistics (BatchNorm on CPU; for the
    statistics of the global minibatch convert the net with
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, which torch runs on GPUs only). The
    averaged running mean is then the running mean over all ranks' rows (equal minibatch
    sizes); the averaged running variance is the mean of the ranks' variances, which leaves out
    the spread between the ranks' minibatch means (small for shuffled shards)."""
    if not active():
        return
    buffers = _state(modules, parameters=False)
    if not buffers:
        return
    rank, size = world()
    parts = []
    for b in buffers:
        v = b.detach().to(torch.float64)
        parts.append(
            v / size if b.is_floating_point() else (v if rank == 0 else torch.zeros_like(v))
        )
    summed = all_reduce_sum(*parts)
    for b, v in zip(buffers, summed if len(buffers) > 1 else (summed,), strict=True):
        b.copy_(v)


def reduce_gradients(params: Iterable[torch.Tensor], count: int, loss: float) -> tuple[int, float]:
    """Data-parallel training: the gradient of the mean loss over all ranks' minibatches.

    Called on every rank after ``loss.backward()`` of this rank's minibatch *mean* ``loss`` over
    ``count`` rows (``count = 0``: no minibatch). Replaces each ``p.grad`` by
    ``Σ_r B_r g_r / Σ_r B_r`` (``B_r`` the ranks' ``count``, ``g_r`` their gradients), the
    gradient of the mean over the union of the minibatches, with one ``all_reduce`` of the
    packed gradients; a parameter without a gradient on every rank keeps ``grad = None``, as
    it would in one process. A non-finite ``loss`` on any rank makes the returned loss
    non-finite on every rank, so all of them stop together.

    Returns:
        ``(Σ_r B_r, Σ_r B_r loss_r / Σ_r B_r)``: the rows and the mean loss of the global
        minibatch (unchanged without `active` reductions).
    """
    if not active():
        return count, loss
    params = list(params)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    has = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64)
    weighted = loss * count if count else 0.0
    *summed, has, total, weighted = all_reduce_sum(
        *[g.detach() * count for g in grads], has, float(count), float(weighted)
    )
    for p, g, h in zip(params, summed, has.tolist(), strict=True):
        p.grad = g / total if h > 0 and total > 0 else None
    total = round(total)
    return total, (weighted / total if total else 0.0)
