"""`fit_map`: MAP training (then an optional constant-learning-rate SWA phase) on `minibatch_loop`."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .flat import eval_mode, train_mode
from .likelihoods import Likelihood
from .minibatch import minibatch_loop, shuffle_generator
from .subspaces import SWACollector


def fit_map(
    net: nn.Module,
    likelihood: Likelihood,
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    epochs: int = 100,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    batch_size: int | None = None,
    optimizer: str = "adam",
    momentum: float = 0.9,
    collector: SWACollector | None = None,
    swa_epochs: int = 0,
    swa_lr: float | None = None,
    seed: int | None = None,
    progress: bool = True,
) -> list[float]:
    """Train ``net`` in place by minimising ``−mean_n log p(y_n | f(x_n; w))`` plus weight decay.

    Weight decay ``λ`` on the mean loss is the Gaussian prior ``N(0, (Nλ)⁻¹ I)`` on the weights, so
    the result is a MAP estimate. Learnable likelihood parameters (a `Gaussian` with
    ``sigma=None``) are trained alongside, without decay. With a ``collector``, ``swa_epochs`` of
    SGD at the constant rate ``swa_lr`` follow (weights only: likelihood parameters keep their MAP
    values), calling ``collector.collect()`` after each epoch
    (Subspace Inference C.2 / Algorithm 2): ``collector.mean`` is then the SWA solution, while the
    network keeps the last iterate.

    Args:
        net: the network (outputs ``(N, O)``); trained in place, its train/eval mode restored.
        likelihood: the `Likelihood` whose `log_prob` is the loss.
        x: inputs ``(N, ...)``; y: targets ``(N,)`` (``(N, 1)`` accepted). Or ``x`` a
            ``Dataset`` of ``(x_n, y_n)`` (shuffled minibatches of ``batch_size`` by a
            ``DataLoader``) or a ``DataLoader`` (used as is), with ``y=None``: streamed, memory
            bounded by the batch.
        epochs: epochs of the first (MAP) phase with ``optimizer`` ("adam" or "sgd").
        lr, weight_decay, momentum: optimiser settings (momentum for SGD only).
        batch_size: minibatch size (``None``: full batch).
        collector: a `SWACollector` built on this ``net``; required when ``swa_epochs > 0``.
        swa_epochs, swa_lr: the SWA phase (``swa_lr`` defaults to ``lr``).
        seed: seeds the minibatch shuffling.
        progress: show a ``tqdm`` progress bar.

    Returns:
        The mean training loss of each epoch, MAP phase then SWA phase.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    if not isinstance(likelihood, Likelihood):
        raise TypeError(
            f"likelihood: expected a pyro_subspace Likelihood, got {type(likelihood).__name__}"
        )
    streamed = isinstance(x, (Dataset, DataLoader))
    if streamed and y is not None:
        raise ValueError("y: give either a Dataset/DataLoader or (x, y) tensors, not both")
    if streamed:
        pass
    elif y is None:
        raise ValueError("y: the targets are required with tensor inputs")
    elif not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(
            f"x: expected a tensor of shape (N, ...) with N >= 1, got {getattr(x, 'shape', x)!r}"
        )
    elif x.is_floating_point() and not torch.isfinite(x).all():
        raise ValueError("x: contains NaN or inf")
    if not streamed:
        n = x.shape[0]
        with torch.no_grad(), eval_mode(net):
            probe = net(x[:1])  # only the output width is needed to check the targets
        probe = probe.unsqueeze(-1) if probe.dim() == 1 else probe
        y = likelihood.validate(probe.new_zeros(n, *probe.shape[1:]), y)
    for name, value, low in (("epochs", epochs, 0), ("swa_epochs", swa_epochs, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    for name, value in (("lr", lr), ("swa_lr", lr if swa_lr is None else swa_lr)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}: expected a positive number, got {value!r}")
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"weight_decay: expected a number >= 0, got {weight_decay!r}")
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(f"batch_size: expected a positive int or None, got {batch_size!r}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer: expected 'adam' or 'sgd', got {optimizer!r}")
    if swa_epochs > 0:
        if not isinstance(collector, SWACollector):
            raise ValueError("collector: swa_epochs > 0 needs a SWACollector built on this net")
        if collector.flat.net is not net:
            raise ValueError("collector: was built on a different network than net")

    gen = shuffle_generator(seed)
    groups = [{"params": list(net.parameters()), "weight_decay": float(weight_decay)}]
    extra = [p for p in likelihood.parameters() if p.requires_grad]
    if extra:
        groups.append({"params": extra, "weight_decay": 0.0})

    def make(kind: str, rate: float, params: list[dict]) -> torch.optim.Optimizer:
        params = [dict(g) for g in params]  # optimisers write their defaults into the groups
        if kind == "adam":
            return torch.optim.Adam(params, lr=rate)
        return torch.optim.SGD(params, lr=rate, momentum=momentum)

    def batch_loss(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        out = net(xb)
        out = out.unsqueeze(-1) if out.dim() == 1 else out
        if not torch.isfinite(out).all():
            raise FloatingPointError(
                "fit_map: the network outputs became non-finite; lower the learning rate"
            )
        return -likelihood.log_prob(out, likelihood.validate(out, yb) if streamed else yb).mean()

    if streamed:
        loader = x if isinstance(x, DataLoader) else DataLoader(
            x, batch_size=batch_size or len(x), shuffle=True, generator=gen  # type: ignore[arg-type]
        )
        with train_mode(net):
            history = _loader_loop(batch_loss, loader, epochs, make(optimizer, lr, groups))
            if swa_epochs:
                opt = make("sgd", lr if swa_lr is None else swa_lr, groups[:1])
                history += _loader_loop(batch_loss, loader, swa_epochs, opt, collector.collect)
        return history

    def step(idx: torch.Tensor) -> torch.Tensor:
        return batch_loss(x[idx], y[idx])

    loop = dict(batch_size=batch_size, generator=gen, device=x.device, progress=progress)
    history: list[float] = []
    with train_mode(net):
        history += minibatch_loop(
            step, n, epochs=epochs, optimizer=make(optimizer, lr, groups), desc="fit_map", **loop
        )
        if swa_epochs:  # the SWA phase moves the weights only; likelihood parameters stay put
            history += minibatch_loop(
                step,
                n,
                epochs=swa_epochs,
                optimizer=make("sgd", lr if swa_lr is None else swa_lr, groups[:1]),
                on_epoch=lambda epoch, loss: collector.collect(),
                desc="fit_map (swa)",
                **loop,
            )
    return history


def _loader_loop(batch_loss, loader, epochs: int, optimizer, on_epoch=None) -> list[float]:
    """Epochs over a ``DataLoader`` of ``(x, y)`` batches; the mean loss per point per epoch."""
    history = []
    for epoch in range(epochs):
        total, count = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = batch_loss(xb, yb)
            if not math.isfinite(float(loss.detach())):
                raise FloatingPointError(f"fit_map: the loss became {float(loss)} at epoch {epoch + 1}")
            loss.backward()
            optimizer.step()
            total, count = total + float(loss.detach()) * len(xb), count + len(xb)
        history.append(total / max(count, 1))
        if on_epoch is not None:
            on_epoch()
    return history
