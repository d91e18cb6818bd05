"""Data sources: tensors, a ``Dataset`` or a ``DataLoader``, read in chunks of rows.

Every entry point that takes training data accepts ``(x, y)`` tensors, a
``torch.utils.data.Dataset`` of ``(x_n, y_n)`` pairs, or a ``DataLoader`` yielding ``(x, y)``
batches; `DataSource` reads any of them chunk by chunk, so peak memory is bounded by the chunk
(a ``DataLoader`` keeps its own batch size), never by ``N``. Inputs may be a mapping of tensors
(`batch`: a dict, a Hugging Face ``BatchEncoding``), and a loader may yield dict batches
(``{"input_ids": ..., "attention_mask": ..., "labels": ...}``): the targets are the entry
``dict_key_y``, the inputs every other entry (laplace-torch's ``dict_key_x``/``dict_key_y``).
A loader's batches are taken as they come (batches of different padded lengths are never
concatenated).

Under ``torch.distributed`` (`distributed`) the source is this rank's shard: ``num_data`` is the
total over the ranks and `reduce` sums a per-shard result over them (one ``all_reduce``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from . import batch as batches
from . import distributed
from .validation import all_finite, positive_int  # all_finite: re-exported

#: laplace-torch's default keys of a dict batch: the inputs' rows are counted in ``"input_ids"``
DICT_KEY_X, DICT_KEY_Y = "input_ids", "labels"


class DataSource:
    """Chunks ``(x_c, y_c)`` of a data set given as tensors, a ``Dataset`` or a ``DataLoader``.

    Args:
        x: inputs ``(N, ...)`` (a tensor or a mapping of tensors), a ``Dataset`` or a
            ``DataLoader`` (then ``y`` must be None) of ``(x, y)`` pairs or dict batches.
        y: targets ``(N, ...)`` with tensor inputs, or None (inputs only).
        chunk_size: rows per chunk for tensors and datasets.
        dict_key_y: the targets' key in a dict batch (the other entries are the inputs).

    ``num_data`` is ``N`` summed over the ranks of an active process group (`distributed`);
    ``local_num_data`` the rows of this rank's shard.
    """

    def __init__(
        self,
        x: object,
        y: torch.Tensor | None = None,
        chunk_size: int = 4096,
        dict_key_y: str = DICT_KEY_Y,
    ) -> None:
        positive_int(chunk_size, "chunk_size")
        self.chunk_size = chunk_size
        self.dict_key_y = dict_key_y
        if isinstance(x, (Dataset, DataLoader)):
            if y is not None:
                raise ValueError("y: give either a Dataset/DataLoader or (x, y) tensors, not both")
            self.loader = x if isinstance(x, DataLoader) else DataLoader(x, chunk_size)
            self.x = self.y = None
            self.local_num_data = _loader_rows(self.loader)
            self.sharded = distributed.active()
            return
        if not isinstance(x, torch.Tensor) and not batches.is_mapping(x):
            raise TypeError(
                f"x: expected a torch.Tensor (N, ...), a mapping of tensors, a Dataset or a "
                f"DataLoader, got {type(x).__name__}"
            )
        x = batches.check(x, "x")
        tensors = [x] if isinstance(x, torch.Tensor) else list(x.values())
        if tensors[0].dim() == 0 or batches.rows(x) == 0:
            raise ValueError(f"x: expected at least one input row, got shape {tuple(tensors[0].shape)}")
        if not all_finite(*[t for t in tensors if t.is_floating_point()]):
            raise ValueError("x: contains NaN or inf")
        n = batches.rows(x)
        if y is not None:
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
            if y.dim() == 0 or y.shape[0] != n:
                raise ValueError(f"y: expected {n} targets to match x, got shape {tuple(y.shape)}")
        self.loader, self.x, self.y = None, x, y
        self.local_num_data = n
        self.sharded = distributed.active()

    @property
    def num_data(self) -> int:
        """``N``: the rows of all shards (one ``all_reduce`` the first time under a process
        group; every rank must ask), else of this source."""
        if not hasattr(self, "_num_data"):
            self._num_data = self.reduce(self.local_num_data)
        return self._num_data

    def reduce(self, *values: object):
        """Sum per-shard results (floats, ints, tensors) over the ranks with one
        ``all_reduce`` when the data are sharded; unchanged otherwise (`distributed`)."""
        if not self.sharded:
            return values[0] if len(values) == 1 else values
        return distributed.all_reduce_sum(*values)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        if self.loader is None:
            ys = self.y.split(self.chunk_size) if self.y is not None else None
            for i, xc in enumerate(batches.split(self.x, self.chunk_size)):
                yield xc, None if ys is None else ys[i]
            return
        # A DataLoader draws from torch's global generator when an iteration starts (its base
        # seed; a RandomSampler's seed): keep that stream untouched, so a sampler's draws do
        # not depend on whether the data come as tensors or from a loader.
        with torch.random.fork_rng(devices=[]):
            stream = iter(self.loader)
            first = next(stream, None)
        for batch in itertools.chain([] if first is None else [first], stream):
            yield self.split_batch(batch)

    def split_batch(self, batch: object) -> tuple[object, torch.Tensor | None]:
        """``(x, y)`` of one of the loader's batches (`split_batch`)."""
        return split_batch(batch, self.dict_key_y)

    def inputs(self) -> Iterator[torch.Tensor]:
        """The input chunks only."""
        for xc, _ in self:
            yield xc


