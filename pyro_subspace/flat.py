"""A network as a function of one flat weight vector.

`FlatNet(net)(w, x)` evaluates ``net`` at the weights ``w`` without touching the network's own
parameters: ``torch.func.functional_call`` does the work, buffers (BatchNorm running statistics)
are passed through unchanged, and a batch of weight vectors ``(..., D)`` is evaluated at once with
``torch.func.vmap``. The flat order is that of
``torch.nn.utils.parameters_to_vector(net.parameters())``: every `Subspace`, index and basis in
this library refers to positions in it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.func import functional_call, vmap


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
        params = list(net.named_parameters())
        if not params:
            raise ValueError("net: the network has no parameters")
        self.net = net
        self.names = [name for name, _ in params]
        self.shapes = [p.shape for _, p in params]
        self.numels = [p.numel() for _, p in params]
        self.num_weights = sum(self.numels)

    def vector(self) -> torch.Tensor:
        """The network's current weights as one detached vector, shape ``(D,)``."""
        return nn.utils.parameters_to_vector(self.net.parameters()).detach().clone()

    def load_vector(self, w: torch.Tensor) -> None:
        """Copy the flat weights ``w`` (shape ``(D,)``) into the network's parameters, in place."""
        self.check_weights(w, "w", batched=False)
        with torch.no_grad():
            nn.utils.vector_to_parameters(w.detach().to(self.vector()), self.net.parameters())

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
            x: inputs, shape ``(N, *in_shape)``, shared by every weight vector.

        Returns:
            Outputs of shape ``(N, *out_shape)`` or ``(*batch, N, *out_shape)``.

        The network runs in whatever mode it is in; in training mode BatchNorm would update its
        running statistics in place, which ``vmap`` refuses, so batched calls need eval mode (see
        `eval_mode`).
        """
        if w.dim() == 1:
            return self._call_one(w, x)
        batch = w.shape[:-1]
        flat_w = w.reshape(-1, w.shape[-1])
        strategy = self.batch_strategy
        if strategy == "auto":
            strategy = "loop" if w.device.type == "cpu" else "vmap"
        if strategy == "vmap":
            out = vmap(self._call_one, in_dims=(0, None))(flat_w, x)
        else:
            out = torch.stack([self._call_one(wi, x) for wi in flat_w])
        return out.reshape(*batch, *out.shape[1:])

    def _call_one(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        params = self.unflatten(w)
        buffers = dict(self.net.named_buffers())
        return functional_call(self.net, {**params, **buffers}, (x,))

    def chunked(self, w: torch.Tensor, x: torch.Tensor, chunk_size: int = 4096) -> torch.Tensor:
        """Like ``self(w, x)`` but runs the data in chunks of ``chunk_size`` rows.

        Memory is bounded by the chunk, not by ``N``; outputs are concatenated along the data
        dimension, shape ``(*batch, N, *out_shape)``.
        """
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
        n = x.shape[0]
        if n <= chunk_size:
            return self(w, x)
        dim = w.dim() - 1
        parts = [self(w, x[i : i + chunk_size]) for i in range(0, n, chunk_size)]
        return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def eval_mode(net: nn.Module) -> Iterator[nn.Module]:
    """Put ``net`` in eval mode for the duration of the block, then restore every module's mode.

    The user's per-module ``training`` flags are saved and put back exactly, so no state is lost.
    """
    modes = [(m, m.training) for m in net.modules()]
    net.eval()
    try:
        yield net
    finally:
        for m, training in modes:
            m.training = training


def num_weights(net: nn.Module) -> int:
    """Length ``D`` of the flat weight vector of ``net``."""
    return sum(math.prod(p.shape) for p in net.parameters())
