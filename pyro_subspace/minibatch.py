"""`minibatch_loop`: the one minibatch training loop of the library.

`fit_map` (MAP and the SWA phase), `fit_curve` (the Bezier control point) and `PatchedNet.fit`
(plain torch or Pyro's ``SVI``) differ only in what one step computes; the epochs, the shuffling,
the optimiser calls, the divergence check, the per-epoch loss, the per-epoch callback and the
progress bar live here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from .exceptions import TrainingDivergedError

EPOCH_LOSSES = ("points", "batches")


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
    history: list[float] = []
    bar = tqdm(total=epochs, desc=desc, disable=not progress, leave=False, mininterval=0.5)
    try:
        for epoch in range(epochs):
            order = torch.randperm(num_data, generator=gen).to(device)
            total, count = 0.0, 0
            for start in range(0, num_data, bs):
                idx = order[start : start + bs]
                if idx.numel() < smallest:
                    continue
                if optimizer is not None:
                    optimizer.zero_grad()
                try:
                    loss = step(idx)
                except FloatingPointError as err:  # a step's own check (non-finite outputs)
                    if isinstance(err, TrainingDivergedError):
                        raise
                    raise TrainingDivergedError(f"{err} (epoch {epoch + 1})", epoch + 1) from err
                value = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
                if not math.isfinite(value):
                    raise TrainingDivergedError(
                        f"{desc}: the loss became {value} at epoch {epoch + 1}; "
                        "lower the learning rate or check the data",
                        epoch + 1,
                    )
                if optimizer is not None:
                    loss.backward()
                    optimizer.step()
                if epoch_loss == "points":
                    total += value * idx.numel()
                    count += idx.numel()
                else:
                    total += value
                    count += 1
            history.append(total / max(count, 1))
            if on_epoch is not None:
                on_epoch(epoch, history[-1])
            bar.update()
            bar.set_postfix(loss=f"{history[-1]:.4f}", refresh=False)
    finally:
        bar.close()
    return history
