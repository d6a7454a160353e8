"""Python's cyclic garbage collector, set for a process that traces JAX programs:
`collect_for_tracing`.

Tracing and lowering a program allocate objects by the hundred thousand, and most of them live on
(JAX caches traces and executables). With Python's default thresholds that growth starts a
collection of the oldest generation every ~70,000 net allocations, and each one walks every
object the process holds — all of JAX, Flax, NumPy and gRPC once they are imported. In a worker
warming its engines that is ~10 % of its start-up CPU; in a process that also holds torch and
transformers, a third of the time it spends tracing a full-size config. In a serving process
every such collection is also a pause of the decode loop.
"""

from __future__ import annotations

import gc


def collect_for_tracing() -> None:
    """Keep what exists now out of every later collection (`gc.freeze`: the imported modules, in
    a process that calls this after its imports), collect the young generation every 10,000 net
    allocations instead of 700, and the oldest every ~10 million instead of ~70,000 (cyclic
    garbage is still collected, later)."""
    gc.freeze()  # no collection first: ~60 ms, and a worker's imports leave no garbage to free
    gc.set_threshold(10_000, 10, 100)
