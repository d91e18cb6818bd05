"""`run_chains`: independent MCMC chains (or any seeded computation) in separate processes.

Pyro's own driver, ``MCMC(kernel, num_chains=C)``, is enough when the machine has at least
``C + 1`` cores: it then runs the chains in parallel processes (``fork`` by default; pass
``mp_context="spawn"`` with CUDA, which needs a picklable model and a ``__main__`` guard), chain
``i`` seeded with ``torch.initial_seed() + i``, and returns the samples grouped by chain
(``get_samples(group_by_chain=True)``, ``arviz.from_pyro``). With fewer cores it warns and runs
the chains one after another in the calling process, each continuing the previous chain's random
stream, so the same script gives other chains on a laptop than on a server (measured with
`EllipticalSliceSampler`: chain 1 differs). It also sends every draw to the main process as it
is made, and it only runs a Pyro kernel on one machine.

`run_chains` adds: chain ``i`` always runs after ``pyro.set_rng_seed(seed + i)``, in its own
process on one torch thread, so its result is the one ``fn(i)`` gives in this process after the
same seeding, whatever the number of cores or processes (``processes=0`` runs them here, one
after another, for debugging); the chain is any function (a whole SWA + PCA + ESS pipeline per
seed, an ``MCMC(..., num_chains=1)`` run); and under ``torchrun`` (an initialised process
group, `distributed`) the chains are dealt to the ranks of all machines. The processes come
from ``torch.multiprocessing``; results travel once, at the end, by ``torch.save``.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import traceback
from collections.abc import Callable
from typing import Any

import pyro
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import distributed, rng, validation

__all__ = ["run_chains"]


#: the largest seed `pyro.set_rng_seed` takes (NumPy's limit, ``2³² − 1``)
MAX_SEED = 2**32 - 1


def run_chains(
    fn: Callable[[int], Any],
    num_chains: int,
    *,
    seed: int = 0,
    processes: int | None = None,
    threads: int = 1,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(0), …, fn(num_chains - 1)``, chain ``i`` after ``pyro.set_rng_seed(seed + i)``.

    Args:
        fn: one chain, ``fn(i) -> result`` (e.g. ``mcmc.get_samples()``, a dict of tensors
            ``(draws, ...)``); anything ``torch.save`` can write. With ``start_method="spawn"``
            it must be a module-level function (pickled by name).
        num_chains: ``C``, the number of chains.
        seed: chain ``i`` is seeded with ``seed + i`` (torch, Python's and NumPy's generators).
        processes: how many chains run at once, each in its own process (default
            ``min(C, os.cpu_count())``); ``0``: all in this process, one after another (the
            caller's random state is restored afterwards). Ignored under a process group.
        threads: ``torch.set_num_threads`` in each process.
        start_method: ``torch.multiprocessing`` start method; default ``"fork"`` where it
            exists and CUDA is not initialised, else ``"spawn"``.

    Returns:
        The ``C`` results in chain order. Under an active process group (``torchrun``) rank
        ``r`` runs chains ``r, r + R, …`` in its own process, inside `distributed.local` (each
        rank's data are its full copy: chains are not data-parallel), and every rank returns
        all ``C`` results (``all_gather_object``). Stack them for ArviZ:
        ``{k: torch.stack([s[k] for s in results]) for k in results[0]}`` is
        ``(chains, draws, ...)``, what ``arviz.from_dict(posterior=...)`` takes.

    Raises:
        RuntimeError: a chain raised (its traceback is in the message) or its process died.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable fn(chain), got {type(fn).__name__}")
    validation.positive_int(num_chains, "num_chains")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    if seed < 0 or seed + num_chains - 1 > MAX_SEED:  # every chain's, before any chain runs
        raise ValueError(
            f"seed: chains are seeded seed + i for i < num_chains={num_chains}, and NumPy takes "
            f"seeds in [0, {MAX_SEED}]: use 0 <= seed <= {MAX_SEED - num_chains + 1}, got {seed}"
        )
    validation.positive_int(threads, "threads")
    if processes is not None and (
        isinstance(processes, bool) or not isinstance(processes, int) or processes < 0
    ):
        raise ValueError(f"processes: expected None or an int >= 0, got {processes!r}")
    methods = mp.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        raise ValueError(f"start_method: expected one of {methods}, got {start_method!r}")
    if distributed.active():
        rank, size = distributed.world()
        with distributed.local():
            mine = _in_process(fn, range(rank, num_chains, size), seed)
        gathered: list[list[Any]] = [[] for _ in range(size)]
        dist.all_gather_object(gathered, mine)
        return [gathered[i % size][i // size] for i in range(num_chains)]
    if processes == 0:
        return _in_process(fn, range(num_chains), seed)
    if start_method is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        start_method = "fork" if "fork" in methods and not cuda else "spawn"
    processes = min(num_chains, processes or os.cpu_count() or 1)
    return _in_processes(fn, num_chains, seed, processes, threads, mp.get_context(start_method))


def _in_process(fn: Callable[[int], Any], chains: range, seed: int) -> list[Any]:
    """The chains in this process; the caller's random state (torch's CPU and CUDA generators,
    NumPy's, Python's) is restored afterwards."""
    with rng.preserved():
        out = []
        for i in chains:
            pyro.set_rng_seed(seed + i)
            out.append(fn(i))
        return out


def _chain(fn: Callable[[int], Any], chain: int, seed: int, threads: int, results) -> None:
    """One chain in a child process: its result (``torch.save`` bytes) or its traceback."""
    torch.set_num_threads(threads)
    try:
        pyro.set_rng_seed(seed + chain)
        buffer = io.BytesIO()
        torch.save(fn(chain), buffer)
        results.put((chain, True, buffer.getvalue()))
    except BaseException:
        results.put((chain, False, traceback.format_exc()))


def _in_processes(fn, num_chains: int, seed: int, processes: int, threads: int, ctx) -> list:
    results = ctx.Queue()
    waiting, running, done = list(range(num_chains)), {}, {}
    try:
        while waiting or running:
            while waiting and len(running) < processes:
                chain = waiting.pop(0)
                running[chain] = ctx.Process(
                    target=_chain, args=(fn, chain, seed, threads, results), daemon=True
                )
                running[chain].start()
            try:
                chain, ok, payload = results.get(timeout=0.5)
            except queue_module.Empty:
                for chain, proc in running.items():
                    if not proc.is_alive() and results.empty():
                        raise RuntimeError(
                            f"run_chains: the process of chain {chain} died (exit code "
                            f"{proc.exitcode}) without a result"
                        ) from None
                continue
            running.pop(chain).join()
            if not ok:
                raise RuntimeError(f"run_chains: chain {chain} raised:\n{payload}")
            done[chain] = torch.load(io.BytesIO(payload), weights_only=False)  # our own child
    finally:
        for proc in running.values():
            if proc.is_alive():
                proc.terminate()
            proc.join()
    return [done[i] for i in range(num_chains)]
