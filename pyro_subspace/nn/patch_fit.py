"""`PatchedNet.fit`: Algorithm 1 of Ensemble Model Patching (Adam on the component means, one
draw per minibatch) over tensors or a streamed ``Dataset``/``DataLoader``, fault-safe
(`flat.preserved`) and data-parallel under a process group (`distributed`)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset

from .. import distributed, validation
from ..data import check_batchnorm_loader
from ..flat import preserved, train_mode
from ..minibatch import loader_loop, minibatch_loop, shuffle_generator
from . import patch_svi
from .patch_family import positive


def fit(model, x, y, epochs: int, lr: float, batch_size: int, method: str, seed: int | None):
    """The body of `PatchedNet.fit` (its docstring documents the arguments and the result)."""
    streamed = isinstance(x, (Dataset, DataLoader))
    # tensors: width, dtype, finiteness and targets against the net; a Dataset: its first item
    n = validation.check_data(model.net, x, y, model.likelihood, require_y=not streamed)
    if streamed and n == 0:
        raise ValueError(
            "x: PatchedNet.fit needs the number of training points N (eq. 7 weighs the prior "
            "by 1/N): give a Dataset with a length (or a DataLoader over one)"
        )
    validation.positive_int(epochs, "epochs"), validation.positive_int(batch_size, "batch_size")
    positive(lr, "lr")
    validation.choice(method, "method", ("torch", "svi"))
    if distributed.active() and method == "svi":
        raise ValueError("method: 'svi' is not data-parallel (torch.distributed); use 'torch'")
    local_n = n
    if distributed.active():  # one draw per global minibatch: every rank follows rank 0's stream
        n = sum(distributed.gather_ints(local_n))
        distributed.share_random_stream()
    gen = shuffle_generator(seed)
    # one draw's outputs on the first row: the targets of tensors are checked against them once
    # (streamed targets: per batch); drawn for a stream too, so that the training draws are the
    # same whatever the source
    first = x[:1] if not streamed else _first_row(x)
    if first is not None:
        with torch.no_grad():
            probe = model.sample_outputs(first, 1)[0]
    if not streamed:
        y = model.likelihood.validate(probe.new_zeros(local_n, *probe.shape[1:]), y)
    check_batchnorm_loader(model.net, x)
    if method == "svi":  # SVI(fused_model, fused_guide, Adam, Trace_ELBO()): patch_svi
        step = patch_svi.svi_step(model, n, lr, probe if streamed and first is not None else None)
        optimizer = None
    else:  # negative_elbo without the penalty over N, from the flat means; eq. (7) by Adam
        step, optimizer = patch_svi.torch_step(model, n, lr, validate=streamed)

    def on_epoch(epoch: int, loss: float) -> None:
        distributed.sync_buffers(model)

    with (
        preserved(model, model.net, buffers="error", weights="error"),
        train_mode(model, model.net),
    ):
        distributed.broadcast_state(model)  # rank 0's means and buffers, as DDP does
        if streamed:  # BatchNorm needs two points: a last batch of one is dropped
            loader = x if isinstance(x, DataLoader) else DataLoader(
                x, batch_size=batch_size, shuffle=True, generator=gen,
                drop_last=local_n % batch_size == 1,
            )  # fmt: skip
            return loader_loop(step, loader, epochs, optimizer, on_epoch, "PatchedNet.fit")
        return minibatch_loop(
            lambda idx: step(x[idx], y[idx]),
            local_n,
            epochs=epochs,
            batch_size=batch_size,
            generator=gen,
            optimizer=optimizer,
            device=x.device,
            min_batch_size=2,
            epoch_loss="batches",
            on_epoch=on_epoch,
            desc="PatchedNet.fit",
            data_parallel=True,
        )


def _first_row(data: Dataset | DataLoader) -> torch.Tensor | None:
    """The inputs of a map-style data set's first item as a batch of one, else ``None``."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    try:
        item = dataset[0]
    except (TypeError, IndexError, NotImplementedError, KeyError):
        return None
    xs = item[0] if isinstance(item, (tuple, list)) else item
    return xs.unsqueeze(0) if isinstance(xs, torch.Tensor) else None
