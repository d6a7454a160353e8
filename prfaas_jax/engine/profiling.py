"""Timing the engines on the current device: `time_prefill` (T_prefill per prompt length) and
`time_decode` (one decode step per batch size), for `prfaas profile`.

Each measurement runs once to compile (not timed), then ``repeats`` times; the minimum is kept,
the time the device takes when nothing else competes for it (on a shared machine the median
carries the neighbours' load). With ``mean=True`` the mean is kept instead: on a node whose CPU
time is rationed (a node class's quota, serving/cluster/cgroups.py) a short run may fit in one
period's allowance, and the mean is what the node sustains. Prefill is the `PrefillEngine` call
a serving worker makes, from tokens to the state and the first token, over random prompts;
decode is `DecodeEngine.step` with every slot full of a prefilled state."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import DEFAULT_CHUNK_LEN, PrefillEngine
from prfaas_jax.engine.sampling import GREEDY
from prfaas_jax.model.hybrid import Params

Done = Callable[[str], None]  # called after each measurement with what was measured


def _statistic(mean: bool) -> Callable[[list[float]], float]:
    return (lambda runs: float(np.mean(runs))) if mean else min


def _prompt(cfg: ModelConfig, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, length, dtype=np.int64)


def time_prefill(
    cfg: ModelConfig,
    params: Params,
    lengths: Sequence[int],
    *,
    repeats: int = 3,
    impl: str = "chunk",
    buckets: Sequence[int] | None = None,
    chunk_len: int = DEFAULT_CHUNK_LEN,
    max_len: int | None = None,
    mean: bool = False,
    done: Done | None = None,
) -> list[float]:
    """Seconds to prefill one prompt of each length (the best of ``repeats`` after a compile).
    ``buckets``, ``chunk_len`` and ``max_len`` (the state's capacity, which a chunk's attention
    spans): the engine's, as a serving worker runs it (default: one bucket per length, each
    prompt's own capacity)."""
    engine = PrefillEngine(
        cfg, params, impl=impl, buckets=buckets or sorted(set(lengths)), chunk_len=chunk_len
    )
    keep = _statistic(mean)
    times = []
    for length in lengths:
        engine.prefill(_prompt(cfg, length, 0), max_len=max_len)  # compile
        runs = []
        for repeat in range(repeats):
            result = engine.prefill(_prompt(cfg, length, repeat + 1), max_len=max_len)
            runs.append(result.timings["run_s"])
        times.append(keep(runs))
        if done is not None:
            done(f"prefill {length} tokens: {times[-1]:.4f} s")
    return times


def time_decode(
    cfg: ModelConfig,
    params: Params,
    batch_sizes: Sequence[int],
    *,
    prompt_len: int = 64,
    repeats: int = 8,
    impl: str = "chunk",
    max_len: int | None = None,
    mean: bool = False,
    done: Done | None = None,
) -> list[float]:
    """Seconds of one decode step with ``B`` full slots, for each B of ``batch_sizes``;
    ``max_len``: each slot's capacity, as a serving worker's (default: just enough)."""
    capacity = max(max_len or 0, prompt_len + repeats + 3)
    prefilled = PrefillEngine(cfg, params, impl=impl).prefill(
        _prompt(cfg, prompt_len, 0), max_len=capacity
    )
    keep = _statistic(mean)
    times = []
    for batch in batch_sizes:
        engine = DecodeEngine(cfg, params, max_slots=batch, max_len=capacity, impl=impl)
        for _ in range(batch):
            engine.insert(
                prefilled.state, prefilled.first_token, GREEDY, max_new_tokens=repeats + 3
            )
        engine.step()  # compile
        engine.step()  # and one untimed step: the first after a compile runs cold
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(engine.step())
            runs.append(time.perf_counter() - start)
        times.append(keep(runs))
        if done is not None:
            done(f"decode batch {batch}: {times[-1]:.4f} s/step")
    return times
