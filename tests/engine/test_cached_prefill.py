"""Prefill through the prefix cache: only the uncached suffix is computed, and greedy outputs
equal cold ones for every layer kind, at hit lengths that are not multiples of the chunk size.

A three-turn conversation per preset: each turn's prompt is the previous prompt + its greedy
reply + new tokens, so turn 2 hits the 21-token turn 1 and turn 3 the 34-token turn 2 exactly
at the end-of-prompt checkpoints (21 and 34 are not multiples of CHUNK = 16). Each turn is
also prefilled cold, and both are decoded greedily by the same decode engine.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import PRESETS, preset

from prfaas_jax.engine.cached_prefill import IMPORTED, NOT_REUSED, CachedPrefill
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.errors import EngineError
from prfaas_jax.prefix_events import HOST

CHUNK, MAX_LEN, NEW = 16, 64, 6


@functools.cache
def engines(name: str) -> tuple:
    cfg, params = preset(name)
    # One bucket and a fixed capacity: every call, cold or cached, is the same compiled shape.
    prefill = PrefillEngine(cfg, params, chunk_len=CHUNK, buckets=(MAX_LEN,))
    return cfg, prefill, DecodeEngine(cfg, params, max_slots=1, max_len=MAX_LEN)


def greedy(decode: DecodeEngine, result) -> list[int]:
    slot = decode.insert(result.state, result.first_token, max_new_tokens=NEW - 1)
    tokens = [result.first_token]
    while not decode.is_finished(slot):
        tokens.extend(token for _, token in decode.step())
    decode.free(slot)
    return tokens


def new_tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("name", PRESETS)
def test_multi_turn_hits_give_cold_outputs(name):
    cfg, engine, decode = engines(name)
    # Checkpoints every 2 blocks of 4 tokens: stride 8, which divides CHUNK.
    cache = PrefixCache(cfg, capacity_bytes=1 << 30, block_size=4, checkpoint_every=2)
    cached = CachedPrefill(cache)
    prompt = new_tokens(0, 21)
    for turn, (hit, added) in enumerate([(0, 7), (21, 3), (34, 0)]):
        warm = cached.prefill(engine, prompt, max_len=MAX_LEN)
        cold = engine.prefill(prompt, max_len=MAX_LEN)
        assert (warm.prefix_len, warm.num_tokens) == (hit, len(prompt) - hit)
        assert hit % CHUNK != 0 or hit == 0
        np.testing.assert_allclose(warm.logits_last, cold.logits_last, atol=1e-4, rtol=0)
        reply = greedy(decode, warm)
        assert reply == greedy(decode, cold), f"turn {turn} of {name}"
        prompt = prompt + reply + new_tokens(turn + 1, added)
    stats = cached.stats
    assert stats.prompts == 3 and stats.reused_tokens == 21 + 34
    assert stats.computed_tokens == stats.prompt_tokens - stats.reused_tokens


def test_checkpoints_land_on_chunk_ends_and_prompt_end():
    cfg, engine, _ = engines("tiny")
    cache = PrefixCache(cfg, capacity_bytes=1 << 30, block_size=4, checkpoint_every=2)
    prompt = new_tokens(5, 37)
    CachedPrefill(cache).prefill(engine, prompt, max_len=MAX_LEN)
    # Saved at 16 and 32 (chunk ends on the stride) and 37; 8 and 24 fall inside chunks.
    probes = {n: cache.match([*prompt[:n], 1], record=False) for n in (8, 16, 24, 32, 37)}
    hits = {n: hit.length for n, hit in probes.items() if hit is not None}
    assert hits == {16: 16, 24: 16, 32: 32, 37: 37}
    assert cache.stats.lookups == 1  # the prefill's own match; probes are not counted


def test_an_imported_prefix_is_used_and_kept():
    cfg, engine, decode = engines("tiny-gdn")
    prompt = new_tokens(7, 30)
    holder = CachedPrefill(PrefixCache(cfg, capacity_bytes=1 << 30, block_size=4))
    holder.prefill(engine, prompt[:19], max_len=MAX_LEN)
    hit = holder.cache.match(prompt)
    exported = holder.cache.build_state(hit, hit.length)

    receiver = CachedPrefill(PrefixCache(cfg, capacity_bytes=1 << 30, block_size=4))
    sources = []
    result = receiver.prefill(
        engine, prompt, prefix=exported, max_len=MAX_LEN, on_reuse=sources.append
    )
    assert (result.prefix_len, receiver.stats.imported) == (19, 1)
    assert greedy(decode, result) == greedy(decode, engine.prefill(prompt, max_len=MAX_LEN))
    assert receiver.cached_len([*prompt[:19], 3]) == 19  # stored for the next request
    # Where each prefill's prefix came from: the import, then the receiver's own copy of it.
    receiver.prefill(engine, [*prompt[:19], 3], max_len=MAX_LEN, on_reuse=sources.append)
    receiver.prefill(engine, new_tokens(8, 5), max_len=MAX_LEN, on_reuse=sources.append)
    assert sources == [IMPORTED, HOST, NOT_REUSED]
    with pytest.raises(EngineError, match="shorter than"):
        receiver.prefill(engine, prompt[:19], prefix=exported, max_len=MAX_LEN)


def test_without_a_cache_everything_is_computed_and_counted():
    _, engine, _ = engines("tiny")
    plain = CachedPrefill(None)
    for _ in range(2):
        result = plain.prefill(engine, new_tokens(9, 20), max_len=MAX_LEN)
        assert (result.prefix_len, result.num_tokens) == (0, 20)
    assert (plain.stats.prompt_tokens, plain.stats.computed_tokens) == (40, 40)
    assert plain.cached_len([1, 2, 3]) == 0
