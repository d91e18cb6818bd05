"""Inputs as users hold them: a tensor, or a mapping of tensors, and how each reaches the network.

Everywhere data enter the library, ``x`` may be a tensor ``(N, ...)`` or a mapping of tensors
that share their first dimension (a ``dict``, a Hugging Face ``BatchEncoding``:
``{"input_ids": (N, L), "attention_mask": (N, L)}``). The one rule for how a mapping reaches a
network (`call`): as keyword arguments when ``forward`` names every key (or takes
``**kwargs``), as a Hugging Face model does; otherwise as its one argument
(laplace-torch's convention, ``model(data)``, for a user's ``forward(self, data)``).

A network's output may be a tensor, a tuple or list (its first element, as laplace-torch reads
it) or a mapping with ``"logits"`` (a Hugging Face ``ModelOutput``): `output` returns the tensor.

Rows are chunked, indexed and moved as one (`rows`, `take`, `split`, `to_device`), so batches of
different padded lengths are iterated as they come and never concatenated (`cat` joins only
tensors, or mappings of equal trailing shapes).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Union

import torch
from torch import nn

__all__ = [
    "Inputs", "call", "call_args", "cat", "check", "device_of", "each_row", "is_mapping",
    "output", "rows", "split", "take", "to_device", "unsqueeze",
]  # fmt: skip

#: a tensor ``(N, ...)`` or a mapping of such tensors
Inputs = Union[torch.Tensor, Mapping]


def is_mapping(x: object) -> bool:
    """``x`` is a mapping of inputs (a ``dict``, a ``BatchEncoding``), not a tensor."""
    return isinstance(x, Mapping)


def check(x: object, name: str = "x") -> Inputs:
    """``x`` unchanged if it is a tensor, else a plain ``dict`` of its tensor entries (a
    ``BatchEncoding`` becomes a ``dict``: ``torch.func`` batches over dicts); a ``TypeError`` or
    ``ValueError`` naming ``name`` for anything else, an empty mapping, or entries whose first
    dimensions differ."""
    if isinstance(x, torch.Tensor):
        return x
    if not is_mapping(x):
        raise TypeError(
            f"{name}: expected a torch.Tensor (N, ...) or a mapping of tensors (a dict, a "
            f"BatchEncoding), got {type(x).__name__}"
        )
    out = dict(x)
    if not out:
        raise ValueError(f"{name}: the mapping of inputs is empty")
    bad = [k for k, v in out.items() if not isinstance(v, torch.Tensor) or v.dim() == 0]
    if bad:
        raise TypeError(
            f"{name}: every entry must be a tensor of rows (N, ...); {bad[0]!r} is "
            f"{type(out[bad[0]]).__name__}"
        )
    sizes = {k: v.shape[0] for k, v in out.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{name}: the entries must share their first dimension N, got {sizes}")
    return out


def rows(x: Inputs) -> int:
    """``N``, the number of rows."""
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    return next(iter(x.values())).shape[0]


def rows_or_none(x: object) -> int | None:
    """``N`` of in-memory inputs whose first entry has rows, else ``None`` (a ``Dataset``, a
    0-d tensor, an empty mapping: for checks that run before `check`)."""
    if isinstance(x, torch.Tensor):
        return x.shape[0] if x.dim() > 0 else None
    if is_mapping(x) and x:
        first = next(iter(x.values()))
        return first.shape[0] if isinstance(first, torch.Tensor) and first.dim() > 0 else None
    return None


def take(x: Inputs, index: slice | torch.Tensor | int) -> Inputs:
    """Rows ``index`` of every entry (an ``int`` keeps its dimension: ``x[i : i + 1]``)."""
    if isinstance(index, int):
        index = slice(index, index + 1)
    if isinstance(x, torch.Tensor):
        return x[index]
    return {k: v[index] for k, v in x.items()}


def split(x: Inputs, size: int) -> list:
    """Consecutive chunks of at most ``size`` rows (``Tensor.split`` for a mapping's entries)."""
    if isinstance(x, torch.Tensor):
        return list(x.split(size))
    parts = {k: v.split(size) for k, v in x.items()}
    return [{k: p[i] for k, p in parts.items()} for i in range(len(next(iter(parts.values()))))]


def to_device(x: Inputs, device: torch.device | str) -> Inputs:
    """Every entry on ``device`` (a no-op where it is there already)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    return {k: v.to(device) for k, v in x.items()}


def each_row(x: Inputs) -> list:
    """The rows one by one, without their leading dimension (``list(x)`` for a tensor): what
    ``vmap`` over rows passes its function, for the row-by-row fallbacks."""
    if isinstance(x, torch.Tensor):
        return list(x)
    return [{k: v[i] for k, v in x.items()} for i in range(rows(x))]


def unsqueeze(x: Inputs) -> Inputs:
    """One row (inside ``vmap``) as a batch of one: ``x[None]`` per entry."""
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0)
    return {k: v.unsqueeze(0) for k, v in x.items()}


def cat(parts: list) -> Inputs:
    """Chunks joined along the rows (mappings: per key; their trailing shapes must agree)."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def device_of(x: Inputs) -> torch.device:
    """The device of the (first) tensor."""
    return x.device if isinstance(x, torch.Tensor) else next(iter(x.values())).device


@functools.lru_cache(maxsize=256)
def _keyword_names(forward) -> tuple[frozenset, bool]:
    """``(named parameters, takes **kwargs)`` of a ``forward``."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin): one argument
        return frozenset(), False
    named = frozenset(
        p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )
    return named, any(p.kind == p.VAR_KEYWORD for p in params)


def as_keywords(net: nn.Module, x: Mapping) -> bool:
    """The rule: a mapping goes in as keyword arguments when ``net.forward`` names every key
    (or takes ``**kwargs``), else as one argument. A forward that only passes ``*args,
    **kwargs`` on to the model it wraps (peft's ``PeftModel`` without a task type, around a
    user's ``forward(self, data)`` as in laplace-torch's Hugging Face guide) is looked through:
    the wrapped model's (``get_base_model()``) forward decides."""
    forward = type(net).forward
    named, var = _keyword_names(forward)
    if var and named <= {"self"} and callable(getattr(net, "get_base_model", None)):
        base = net.get_base_model()
        if isinstance(base, nn.Module) and base is not net:
            return as_keywords(base, x)
    return var or set(x) <= named


def call_args(net: nn.Module, x: Inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``net``'s call on ``x`` (`as_keywords`), for ``functional_call``."""
    if isinstance(x, torch.Tensor) or not as_keywords(net, x):
        return (x,), {}
    return (), dict(x)


def output(out: object) -> torch.Tensor:
    """The tensor of a network's output: itself, the first element of a tuple or list, or the
    ``"logits"`` of a mapping (a Hugging Face ``ModelOutput``); a ``TypeError`` otherwise."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if "logits" in out and isinstance(out["logits"], torch.Tensor):
            return out["logits"]
        raise TypeError(
            f"net: its output is a mapping without 'logits' (keys {list(out)}); return the "
            "outputs (N, O) as a tensor, or under 'logits'"
        )
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"net: expected a tensor output (N, O), got {type(out).__name__}")


def call(net: nn.Module, x: Inputs) -> torch.Tensor:
    """``net`` on ``x`` by the rule (`as_keywords`), its output as a tensor (`output`)."""
    args, kwargs = call_args(net, x)
    return output(net(*args, **kwargs))
