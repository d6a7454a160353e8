"""Hybrid prefix cache: reuse changes no output, exact-length linear checkpoints, safe eviction."""

from __future__ import annotations

import random

import jax.numpy as jnp
import pytest
from conftest import PRESETS, preset
from prefix_support import absorb, random_prompt

from prfaas_jax.engine.prefix_cache import PrefixCache, block_hashes
from prfaas_jax.model import init_state

BLOCK, CAPACITY = 8, 96


def _fill(cache, params, cfg, tokens):
    """Prefill ``tokens`` and hand the cache a state at every checkpoint length."""
    state, done = init_state(cfg, 1, CAPACITY), 0
    for length in cache.checkpoint_lengths(len(tokens)):
        _, state = absorb(params, cfg, tokens[done:length], state)
        cache.insert(tokens[:length], state)
        done = length


@pytest.mark.parametrize("name", PRESETS)
def test_cached_prefix_gives_the_same_logits(name):
    cfg, params = preset(name)
    cache = PrefixCache(cfg, capacity_bytes=1 << 30, block_size=BLOCK, checkpoint_every=2)
    first = random_prompt(1, 45, cfg.vocab_size)
    _fill(cache, params, cfg, first)
    follow_up = first[:37] + random_prompt(2, 12, cfg.vocab_size)

    hit = cache.match(follow_up)
    assert hit is not None and hit.length == 32  # the last checkpoint (every 2 blocks) ≤ 37
    reused, _ = absorb(params, cfg, follow_up[32:], cache.build_state(hit, CAPACITY))
    fresh, _ = absorb(params, cfg, follow_up, init_state(cfg, 1, CAPACITY))
    assert float(jnp.max(jnp.abs(reused - fresh[32:]))) <= 1e-4


def test_linear_state_only_reused_at_its_exact_length():
    cfg, params = preset("tiny")
    cache = PrefixCache(cfg, capacity_bytes=1 << 30, block_size=BLOCK, checkpoint_every=100)
    prompt = random_prompt(3, 30, cfg.vocab_size)
    _fill(cache, params, cfg, prompt)  # one checkpoint, at 30; KV blocks up to 24
    assert cache.match([*prompt[:29], 1, 2]) is None  # KV for 24 tokens, but no state there
    assert cache.match(prompt) is None  # a full hit would leave nothing to prefill
    hit = cache.match([*prompt, 5])
    assert hit.length == 30
    state = cache.build_state(hit, CAPACITY)
    assert int(state.lengths[0]) == 30


def test_block_hashes_chain_and_diverge():
    a = block_hashes(list(range(20)), 4)
    b = block_hashes([*range(9), 99, *range(10, 20)], 4)
    assert len(a) == 5 and a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_eviction_keeps_checkpoints_reachable_and_within_budget():
    cfg, params = preset("tiny-gdn")
    # A budget for a few prompts only: inserting many forces evictions.
    cache = PrefixCache(cfg, capacity_bytes=60_000, block_size=BLOCK, checkpoint_every=1)
    rng = random.Random(0)
    base = random_prompt(4, 40, cfg.vocab_size)
    prompts = []
    for i in range(8):
        keep = rng.choice([0, 8, 16, 24])
        prompts.append(base[:keep] + random_prompt(10 + i, rng.choice([9, 20, 33]), cfg.vocab_size))
        _fill(cache, params, cfg, prompts[-1])
        assert cache.stats.used_bytes <= cache.stats.capacity_bytes

        # The accounting matches what is actually stored, and every checkpoint's path exists.
        stored, checkpoints = 0, 0
        stack = [cache._root]
        while stack:
            node = stack.pop()
            stored += sum(a.nbytes for a in node.kv)
            for checkpoint in node.checkpoints.values():
                stored += checkpoint.nbytes
                checkpoints += 1
                assert checkpoint.length >= node.depth * BLOCK
            stack.extend(node.children.values())
        assert stored == cache.stats.used_bytes
        assert checkpoints == cache.stats.checkpoints
    assert cache.stats.evictions > 0

    # Whatever survived still gives exact results.
    for prompt in prompts:
        hit = cache.match([*prompt, 1])
        if hit is None:
            continue
        extension = [*prompt, 1]
        reused, _ = absorb(params, cfg, extension[hit.length :], cache.build_state(hit, CAPACITY))
        fresh, _ = absorb(params, cfg, extension, init_state(cfg, 1, CAPACITY))
        assert float(jnp.max(jnp.abs(reused - fresh[hit.length :]))) <= 1e-4


def test_kv_prefix_returns_the_cached_blocks_rows_without_needing_a_checkpoint():
    """A decode worker's cache: full blocks of KV only; a lookup gives their rows, short of the
    last token, and stops where the prompt leaves the cached blocks."""
    from test_codec import model, random_state

    from prfaas_jax.engine.codec.layout import canonical_arrays

    cfg = model("tiny")
    cache = PrefixCache(cfg, capacity_bytes=1 << 24, block_size=BLOCK)
    tokens = list(range(1, 28))  # 3 full blocks of 8, and 3 tokens more
    state = random_state(cfg, [len(tokens)], 32, seed=3)
    cache.insert(tokens, state, kv_only=True)
    assert cache.stats.checkpoints == 0 and cache.stats.blocks == 3
    _, arrays = canonical_arrays(state, cfg, 0)
    growing = {(s.layer, s.name): a for s, a in arrays if s.kind.has_growing_state}

    hit = cache.kv_prefix([*tokens, 99, 98])
    assert hit.length == 24 and set(hit.rows) == set(growing)
    for key, rows in hit.rows.items():
        assert rows.tobytes() == growing[key][:24].tobytes()
    assert cache.kv_prefix(tokens[:24]).length == 16  # capped short of the last token
    assert cache.kv_prefix([*tokens[:12], 0, *tokens[13:]]).length == 8  # diverges in block 2
    assert cache.kv_prefix([5, *tokens]) == type(hit)(0, {})
    assert cache.match(tokens) is None  # no checkpoint: nothing for a prefill to reuse
