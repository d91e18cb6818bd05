"""Giving freed memory back to the operating system after a large pass.

glibc's ``malloc`` keeps the memory of freed allocations below its mmap threshold (dynamic, up
to 32 MiB on 64-bit Linux) in its heap. A pass that allocates many such blocks leaves that
memory free but counted in the process's RSS: after the Jacobian passes of a full-covariance
subnetwork Laplace over ResNet-18 at ``K = 42,438`` (row blocks of 80 × 42,438 float32, 13.6 MB
each, and their per-layer products) the heap held 5.3 GB (``/proc/PID/smaps``, ``[heap]``)
beside the two 7.2 GB ``(K, K)`` matrices formed next: 19.8 GB where 15 GB was live.
`trim` asks glibc to return the free pages (``malloc_trim(0)``, which since glibc 2.8 releases
free pages anywhere in the heap); with another C library (macOS, musl, Windows) it does
nothing. Called where a pass that built at least `TRIM_MIN_BYTES` has ended: a fit's Jacobian passes
(the GGN), a grid search's validation Jacobians (`tuning.grid_covariances`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

#: `trim` after a pass whose result holds at least this many bytes (256 MiB): below, the freed
#: heap is small beside what the process holds. (The walk itself is cheap: 3 ms to give back
#: 1.8 GB of freed 12 MB blocks on this project's machine.)
TRIM_MIN_BYTES = 1 << 28


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc: no malloc_trim
        return None


def trim() -> bool:
    """Return the free pages of the C heap to the operating system; ``True`` if the C library
    has ``malloc_trim`` (glibc) and it released memory."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


def trim_after(nbytes: int) -> bool:
    """`trim` when a pass built at least `TRIM_MIN_BYTES` (``nbytes``); else nothing."""
    return trim() if nbytes >= TRIM_MIN_BYTES else False
