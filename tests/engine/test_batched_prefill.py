"""``PrefillEngine.prefill_batch`` against ``prefill`` on each prompt alone: the same first token
and the same state, field by field, for every tiny preset, with ragged lengths in one call
(finished rows riding along as empty blocks) and a prompt past ``chunk_len``, with the prompts
split between threads, and with rows padded to less than their bucket; ``share_rows`` against the
best split found by trying them all, ``row_size`` against the smallest size its rule allows.

A call of one row is bit for bit the batch-1 call. Several rows change the matrix products' batch
dimension, which moves XLA's fp32 rounding (by about 1e-5 on these presets), so there states
and logits agree to ``ATOL`` — the tolerance the suite gives a prefix continued against one
prefill — and first tokens exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import numpy as np
import pytest
from conftest import PRESETS, preset

from prfaas_jax.engine.batched_prefill import call_rows, plan_calls, row_size, share_rows
from prfaas_jax.engine.prefill import PrefillEngine, default_buckets, pick_bucket
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.errors import EngineError

CHUNK = 16
# Buckets 16 and 64: {1, 8, 15, 16} share one shape, {17, 33, 50, 64} the other (64: four chunks,
# while 17 is done after two).
LENGTHS = (50, 1, 17, 16, 33, 15, 64, 8)
ATOL = 1e-4


def prompt(length: int) -> list[int]:
    return np.random.default_rng(1000 + length).integers(0, 256, length).tolist()


@functools.cache
def engine(name: str) -> PrefillEngine:
    cfg, params = preset(name)
    return PrefillEngine(cfg, params, chunk_len=CHUNK, buckets=(16, 64))


def assert_same_state(got, want, atol: float = 0.0) -> None:
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    assert len(got.layers) == len(want.layers)
    for index, (a, b) in enumerate(zip(got.layers, want.layers, strict=True)):
        assert type(a) is type(b)
        for field in dataclasses.fields(b):
            x, y = np.asarray(getattr(a, field.name)), np.asarray(getattr(b, field.name))
            assert x.shape == y.shape and x.dtype == y.dtype, (index, field.name)
            np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=f"{index} {field.name}")


@pytest.mark.parametrize("name", PRESETS)
def test_each_row_equals_its_prompt_prefilled_alone(name):
    eng = engine(name)
    prompts = [prompt(n) for n in LENGTHS]
    alone = [eng.prefill(tokens) for tokens in prompts]
    # 64 padded tokens per call: each shape's four rows share one call; 16: one row per call,
    # the batch-1 program itself.
    for budget, atol in ((64, ATOL), (CHUNK, 0.0)):
        batched = eng.prefill_batch(prompts, max_batch_tokens=budget, threads=1)
        assert len(batched) == len(prompts)
        for tokens, want, got in zip(prompts, alone, batched, strict=True):
            assert got.first_token == want.first_token
            assert got.num_tokens == len(tokens) and got.plan == want.plan
            np.testing.assert_allclose(got.logits_last, want.logits_last, rtol=0, atol=atol)
            assert_same_state(got.state, want.state, atol)


def test_fixed_capacity_and_sampling_per_row():
    eng = engine("tiny")
    prompts = [prompt(n) for n in (3, 40)]
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=8)]
    batched = eng.prefill_batch(
        prompts, max_len=64, sampling=params, max_batch_tokens=64, threads=1
    )
    for tokens, sampling, got in zip(prompts, params, batched, strict=True):
        alone = eng.prefill(tokens, max_len=64, sampling=sampling)
        assert got.first_token == alone.first_token
        assert got.state.capacity == 64
        assert_same_state(got.state, alone.state, ATOL)


def test_shares_in_threads_equal_each_prompt_alone():
    eng = engine("tiny")
    prompts = [prompt(n) for n in LENGTHS]
    # Two shares of four rows, each running its calls (two rows per shape) in a thread.
    batched = eng.prefill_batch(prompts, max_batch_tokens=64, threads=2)
    for tokens, got in zip(prompts, batched, strict=True):
        want = eng.prefill(tokens)
        assert got.first_token == want.first_token and got.plan == want.plan
        np.testing.assert_allclose(got.logits_last, want.logits_last, rtol=0, atol=ATOL)
        assert_same_state(got.state, want.state, ATOL)


def test_rows_padded_to_less_than_their_bucket_equal_each_prompt_alone():
    cfg, params = preset("tiny")
    eng = PrefillEngine(cfg, params, chunk_len=64, buckets=(16, 512))
    prompts = [prompt(n) for n in (70, 100)]
    # Both rows in one call of 128 positions (two blocks of 64), where alone each runs in 512.
    batched = eng.prefill_batch(prompts, threads=1)
    for tokens, got in zip(prompts, batched, strict=True):
        want = eng.prefill(tokens)
        assert (got.plan.capacity, want.plan.capacity) == (128, 512)
        assert got.plan.chunks == want.plan.chunks and got.plan.block_len == want.plan.block_len
        assert got.first_token == want.first_token
        np.testing.assert_allclose(got.logits_last, want.logits_last, rtol=0, atol=ATOL)
        assert_same_state(got.state, want.state, ATOL)


def test_row_size_is_the_smallest_allowed_size():
    buckets = default_buckets(4096)
    sizes = {}
    for length in range(1, 4097):
        bucket = pick_bucket(buckets, length)
        step = max(64, bucket // 8)
        smallest = next(n for n in range(length, bucket + 1) if n % step == 0 or n == bucket)
        assert row_size(length, bucket) == smallest, length
        sizes.setdefault(bucket, set()).add(smallest)
    assert max(map(len, sizes.values())) == 4  # compiles per bucket and row count


def test_share_rows_is_within_a_third_of_the_best_split():
    rng = np.random.default_rng(0)
    for rows, shares in [(7, 2), (8, 3), (5, 4), (3, 5), (0, 2)]:
        costs = rng.integers(1, 100, rows).tolist()
        split = share_rows(costs, shares)
        assert sorted(r for share in split for r in share) == list(range(rows))
        assert len(split) == min(rows, shares) and all(s == sorted(s) for s in split)
        if not rows:
            continue
        loads = [sum(costs[r] for r in share) for share in split]
        assert max(loads) - min(loads) <= max(costs)
        # The best split, by trying every assignment of rows to shares.
        best = min(
            max(np.bincount(owner, weights=costs, minlength=shares))
            for owner in itertools.product(range(shares), repeat=rows)
        )
        assert max(loads) <= best * 4 / 3  # the bound of dealing the costliest first


def test_plan_calls_keeps_the_budget_and_one_shape_per_call():
    lengths = [70, 5, 300, 9, 20, 130, 12, 18]
    shape_of = lambda n: (min(16 if n <= 16 else 64 if n <= 64 else 512, 64), 0)  # noqa: E731
    calls = plan_calls(lengths, shape_of, chunk_len=64, max_batch_tokens=200)
    assert sorted(r for c in calls for r in c.rows) == list(range(len(lengths)))
    for call in calls:
        size = len(call.rows)
        assert size * call.block_len <= 200 and size & (size - 1) == 0
        assert {shape_of(lengths[r]) for r in call.rows} == {(call.block_len, 0)}
        assert call.blocks == -(-max(lengths[r] for r in call.rows) // 64)
        spans = call.windows(lengths, 64)
        for slot, row in enumerate(call.rows):  # the row's spans tile [0, length)
            assert sum(int(s[slot, 1] - s[slot, 0]) for s in spans) == lengths[row]
    # The 16-token shape: 12 rows fit the budget, so its three rows (5, 9, 12) run as 2 + 1;
    # the 64-token one fits 3, so its five rows (18, 20, 70, 130, 300) run as 2 + 2 + 1.
    assert [c.rows for c in calls if c.block_len == 16] == [(1, 3), (6,)]
    assert [c.rows for c in calls if c.block_len == 64] == [(7, 4), (0, 5), (2,)]


def test_call_rows_are_the_row_counts_plan_calls_gives():
    """Every batch of at most ``max_prompts`` prompts, planned: each call's row count above one
    is among ``call_rows`` of its block, and each of those is the count of some batch's call."""
    rng = np.random.default_rng(0)
    shape_of = lambda n: (16 if n <= 16 else 64, 0)  # noqa: E731
    for max_prompts, budget in ((1, 4096), (3, 4096), (8, 4096), (8, 64), (5, 100), (16, 16)):
        seen: dict[int, set[int]] = {16: set(), 64: set()}
        for _ in range(200):
            low, high = ((1, 16), (17, 64), (1, 64))[rng.integers(3)]  # one shape, or both
            lengths = rng.integers(low, high + 1, rng.integers(1, max_prompts + 1)).tolist()
            for call in plan_calls(lengths, shape_of, chunk_len=64, max_batch_tokens=budget):
                if len(call.rows) > 1:
                    seen[call.block_len].add(len(call.rows))
        for block, counts in seen.items():
            rows = call_rows(block, max_prompts=max_prompts, max_batch_tokens=budget)
            assert counts == set(rows), (max_prompts, budget, block)
    assert call_rows(16, max_prompts=8, max_batch_tokens=4096) == (2, 4, 8)
    assert call_rows(64, max_prompts=8, max_batch_tokens=200) == (2,)  # 3 rows fit: calls of 2
    assert call_rows(16, max_prompts=1, max_batch_tokens=4096) == ()


def test_prefill_batch_errors():
    eng = engine("tiny")
    with pytest.raises(EngineError, match="empty"):
        eng.prefill_batch([[1, 2], []])
    with pytest.raises(EngineError, match="vocabulary"):
        eng.prefill_batch([[1, 10**6]])
    with pytest.raises(EngineError, match="sampling"):
        eng.prefill_batch([[1]], sampling=[])
    with pytest.raises(EngineError, match="max_batch_tokens"):
        eng.prefill_batch([[1]], max_batch_tokens=0)
    with pytest.raises(EngineError, match="shares"):
        eng.prefill_batch([[1]], threads=0)
    assert jax.devices()  # the engine stays usable after refusals
    assert eng.prefill_batch([[1, 2]])[0].first_token == eng.prefill([1, 2]).first_token
