"""glibc's malloc, set for a process that moves states: `reuse_freed_memory`.

A state transfer allocates large blocks over and over: gRPC's message buffers (a frame of a few
MiB each), the `bytes` each message becomes, the arrays a decoded state is written into. glibc
serves a block above its mmap threshold (128 KiB at start, raised by itself up to 32 MiB as such
blocks are freed) with a fresh mapping and unmaps it on free, so every transfer faults its
memory in again, page by page, each page zeroed by the kernel first; on a VM each fault may also
go to the host. With the threshold at its 32 MiB ceiling from the start and freed memory kept in
the heap, the next transfer reuses pages already mapped: a second wave of ten 16 MiB blocks
faults no page in, against ~5,200 faults with glibc's defaults
(tests/engine/test_host_memory.py), and bench/codec.py runs both of its processes this way. The
cost: a process keeps up to `TRIM_BYTES` of freed memory
mapped (its resident size stays near its high-water mark), as with tcmalloc or jemalloc.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # the most glibc accepts on a 64-bit system
TRIM_BYTES = 2**30


def reuse_freed_memory() -> bool:
    """Keep freed blocks of up to 32 MiB, and up to `TRIM_BYTES` of freed heap, for reuse.

    Process-wide, for allocations made from now on. Returns whether the C library took the
    settings: False where it is not glibc (nothing changes there).
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    took_mmap = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    took_trim = mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)
    return bool(took_mmap and took_trim)
