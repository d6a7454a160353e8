"""``plan_calls``: how ``PrefillEngine.prefill_batch`` packs several prompts into compiled calls;
``call_rows``: the row counts above one that such a call of a given block can have (what a worker
compiles); ``BatchCall``: one such packing; ``row_size``: the positions a row is
padded to; ``share_rows``: the prompts split between threads that run their calls at once;
``plan_shares``: each share's calls;
``batch_threads``: how many such threads; ``row_states``: the batch-1 states of a batched state's
rows; ``sampling_args``: the first-token sampler's per-row arguments for a call's rows.

Rows are grouped by shape, ``(block_len, capacity)``: those batch-1 ``prefill`` compiles for the
prompt alone, except that a row is padded to ``row_size`` — its length rounded up to a multiple
of an eighth of its bucket, and of the linear ops' 64-token chunk — rather than to the whole
bucket. Prompts of 257–512 tokens then run in blocks of 320, 384, 448 or 512 positions, not all
in 512: for lengths spread evenly over a bucket's upper half about a fifth fewer padded positions,
for at most four compiles per bucket and row count. Within a group, rows (shortest first) fill
calls of at most ``max_batch_tokens`` padded tokens, each call a power of two of rows (a group
of 5 runs as 4 + 1), so compiles stay bounded and no call computes an empty row. Long prompts
still chunk at multiples of ``chunk_len``: block ``c`` of every row absorbs its positions
``[c·chunk_len, (c+1)·chunk_len)``, and a row already done takes an empty block (``valid_len``
0: it neither writes nor decays anything) while longer rows finish.

Threads. XLA:CPU runs one of these programs on one core: a call of B rows costs about B times
one row, so rows in one call save only the per-prompt host work and calls. What batching gives on
a CPU is that prompts are independent: ``share_rows`` splits them into as many shares as the
process has cores (``batch_threads``), balanced by padded tokens, and each share's calls run in a
thread of their own, at the same time as the others'. One device stream would only serialise
them, so an accelerator runs one share.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.sampling import SamplingParams, request_key, sampling_knobs
from prfaas_jax.engine.state_resize import with_capacity
from prfaas_jax.errors import EngineError
from prfaas_jax.model import ModelState

# The delta rule's and Lightning's chunk (ops/): a block of a multiple of it pads nothing inside.
_LINEAR_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class BatchCall:
    """Rows that share one compiled shape: ``rows`` index the caller's prompts, in row order."""

    rows: tuple[int, ...]  # a power of two of them
    block_len: int  # tokens per row per call
    capacity: int  # positions of the working state's growing caches
    blocks: int  # calls: the longest row's chunks

    def windows(self, lengths: Sequence[int], chunk_len: int) -> list[np.ndarray]:
        """Per call, each compiled row's ``[start, end)`` positions (``start == end``: empty)."""
        out = []
        for c in range(self.blocks):
            spans = np.zeros((len(self.rows), 2), np.int64)
            for slot, row in enumerate(self.rows):
                spans[slot] = [
                    min(c * chunk_len, lengths[row]),
                    min((c + 1) * chunk_len, lengths[row]),
                ]
            out.append(spans)
        return out


