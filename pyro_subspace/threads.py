"""The thread policy: small networks on a few cores run on one torch thread.

The networks this library trains and differentiates are small (MLPs of a few thousand to a few
hundred thousand weights). For them torch's intra-op threads cost more in synchronisation than
they gain; on a shared 2-core machine torch's default of two threads made a small-net SVI step
17x slower (117 ms vs 6.9 ms) and Lanczos 10-20x slower (issue 13).

So the library's entry points (`fit_map`, `PatchedNet.fit`, `subspaces.ggn_eigen`, the
``pyro-subspace`` command line) run inside `num_threads`, which sets ``torch.set_num_threads``
for the duration of the call and **restores the caller's setting on exit**. The number is, in
order of precedence:

1. the value given to `set_num_threads` (process-wide, until changed again);
2. the environment variable ``PYRO_SUBSPACE_NUM_THREADS``;
3. ``"auto"``: one thread on a machine with at most `FEW_CORES` logical cores, otherwise
   torch's own setting, unchanged.

Each setting is a positive int (that many threads), ``"auto"``, or ``"torch"`` (never touch
torch's thread count: the library then runs with whatever ``torch.get_num_threads()`` says).
Set ``PYRO_SUBSPACE_NUM_THREADS=torch`` (or call ``set_num_threads("torch")``) for large
networks on many cores.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["ENV_VAR", "FEW_CORES", "num_threads", "resolve_num_threads", "set_num_threads"]

#: the environment variable read when `set_num_threads` has not been called
ENV_VAR = "PYRO_SUBSPACE_NUM_THREADS"
#: ``"auto"`` runs single-threaded on machines with at most this many logical cores
FEW_CORES = 4

_setting: int | str | None = None  # None: not set, read the environment
#: the value of the innermost ``with num_threads(value)`` block, which library calls inside it
#: follow (over the process-wide policy)
_block: contextvars.ContextVar[int | str | None] = contextvars.ContextVar(
    "pyro_subspace_threads_block", default=None
)
F = TypeVar("F", bound=Callable)


def _check_setting(value: object, name: str) -> int | str:
    """``value`` as a positive int, ``"auto"`` or ``"torch"``; else a ValueError naming ``name``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "torch"):
            return text
        if text.isdigit() and int(text) >= 1:
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{name}: expected a positive int, 'auto' or 'torch', got {value!r}")


def set_num_threads(value: int | str | None) -> None:
    """Set the library's thread policy for the whole process.

    Args:
        value: a positive int (that many torch threads inside library calls), ``"auto"`` (one
            thread on at most `FEW_CORES` cores, else torch's setting), ``"torch"`` (leave
            torch's thread count alone), or ``None`` (forget the setting: read
            ``PYRO_SUBSPACE_NUM_THREADS`` again).

    This does not call ``torch.set_num_threads`` itself: the policy applies inside the
    library's entry points, which restore the caller's torch setting when they return.
    """
    global _setting
    _setting = None if value is None else _check_setting(value, "value")


def resolve_num_threads() -> int | None:
    """The torch thread count library calls use now; ``None``: torch's setting, untouched."""
    if _setting is not None:
        setting = _setting
    else:
        env = os.environ.get(ENV_VAR)
        setting = "auto" if env in (None, "") else _check_setting(env, ENV_VAR)
    return _resolve_one(setting)


@contextlib.contextmanager
def num_threads(value: int | str | None = None) -> Iterator[int]:
    """Run the block with torch's intra-op thread count set by the policy, restored on exit.

    Args:
        value: as in `set_num_threads` for this block only, including the library's calls
            inside it; ``None``: the enclosing block's value, else the process-wide policy.

    Yields:
        ``torch.get_num_threads()`` inside the block.

    Example:
        >>> with num_threads(1):
        ...     torch.get_num_threads()
        1
    """
    block = _block.get()
    if value is not None:
        value = _check_setting(value, "value")
    elif block is not None:  # inside `with num_threads(v)`: the library's calls use v too
        value = block
    n = resolve_num_threads() if value is None else _resolve_one(value)
    before = torch.get_num_threads()
    changed = n is not None and n != before
    if changed:
        torch.set_num_threads(n)
    token = _block.set(value if value is not None else block)
    try:
        yield torch.get_num_threads()
    finally:
        _block.reset(token)
        if changed:
            torch.set_num_threads(before)


def _resolve_one(value: int | str) -> int | None:
    """Threads for one setting (a positive int, ``"auto"``, ``"torch"``; ``None``: untouched)."""
    setting = _check_setting(value, "value")
    if setting == "torch":
        return None
    if setting == "auto":
        return 1 if (os.cpu_count() or 1) <= FEW_CORES else None
    return int(setting)


def thread_policy(fn: F) -> F:
    """Decorator: run ``fn`` inside `num_threads` (the process-wide policy)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with num_threads():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
