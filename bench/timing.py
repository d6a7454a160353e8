"""How the bench scripts time a call that runs JAX work: `best_s` and `median_s`, each after
warm-up calls (the first compiles), each call waited on with ``jax.block_until_ready``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def _times(call: Callable[[], object], runs: int, warmups: int) -> list[float]:
    for _ in range(warmups):
        jax.block_until_ready(call())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def best_s(call: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` (≥ 1) timed calls, after one warm-up."""
    return min(_times(call, max(repeats, 1), warmups=1))


def median_s(call: Callable[[], object], calls: int) -> float:
    """The median of ``calls`` timed calls, after two warm-ups."""
    return statistics.median(_times(call, calls, warmups=2))
