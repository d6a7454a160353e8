"""How the bench scripts time a call that runs JAX work: `best_s` and `median_s`, each after
warm-up calls (the first compiles), each call waited on with ``jax.block_until_ready``; and
`interleaved_s`, several forms of one computation taking turns (with `add_round_flags`, the
flags that size it)."""

from __future__ import annotations

import argparse
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


def interleaved_s(calls: dict[str, Callable[[], object]], rounds: int, per_round: int) -> dict:
    """Each call's best round (mean seconds per call), after a warm-up of each: ``rounds``
    rounds in which every call runs ``per_round`` times in turn, so load from other jobs falls
    on all of them alike."""
    for call in calls.values():
        jax.block_until_ready(call())
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(per_round):
                jax.block_until_ready(call())
            best[name] = min(best[name], (time.perf_counter() - start) / per_round)
    return best


def add_round_flags(parser: argparse.ArgumentParser, *, calls: int) -> None:
    """``--rounds`` (5) and ``--calls`` (``calls``) for `interleaved_s`."""
    parser.add_argument("--rounds", type=int, default=5, help="rounds, taking turns (5)")
    parser.add_argument("--calls", type=int, default=calls, help=f"calls per round ({calls})")