def row_size(length: int, bucket: int) -> int:
    """The positions a batched row of ``length`` tokens is padded to, ``bucket`` (≥ ``length``)
    being batch-1 prefill's: ``length`` rounded up to a multiple of ``bucket / 8`` and of the
    linear ops' chunk, at most ``bucket``."""
    step = max(_LINEAR_CHUNK, bucket // 8)
    return min(bucket, -(-length // step) * step)


def plan_calls(
    lengths: Sequence[int],
    shape_of: Callable[[int], tuple[int, int]],
    *,
    chunk_len: int,
    max_batch_tokens: int,
) -> list[BatchCall]:
    """Calls that prefill prompts of ``lengths``; ``shape_of(length)`` is batch-1 prefill's
    ``(block_len, capacity)`` for that length. At most ``max_batch_tokens`` padded tokens per call
    (a single row always fits, whatever its block)."""
    if max_batch_tokens < 1:
        raise EngineError(f"max_batch_tokens must be ≥ 1, got {max_batch_tokens}")
    groups: dict[tuple[int, int], list[int]] = {}
    for row in sorted(range(len(lengths)), key=lambda r: lengths[r]):
        groups.setdefault(shape_of(lengths[row]), []).append(row)
    calls = []
    for (block_len, capacity), rows in groups.items():
        cap = _rows_per_call(block_len, max_batch_tokens)
        while rows:
            # Calls of power-of-two rows, so compiles stay bounded, and no empty rows computed.
            size = min(cap, 1 << (len(rows).bit_length() - 1))
            part, rows = rows[:size], rows[size:]
            blocks = -(-max(lengths[r] for r in part) // chunk_len)
            calls.append(BatchCall(tuple(part), block_len, capacity, blocks))
    return calls


def _rows_per_call(block_len: int, max_batch_tokens: int) -> int:
    """The most rows a call of ``block_len`` holds within the budget: a power of two, ≥ 1."""
    per_call = max(1, max_batch_tokens // block_len)
    return 1 << (per_call.bit_length() - 1)


def call_rows(block_len: int, *, max_prompts: int, max_batch_tokens: int) -> tuple[int, ...]:
    """The row counts above one that `plan_calls` can give a call of ``block_len`` when it plans
    at most ``max_prompts`` prompts: each power of two up to both limits. A call of one row is
    batch-1 prefill's own shape."""
    cap = min(
        _rows_per_call(block_len, max_batch_tokens), 1 << (max(max_prompts, 1).bit_length() - 1)
    )
    return tuple(1 << k for k in range(1, cap.bit_length()))


def share_rows(costs: Sequence[int], shares: int) -> list[list[int]]:
    """Rows ``0 … len(costs) − 1`` dealt into at most ``shares`` non-empty shares, each in
    ascending row order, the costliest row first to the share with the least cost so far: no
    share exceeds another by more than the costliest row."""
    if shares < 1:
        raise EngineError(f"shares must be ≥ 1, got {shares}")
    heap = [(0, share) for share in range(min(shares, len(costs)))]
    out: list[list[int]] = [[] for _ in heap]
    for row in sorted(range(len(costs)), key=lambda r: -costs[r]):
        cost, share = heapq.heappop(heap)
        out[share].append(row)
        heapq.heappush(heap, (cost + costs[row], share))
    return [sorted(rows) for rows in out]


def plan_shares(
    lengths: Sequence[int],
    shape_of: Callable[[int], tuple[int, int]],
    *,
    shares: int,
    chunk_len: int,
    max_batch_tokens: int,
) -> list[list[BatchCall]]:
    """The prompts of ``lengths`` dealt into at most ``shares`` shares by padded tokens
    (`share_rows`), and each share's calls (`plan_calls`), their rows indexing ``lengths``."""
    costs = [shape_of(n)[0] * -(-n // chunk_len) for n in lengths]
    out = []
    for share in share_rows(costs, shares):
        calls = plan_calls(
            [lengths[row] for row in share],
            shape_of,
            chunk_len=chunk_len,
            max_batch_tokens=max_batch_tokens,
        )
        out.append([dataclasses.replace(c, rows=tuple(share[r] for r in c.rows)) for c in calls])
    return out


def batch_threads() -> int:
    """Threads ``prefill_batch`` runs its shares on: the cores this process may run on when the
    default backend is the CPU, else 1."""
    if jax.default_backend() != "cpu":
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def row_states(state: ModelState, cfg: ModelConfig, capacities: Sequence[int]) -> list[ModelState]:
    """Row ``r`` of ``state`` as a batch-1 state of ``capacities[r]`` positions, for each of the
    first ``len(capacities)`` rows: cut in host memory (a slice on the device would compile once
    per shape), then put back once."""
    host = jax.device_get(state)
    rows = []
    for row, capacity in enumerate(capacities):
        one = jax.tree.map(lambda a, r=row: np.ascontiguousarray(a[r : r + 1]), host)
        rows.append(jax.device_put(with_capacity(one, cfg, capacity)))
    return rows


def sampling_args(sampling: Sequence[SamplingParams]) -> tuple[np.ndarray, ...]:
    """``draw_tokens``'s per-row arguments after the logits, one row per ``sampling``."""
    rows = list(sampling)
    keys = np.stack([request_key(s.seed) for s in rows])
    index = np.array([s.first_index for s in rows], np.int32)
    knobs = [np.concatenate(parts) for parts in zip(*map(sampling_knobs, rows), strict=True)]
    return keys, index, *knobs
