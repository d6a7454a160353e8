"""How the bench scripts time a call that runs JAX work: `best_s` and `median_s`, each after
warm-up calls (the first compiles), each call waited on with ``jax.block_until_ready``; and
`interleaved_s`, several forms of one computation taking turns (with `add_round_flags`, the
flags that size it); `dram_flush`, a call that evicts the caches between timed calls."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax


def _times(
    call: Callable[[], object], runs: int, warmups: int, before: Callable[[], object] | None = None
) -> list[float]:
    for _ in range(warmups):
        jax.block_until_ready(call())
    times = []
    for _ in range(runs):
        if before is not None:
            jax.block_until_ready(before())
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def best_s(call: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` (≥ 1) timed calls, after one warm-up."""
    return min(_times(call, max(repeats, 1), warmups=1))


def median_s(
    call: Callable[[], object], calls: int, before: Callable[[], object] | None = None
) -> float:
    """The median of ``calls`` timed calls, after two warm-ups; ``before`` as in
    `interleaved_s`."""
    return statistics.median(_times(call, calls, warmups=2, before=before))


def dram_flush() -> Callable[[], object]:
    """A call that reads 400 MB (the read-bandwidth measurement's array, bench/roofline.py):
    run before a timed call, it leaves that call's operands in DRAM rather than in the caches."""
    total, array = jax.jit(jax.numpy.sum), jax.numpy.ones(100_000_000, jax.numpy.float32)
    return lambda: total(array)


def interleaved_s(
    calls: dict[str, Callable[[], object]],
    rounds: int,
    per_round: int,
    before: Callable[[], object] | None = None,
) -> dict:
    """Each call's best round (mean seconds per call), after a warm-up of each: ``rounds``
    rounds in which every call runs ``per_round`` times in turn, so load from other jobs falls
    on all of them alike. ``before`` runs (untimed) ahead of every timed call: e.g. a read of
    an array larger than the caches, so each call finds its operands in DRAM."""
    for call in calls.values():
        jax.block_until_ready(call())
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            spent = 0.0
            for _ in range(per_round):
                if before is not None:
                    jax.block_until_ready(before())
                start = time.perf_counter()
                jax.block_until_ready(call())
                spent += time.perf_counter() - start
            best[name] = min(best[name], spent / per_round)
    return best


def add_round_flags(parser: argparse.ArgumentParser, *, calls: int) -> None:
    """``--rounds`` (5) and ``--calls`` (``calls``) for `interleaved_s`."""
    parser.add_argument("--rounds", type=int, default=5, help="rounds, taking turns (5)")
    parser.add_argument("--calls", type=int, default=calls, help=f"calls per round ({calls})")
