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

Without a process group (or with one rank) nothing changes. Inside `local()` the data are
treated as each rank's full copy (no reductions), e.g. to evaluate validation data that every
rank holds entirely.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

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
    if isinstance(data, Dataset):
        return Subset(data, range(rank, len(data), size))  # type: ignore[arg-type]
    raise TypeError(f"data: expected a tensor or a Dataset, got {type(data).__name__}")
