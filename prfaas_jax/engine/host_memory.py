"""Host memory for a process that moves states: glibc's malloc set to reuse what is freed
(`reuse_freed_memory`), and a pool of the large blocks a state's fields are written into
(`BlockPool`; the process's is `STATE_BLOCKS`).

A state transfer allocates large blocks over and over: gRPC's message buffers (a frame of a few
MiB each), the `bytes` each message becomes, the arrays a decoded state is written into. glibc
serves a block above its mmap threshold (128 KiB at start, raised by itself up to 32 MiB as such
blocks are freed) with a fresh mapping and unmaps it on free, so every transfer faults its
memory in again, page by page, each page zeroed by the kernel first; on a VM each fault may also
go to the host. With the threshold at its 32 MiB ceiling from the start and freed memory kept in
the heap, the next transfer reuses pages already mapped: a second wave of ten 16 MiB blocks
faults no page in, against ~5,200 faults with glibc's defaults
(tests/engine/test_host_memory.py), and bench/codec.py runs both of its processes this way. The
cost: a process keeps up to `TRIM_BYTES` of freed memory mapped (its resident size stays near
its high-water mark), as with tcmalloc or jemalloc.

glibc maps anything above 32 MiB afresh, and so does a thread's arena (a gRPC handler's, which
decodes a push) above its 64 MiB heaps, whatever `mallopt` says: a state's long caches, hundreds
of MiB each at 128K tokens, would land on fresh pages every time, and that first touch costs as
much as the copy that fills them. `BlockPool` keeps such blocks itself. Each is an anonymous
mapping of a few size classes; a state field views it, and when the last view dies (JAX holds an
array it adopted until it lets the array go) the block goes back to the pool, still mapped, to
be the next state's. The cost: up to `keep_bytes` of free blocks stay resident (`KEEP_BYTES`;
a worker's is `[engine] state_pool_mib`).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

import numpy as np

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


POOLED_BYTES = 2**20  # smaller blocks come from malloc, whose heap reuses them as it is
KEEP_BYTES = 4 * 2**30


class BlockPool:
    """Writable, page-aligned host blocks of at least `POOLED_BYTES`, reused once nothing views
    them. Up to ``keep_bytes`` of free blocks stay mapped, the most recently freed; older ones
    are unmapped.

    ``take(n)`` returns a uint8 array of ``n`` bytes, the first bytes of a block of one of four
    size classes per power of two (≤ 25 % over ``n``). Its contents are what the block last
    held (zeros when new). The block comes back to the pool when that array, and every view of
    it, is gone; JAX holds an array it adopted as a view. Thread-safe.
    """

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self._free: list[tuple[int, mmap.mmap]] = []  # (size, block), the oldest freed first
        self._free_bytes = 0
        # Reentrant: a collection inside a locked section may end an array, and so give back.
        self._lock = threading.RLock()
        self.keep_bytes = keep_bytes
        self.taken = 0  # blocks handed out
        self.reused = 0  # of them, blocks that came back from an earlier `take`

    @property
    def keep_bytes(self) -> int:
        """The most bytes of free blocks kept; setting it lets the oldest go at once."""
        return self._keep_bytes

    @keep_bytes.setter
    def keep_bytes(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"keep_bytes must be ≥ 0, got {nbytes}")
        with self._lock:
            self._keep_bytes = nbytes
            self._trim()

    @property
    def free_bytes(self) -> int:
        """Bytes of the free blocks kept, ready to be taken."""
        return self._free_bytes

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes < POOLED_BYTES:
            raise ValueError(f"a pooled block is ≥ {POOLED_BYTES} bytes, not {nbytes}")
        size, block = size_class(nbytes), None
        with self._lock:
            self.taken += 1
            for i in range(len(self._free) - 1, -1, -1):  # the most recently freed first
                if self._free[i][0] == size:
                    block = self._free.pop(i)[1]
                    self._free_bytes -= size
                    self.reused += 1
                    break
        if block is None:
            # Private: a shared anonymous mapping is shmem, which gets no transparent huge
            # pages by default, and a forked child would write into the parent's block.
            block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy advises its own large arrays
                block.madvise(mmap.MADV_HUGEPAGE)
        array = np.frombuffer(block, np.uint8, nbytes)
        weakref.finalize(array, self._give_back, size, block).atexit = False
        return array

    def _give_back(self, size: int, block: mmap.mmap) -> None:
        # Called as the array dies, its view of the block still open: a block let go here is
        # unmapped once that view closes, with the last reference to it.
        with self._lock:
            self._free.append((size, block))
            self._free_bytes += size
            self._trim()

    def _trim(self) -> None:
        while self._free_bytes > self._keep_bytes:
            self._free_bytes -= self._free.pop(0)[0]


def size_class(nbytes: int) -> int:
    """The smallest of 2^k · {1, 1.25, 1.5, 1.75}, in whole pages, holding ``nbytes``."""
    step = max(1 << (max(nbytes - 1, 1).bit_length() - 3), mmap.PAGESIZE)
    return -(-nbytes // step) * step


STATE_BLOCKS = BlockPool()  # the process's: every decoded or rebuilt state's large fields
