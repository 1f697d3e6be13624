"""Process memory: hand large freed buffers back to the operating system (glibc), for processes
that move many multi-megabyte vectors in many threads: the coordinator and a host of many sites
(``afl-client run-many``).

glibc's malloc raises its mmap threshold each time a large mapped block is freed, so later blocks
of that size come from the per-thread arenas and stay resident when freed; with dozens of threads
each handling 4 MiB vectors, the process keeps every thread's high-water mark. Fixing the threshold (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``, which also
turns the dynamic adjustment off) maps every block above it on its own, so it is unmapped when
freed. Elsewhere than Linux with glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["MMAP_THRESHOLD_BYTES", "map_large_blocks"]

#: Blocks of at least this many bytes are mapped on their own (and returned when freed).
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def map_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True when the C library took it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (or no C library symbol table)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