def split_batch(batch: object, dict_key_y: str = DICT_KEY_Y) -> tuple[object, torch.Tensor]:
    """``(x, y)`` of a loader's batch: an ``(x, y)`` pair (``x`` a tensor or a mapping), or a
    dict batch whose targets are ``batch[dict_key_y]`` and whose inputs are its other entries
    (laplace-torch's ``dict_key_y``; the targets are not passed to the network)."""
    if batches.is_mapping(batch):
        if dict_key_y not in batch:
            raise ValueError(
                f"x: the DataLoader's dict batches have no targets under dict_key_y="
                f"{dict_key_y!r} (keys {list(batch)}); pass dict_key_y= naming them"
            )
        x = {k: v for k, v in batch.items() if k != dict_key_y}
        return batches.check(x, "x"), batch[dict_key_y]
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("x: the DataLoader must yield (x, y) pairs or dict batches")
    x = batch[0] if isinstance(batch[0], torch.Tensor) else batches.check(batch[0], "x")
    return x, batch[1]


class KeyedBatches(torch.utils.data.IterableDataset):
    """A ``DataLoader`` of dict batches read as ``(x, y)`` pairs with the targets under
    ``dict_key_y`` (laplace-torch's keyword): ``DataLoader(KeyedBatches(loader, "label"),
    batch_size=None)`` is a loader every entry point reads; its length is the loader's rows."""

    def __init__(self, loader: DataLoader, dict_key_y: str) -> None:
        if not isinstance(dict_key_y, str):
            raise TypeError(f"dict_key_y: expected a str, got {type(dict_key_y).__name__}")
        self.loader, self.dict_key_y = loader, dict_key_y

    def __iter__(self):
        for batch in self.loader:
            yield split_batch(batch, self.dict_key_y)

    def __len__(self) -> int:
        return _loader_rows(self.loader)


def keyed(x: object, dict_key_y: str) -> object:
    """``x`` with its dict batches' targets read from ``dict_key_y`` (`KeyedBatches`) when it is
    a ``DataLoader`` and the key is not the default; ``x`` itself otherwise."""
    if not isinstance(dict_key_y, str):
        raise TypeError(f"dict_key_y: expected a str, got {type(dict_key_y).__name__}")
    if not isinstance(x, DataLoader) or dict_key_y == DICT_KEY_Y:
        return x
    return DataLoader(KeyedBatches(x, dict_key_y), batch_size=None)


def as_tensors(
    x: object, y: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, y)`` as tensors: unchanged when they are, else a ``Dataset``/``DataLoader`` of
    ``(x, y)`` read once, in its order, into memory (for what needs all rows at once: a
    Pyro model's trace, a validation set)."""
    if isinstance(x, torch.Tensor) or batches.is_mapping(x):
        return x, y
    pairs = list(DataSource(x, y))
    return batches.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs])


def check_batchnorm_loader(net: torch.nn.Module, loader: object) -> None:
    """A ``ValueError`` naming ``x`` when ``net`` has BatchNorm and the ``DataLoader`` ends in a
    batch of one row (BatchNorm in training mode cannot use it), before any training."""
    if not isinstance(loader, DataLoader) or loader.batch_size is None or loader.drop_last:
        return
    if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in net.modules()):
        return
    rows = _loader_rows(loader)
    if rows > 1 and rows % loader.batch_size == 1:
        raise ValueError(
            f"x: the DataLoader's last batch has one row ({rows} rows in batches of "
            f"{loader.batch_size}), which BatchNorm cannot train on; use drop_last=True or "
            "another batch_size"
        )


def _loader_rows(loader: DataLoader) -> int:
    """Rows a ``DataLoader`` yields per pass: what its sampler draws (a ``DistributedSampler``'s
    share, a subset sampler's indices), less a ``drop_last`` remainder; a custom batch sampler's
    batches are counted (indices only, no data loaded; torch's generator untouched)."""
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        n = len(loader.dataset)  # type: ignore[arg-type]
        if not sampler.drop_last and n % sampler.num_replicas:
            raise ValueError(
                f"x: the DistributedSampler pads {n} rows to {sampler.total_size} by repeating "
                "some, which would count them twice; use drop_last=True, a data set size "
                "divisible by the number of ranks, or pyro_subspace.distributed.shard"
            )
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return len(loader.dataset)  # type: ignore[arg-type]
    if loader.batch_size is None:  # a batch_sampler of the user's
        with torch.random.fork_rng(devices=[]):
            return sum(len(batch) for batch in loader.batch_sampler)
    rows = len(sampler)  # type: ignore[arg-type]
    return rows - rows % loader.batch_size if loader.drop_last else rows
