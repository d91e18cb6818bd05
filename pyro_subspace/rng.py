"""The caller's global random state: save it, restore it, and seed a block without leaking.

Library calls that take a ``seed`` but still draw from a global generator (a network's
initialisation in ``train_ensemble``, a Pyro model's sample sites in ``to_inference_data``, the
chains of ``run_chains(processes=0)``) run those draws inside `seeded`: the draws are exactly
those that follow ``torch.manual_seed(seed)`` (and ``np.random.seed``/``random.seed``), and
afterwards torch's (CPU, CUDA, MPS), NumPy's and Python's global generators are back where the
caller left them, so the caller's later draws depend on the caller's own seed only.

CUDA: the states of all devices are saved when CUDA is initialised. When it is not, torch keeps
a seed (``torch.manual_seed``) pending until CUDA starts; the caller's pending seed is put back,
and if the block itself started CUDA, every device is reset to what the caller's pending seed
(or torch's default seed) gives a freshly started device.
"""

from __future__ import annotations

import contextlib
import importlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .validation import check_int

__all__ = ["get_state", "preserved", "seeded", "set_state"]


def get_state(*, numpy: bool = True, python: bool = True) -> dict[str, Any]:
    """The global random state: torch's CPU generator (key ``"torch"``), the CUDA devices'
    (``"cuda"``, when CUDA is initialised; else ``"cuda_pending"``, the seeds torch holds until
    it starts), MPS's (``"mps"``, where available), NumPy's (``"numpy"``) and Python's
    (``"random"``); ``numpy=False``/``python=False`` leave those two out. `set_state` takes it."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    else:
        state["cuda_pending"] = _pending_cuda_seeds()
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    if numpy:
        state["numpy"] = np.random.get_state()
    if python:
        state["random"] = random.getstate()
    return state


def set_state(state: dict[str, Any]) -> None:
    """Restore the generators saved in ``state`` (`get_state`); the others are left alone."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    elif "cuda_pending" in state:
        _restore_pending_cuda_seeds(state["cuda_pending"])
    if "mps" in state:
        torch.mps.set_rng_state(state["mps"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "random" in state:
        random.setstate(state["random"])


@contextlib.contextmanager
def preserved(*, numpy: bool = True, python: bool = True) -> Iterator[None]:
    """Run the block, then put the global generators back as they were before it (also when
    it raises): draws inside come from the caller's streams, which do not advance outside it.
    ``numpy=False``/``python=False``: those generators are not restored (draws advance them).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> with preserved():
        ...     _ = torch.randn(3)
        >>> after = torch.randn(2)
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(after, torch.randn(2))
        True
    """
    state = get_state(numpy=numpy, python=python)
    try:
        yield
    finally:
        set_state(state)


def import_keeping_state(module: str):
    """``importlib.import_module(module)`` with the global generators put back afterwards: a
    library imported on first use must not draw from the user's streams (scikit-learn, when
    rich is installed, imports rich, whose import calls ``random.getrandbits``)."""
    with preserved():
        return importlib.import_module(module)


@contextlib.contextmanager
def seeded(seed: int | None, *, numpy: bool = True, python: bool = True) -> Iterator[None]:
    """Run the block after ``torch.manual_seed(seed)`` (and ``np.random.seed(seed)``,
    ``random.seed(seed)``: ``pyro.set_rng_seed``), inside `preserved`: the block's draws are the
    seeded ones, and the caller's generators are afterwards where they were before it.
    ``numpy=False``/``python=False``: that generator is neither seeded nor restored.
    ``seed=None``: no seeding and no restoring (the block draws from the caller's streams).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> with seeded(5):
        ...     a = torch.randn(2)
        >>> after = torch.randn(2)
        >>> _ = torch.manual_seed(5)
        >>> torch.equal(a, torch.randn(2))
        True
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(after, torch.randn(2))
        True
    """
    if seed is None:
        yield
        return
    # NumPy takes seeds in [0, 2³² − 1]; torch alone any 64-bit integer
    low, high = (0, 2**32 - 1) if numpy else (-(2**63), 2**64 - 1)
    check_int(seed, "seed", low, high)
    with preserved(numpy=numpy, python=python):
        torch.manual_seed(seed)
        if numpy:
            np.random.seed(seed)
        if python:
            random.seed(seed)
        yield


def _pending_cuda_seeds() -> tuple | None:
    """The seeds torch holds for CUDA until it is initialised (``torch.cuda`` keeps them in a
    private tracker; ``None`` when this torch has none)."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    names = ("manual_seed_all_cb", "manual_seed_cb", "call_order")
    if tracker is None or not all(hasattr(tracker, n) for n in names):
        return None
    return tracker.manual_seed_all_cb, tracker.manual_seed_cb, list(tracker.call_order)


def _restore_pending_cuda_seeds(pending: tuple | None) -> None:
    if pending is None:
        return
    seed_all, seed_current, order = pending
    if not torch.cuda.is_initialized():  # still pending: put the caller's seeds back
        tracker = torch.cuda._lazy_seed_tracker
        tracker.manual_seed_all_cb, tracker.manual_seed_cb = seed_all, seed_current
        tracker.call_order = list(order)
        return
    # CUDA started inside the block: a fresh device generator, then the caller's pending seeds
    default_seed = torch.Generator().initial_seed()  # torch's default seed, also CUDA's
    for gen in torch.cuda.default_generators:
        gen.manual_seed(default_seed)
    for call in order:
        if call:
            call[0]()
