"""Data sources: tensors, a ``Dataset`` or a ``DataLoader``, read in chunks of rows.

Every entry point that takes training data accepts ``(x, y)`` tensors, a
``torch.utils.data.Dataset`` of ``(x_n, y_n)`` pairs, or a ``DataLoader`` yielding ``(x, y)``
batches; `DataSource` reads any of them chunk by chunk, so peak memory is bounded by the chunk
(a ``DataLoader`` keeps its own batch size), never by ``N``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ._checks import positive_int


def all_finite(x: torch.Tensor) -> bool:
    """``torch.isfinite(x).all()`` computed block by block (about 2¹⁶ entries each), so that
    checking a large data set needs memory of one block, not temporaries of the size of ``x``."""
    if not x.is_floating_point() and not x.is_complex():
        return True
    rows = max(1, 2**16 // max(1, x[:1].numel()))
    return all(bool(torch.isfinite(block).all()) for block in x.split(rows))


class DataSource:
    """Chunks ``(x_c, y_c)`` of a data set given as tensors, a ``Dataset`` or a ``DataLoader``.

    Args:
        x: inputs ``(N, ...)``, a ``Dataset`` or a ``DataLoader`` (then ``y`` must be None).
        y: targets ``(N, ...)`` with tensor inputs, or None (inputs only).
        chunk_size: rows per chunk for tensors and datasets.
    """

    def __init__(
        self, x: object, y: torch.Tensor | None = None, chunk_size: int = 4096
    ) -> None:
        positive_int(chunk_size, "chunk_size")
        self.chunk_size = chunk_size
        if isinstance(x, (Dataset, DataLoader)):
            if y is not None:
                raise ValueError("y: give either a Dataset/DataLoader or (x, y) tensors, not both")
            self.loader = x if isinstance(x, DataLoader) else DataLoader(x, chunk_size)
            self.x = self.y = None
            self.num_data = len(self.loader.dataset)
            return
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"x: expected a torch.Tensor (N, ...), a Dataset or a DataLoader, "
                f"got {type(x).__name__}"
            )
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"x: expected at least one input row, got shape {tuple(x.shape)}")
        if not all_finite(x):
            raise ValueError("x: contains NaN or inf")
        if y is not None:
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
            if y.dim() == 0 or y.shape[0] != x.shape[0]:
                raise ValueError(
                    f"y: expected {x.shape[0]} targets to match x, got shape {tuple(y.shape)}"
                )
        self.loader, self.x, self.y = None, x, y
        self.num_data = x.shape[0]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        if self.loader is None:
            ys = self.y.split(self.chunk_size) if self.y is not None else None
            for i, xc in enumerate(self.x.split(self.chunk_size)):
                yield xc, None if ys is None else ys[i]
            return
        for batch in self.loader:
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise ValueError("x: the DataLoader must yield (x, y) batches")
            yield batch[0], batch[1]

    def inputs(self) -> Iterator[torch.Tensor]:
        """The input chunks only."""
        for xc, _ in self:
            yield xc
