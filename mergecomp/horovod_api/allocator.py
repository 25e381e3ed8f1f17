"""glibc malloc settings for training loops that free their gradients every step.

Each step autograd allocates the gradients anew (``zero_grad()`` sets them to None) and the
step frees them again. With glibc's default settings, freed memory at the top of the heap beyond
the *trim threshold* (at most 64 MiB, moving with the allocations it sees) goes back to the
operating system, and the next backward pass takes it again page by page: on ResNet-50 (100 MB
of gradients) 5,000 to 22,000 page faults in a step, about 10 ms on the benchmark machine,
depending on where the heap's blocks happen to lie. :func:`hold_freed_memory` keeps freed memory
in the process instead (the heap stays at its peak, which a training loop reaches every step
anyway).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["hold_freed_memory", "TRIM_THRESHOLD", "MMAP_THRESHOLD"]

logger = logging.getLogger("mergecomp")

#: freed memory at the top of the heap kept in the process, up to this many bytes
TRIM_THRESHOLD = 1 << 30
#: blocks at least this large are mapped on their own (glibc's largest automatic threshold)
MMAP_THRESHOLD = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
#: environment variables by which the user already chose (``MERGECOMP_HOLD_FREED_MEMORY=0``: no)
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_done = False


def hold_freed_memory() -> bool:
    """Set glibc's trim threshold to :data:`TRIM_THRESHOLD` and its mmap threshold to
    :data:`MMAP_THRESHOLD` (fixed; glibc would otherwise move it up to that value itself), once
    per process. Nothing on other C libraries or systems, or where the environment already sets
    glibc's malloc (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``,
    ``GLIBC_TUNABLES``) or ``MERGECOMP_HOLD_FREED_MEMORY=0``. Returns whether the settings are
    in place."""
    global _done
    if _done:
        return True
    if (not sys.platform.startswith("linux") or os.environ.get("MERGECOMP_HOLD_FREED_MEMORY", "1") == "0"
            or any(name in os.environ for name in _USER_SETTINGS)):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: other C libraries' mallopt (if any) differ
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _done:
        logger.info("mergecomp: glibc malloc keeps up to %d MiB of freed memory (MERGECOMP_HOLD_FREED_MEMORY=0: "
                    "glibc's defaults)", TRIM_THRESHOLD >> 20)
    return _done
