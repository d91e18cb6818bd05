"""All-or-nothing fits: a post-hoc fit, refit or tuning either completes or leaves the object
exactly as it was.

`transaction(*objects)` snapshots what a fit may change (the buffers and parameters of every
``nn.Module`` reached, in place or by replacement, and the plain attributes of every object,
containers copied one level deep) and restores it when the block raises anything, a
``KeyboardInterrupt`` included, before the exception propagates. A module's buffers that no
operation writes in place, only replaces (a subspace's index basis, a K-FAC posterior's
eigenvectors; the module names them by `REPLACED_ONLY`), are kept by reference, not copied:
restoring puts the original object back, and an in-place write into one inside the block is a
library error the transaction reports (``RuntimeError``) rather than leave unrestorable. So are
frozen parameters (``requires_grad=False``: a pretrained base under a LoRA adapter), which no
fit writes (the flat vector holds the trainable weights only): the snapshot's memory follows
the trainable weights, as everything else's does. Fits write their results in
place to avoid a second copy of large buffers, so the snapshot is a copy: when its bytes would
exceed ``budget`` (default `BUDGET_BYTES`) no copy is taken and ``on_overflow`` (e.g. "mark the
object unfitted") runs instead on failure, so an interrupted fit never reports itself fitted
with half of its new state.

Example:
    >>> import torch
    >>> from torch import nn
    >>> lin = nn.Linear(2, 1)
    >>> before = lin.weight.detach().clone()
    >>> def failing_fit():
    ...     with transaction(lin):
    ...         lin.weight.data.add_(1.0)
    ...         raise RuntimeError("interrupted")
    >>> failing_fit()
    Traceback (most recent call last):
    ...
    RuntimeError: interrupted
    >>> bool(torch.equal(lin.weight, before))
    True
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .validation import check_int

#: the most bytes a snapshot copies (256 MiB); above it an interrupted fit calls
#: ``on_overflow`` (mark unfitted) instead of restoring
BUDGET_BYTES = 256 * 2**20

_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")

#: the name of a module's method returning the names of its buffers that every operation
#: replaces and none writes in place: the snapshot keeps them by reference
REPLACED_ONLY = "buffers_replaced_only"


def _is_shared_zero(t: torch.Tensor) -> bool:
    """An expanded tensor (a zero stride): never written in place, so kept by reference."""
    return t.numel() > 1 and 0 in t.stride()


class _Snapshot:
    def __init__(self, objects: tuple[object, ...]) -> None:
        self.modules: list[nn.Module] = []
        self.plain: list[object] = []
        seen: set[int] = set()
        for obj in objects:
            if isinstance(obj, nn.Module):
                for m in obj.modules():
                    if id(m) not in seen:
                        seen.add(id(m))
                        self.modules.append(m)
            elif obj is not None and id(obj) not in seen:
                seen.add(id(obj))
                self.plain.append(obj)

    def _copied(self):
        """``(module, slot, name, tensor, copy?)`` of every parameter and buffer."""
        for m in self.modules:
            by_reference = getattr(m, REPLACED_ONLY, None)
            by_reference = frozenset(by_reference()) if by_reference is not None else frozenset()
            for slot in ("_parameters", "_buffers"):
                for name, t in getattr(m, slot).items():
                    copy_it = t is not None and not _is_shared_zero(t)
                    kept = name in by_reference if slot == "_buffers" else t is not None and not t.requires_grad
                    yield m, slot, name, t, copy_it and not kept

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for *_, t, copy_it in self._copied() if copy_it)

    def take(self) -> None:
        self.tensors = []  # (module, slot, name, original object, copy of its values)
        self.kept = []  # (module, name, tensor, its version): kept by reference
        for m, slot, name, t, copy_it in self._copied():
            self.tensors.append((m, slot, name, t, t.detach().clone() if copy_it else None))
            if t is not None and not copy_it and not _is_shared_zero(t):
                self.kept.append((m, name, t, t._version))
        self.attrs = [(o, _copy_attrs(o)) for o in self.modules + self.plain]

    def check_kept(self) -> None:
        """Raise if a buffer kept by reference was written in place (it cannot be restored)."""
        for m, name, t, version in self.kept:
            if t._version != version:
                raise RuntimeError(
                    f"transaction: {type(m).__name__}.{name} is kept by reference (a frozen "
                    f"parameter, or a buffer declared replaced-only by {REPLACED_ONLY}) but was "
                    "written in place; please report this bug"
                )

    def restore(self) -> None:
        self.check_kept()
        for m, slot, name, t, values in self.tensors:
            getattr(m, slot)[name] = t  # the original object, if a fit replaced it
            if values is not None:
                with torch.no_grad():
                    t.copy_(values)
        for o, attrs in self.attrs:
            d = o.__dict__
            for key in [k for k in d if k not in attrs and k not in _MODULE_SLOTS]:
                del d[key]
            d.update(attrs)


def _copy_attrs(obj: object) -> dict:
    """``obj.__dict__`` without a module's slots, containers copied one level deep (a fit that
    appends to a list or updates a set in place is undone too)."""
    out = {}
    for key, value in obj.__dict__.items():
        if key in _MODULE_SLOTS:
            continue
        out[key] = copy.copy(value) if isinstance(value, (list, dict, set)) else value
    return out


@contextmanager
def transaction(
    *objects: object,
    budget: int | None = None,
    on_overflow: Callable[[], None] | None = None,
) -> Iterator[None]:
    """Undo every change to ``objects`` if the block raises (any exception).

    Args:
        objects: ``nn.Module`` objects (all their submodules' parameters, buffers and attributes) and
            plain objects (their attributes).
        budget: the most bytes the snapshot may copy (``None``: `BUDGET_BYTES`).
        on_overflow: called on failure instead of restoring when the snapshot would exceed
            ``budget`` (it must leave the object marked unfitted); ``None``: copy anyway.
    """
    check_int(budget, "budget", 0, allow_none=True)
    if on_overflow is not None and not callable(on_overflow):
        raise TypeError(f"on_overflow: expected a callable or None, got {on_overflow!r}")
    snap = _Snapshot(objects)
    budget = BUDGET_BYTES if budget is None else budget
    restore = on_overflow is None or snap.nbytes() <= budget
    if restore:
        snap.take()
    try:
        yield
    except BaseException:
        if restore:
            snap.restore()
        else:
            on_overflow()
        raise
    if restore:
        snap.check_kept()


def transactional(
    targets: Callable[[object], tuple[object, ...]],
    on_overflow: Callable[[object], None] | None = None,
) -> Callable:
    """A method decorator: run the method inside `transaction` over ``targets(self)``, with
    ``on_overflow(self)`` when the snapshot would exceed the budget."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapped(self, *args: object, **kwargs: object):
            overflow = None if on_overflow is None else functools.partial(on_overflow, self)
            with transaction(*targets(self), on_overflow=overflow):
                return method(self, *args, **kwargs)

        return wrapped

    return decorate


__all__ = ["BUDGET_BYTES", "REPLACED_ONLY", "transaction", "transactional"]
