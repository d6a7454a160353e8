"""The cluster-wide cache index (policy/cache_index.py) against the caches themselves: several
real `PrefixCache`s (fake arrays, small budgets so evictions happen) take random inserts; the
index, fed only their events, must answer every instance's `match(…, record=False)` length for
random prompts. Gaps make an instance stale until a snapshot resets it; a snapshot taken at any
moment, then the events after it, rebuilds the same answers; `block_hashes` is the cache's."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from prfaas_jax import prefix_events as ev
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.codec.layout import canonical_tensors
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.policy.cache_index import CacheIndex
from prfaas_jax.prefix_events import BlockEvicted, BlockStored, EventLog, block_hashes

CFG = load_model_config("tiny")
BLOCK = 4
NAMES = ("a", "b", "c")

tokens_strategy = st.lists(st.integers(0, 2), min_size=1, max_size=20)


def _arrays(length: int) -> list[tuple]:
    """Zero tensors of the canonical shapes of ``length`` tokens: the index never sees values,
    and the cache's byte accounting (hence its evictions) sees the real sizes."""
    return [
        (spec, np.zeros((*spec.shape, spec.itemsize), np.uint8))
        for spec in canonical_tensors(CFG, length)
    ]


def _insert(cache: PrefixCache, tokens: list[int]) -> None:
    """What a prefill leaves in the cache: a state at every checkpoint length."""
    for length in cache.checkpoint_lengths(len(tokens)):
        cache._insert(tokens[:length], length, _arrays(length))


def _caches(budget_blocks: int) -> dict[str, PrefixCache]:
    one_token = sum(s.nbytes for s in canonical_tensors(CFG, 1) if s.token_axis)
    capacity = budget_blocks * BLOCK * one_token
    return {
        name: PrefixCache(CFG, capacity_bytes=capacity, block_size=BLOCK, checkpoint_every=2)
        for name in NAMES
    }


def _feed(index: CacheIndex, name: str, cache: PrefixCache) -> None:
    for seq, event in cache.events_since(index.last_seq(name)):
        assert index.apply(name, seq, event)


def _truth(caches: dict[str, PrefixCache], tokens: list[int]) -> dict[str, int]:
    hits = {name: cache.match(tokens, record=False) for name, cache in caches.items()}
    return {name: 0 if hit is None else hit.length for name, hit in hits.items()}


@settings(max_examples=60)
@given(
    ops=st.lists(st.tuples(st.sampled_from(NAMES), tokens_strategy), min_size=1, max_size=25),
    queries=st.lists(tokens_strategy, min_size=1, max_size=8),
    budget_blocks=st.integers(2, 40),
)
def test_the_index_answers_what_every_cache_would_match(ops, queries, budget_blocks):
    caches = _caches(budget_blocks)
    index = CacheIndex(BLOCK)
    for name, cache in caches.items():
        index.reset(name, *cache.snapshot())
    for name, tokens in ops:
        _insert(caches[name], tokens)
        _feed(index, name, caches[name])
        for query in [tokens, *queries]:
            assert index.cached_lengths(query) == _truth(caches, query)
    # What each instance holds, by the index's count, is what its cache holds; dropping them
    # all leaves nothing behind.
    for name, cache in caches.items():
        index.reset(f"{name}-again", *cache.snapshot())
        held = sum(c.stats.blocks for c in caches.values()) + cache.stats.blocks
        assert index.stats().block_entries == held
        index.drop(f"{name}-again")
    for name in NAMES:
        index.drop(name)
    assert index.stats() == CacheIndex(BLOCK).stats()


def test_evictions_happen_in_the_property_above():
    """The precondition of the property's eviction cases: a small budget evicts."""
    cache = _caches(2)["a"]
    rng = random.Random(0)
    for _ in range(10):
        _insert(cache, [rng.randrange(3) for _ in range(16)])
    assert cache.stats.evictions > 0


def test_a_snapshot_at_any_moment_plus_the_events_after_it_rebuilds_the_index():
    rng = random.Random(1)
    caches = _caches(12)
    live, prompts = CacheIndex(BLOCK), []
    for name, cache in caches.items():
        live.reset(name, *cache.snapshot())
    for step in range(40):
        name = rng.choice(NAMES)
        prompts.append([rng.randrange(3) for _ in range(rng.randrange(1, 20))])
        _insert(caches[name], prompts[-1])
        _feed(live, name, caches[name])
        if step == 20:
            taken = {n: c.snapshot() for n, c in caches.items()}
    late = CacheIndex(BLOCK)
    for name, cache in caches.items():
        late.reset(name, *taken[name])
        _feed(late, name, cache)
    for prompt in prompts:
        assert late.cached_lengths(prompt) == live.cached_lengths(prompt) == _truth(caches, prompt)
    assert late.stats() == live.stats()


def test_a_gap_makes_the_instance_stale_until_a_snapshot():
    caches = _caches(40)
    index = CacheIndex(BLOCK)
    for name, cache in caches.items():
        index.reset(name, *cache.snapshot())
    prompt = [1, 2, 0, 1, 2, 2, 0, 1, 1, 2]
    longer = [*prompt, 0]
    _insert(caches["a"], prompt)
    events = caches["a"].events_since(0)
    assert index.apply("a", *events[0])
    assert not index.apply("a", *events[2])  # event 2 was lost
    assert not index.is_current("a") and "a" not in index.cached_lengths(longer)
    assert not index.apply("a", *events[1])  # stale: even the right number is refused
    index.reset("a", *caches["a"].snapshot())
    assert index.cached_lengths(longer) == _truth(caches, longer)
    assert index.cached_lengths(longer)["a"] == len(prompt)
    # An instance never reset is not answered for either.
    assert not index.apply("new", 1, events[0]) and "new" not in index.cached_lengths(prompt)


def test_dropping_an_instance_forgets_everything_it_held():
    caches = _caches(40)
    index = CacheIndex(BLOCK)
    empty = index.stats()
    _insert(caches["a"], [0, 1, 2, 0, 1, 2, 0, 1, 2])
    index.reset("a", *caches["a"].snapshot())
    assert index.stats().block_entries == caches["a"].stats.blocks > 0
    index.drop("a")
    assert index.stats() == empty


def test_the_event_log_reports_a_gap_when_it_overran():
    log = EventLog(keep=3)
    for i in range(5):
        log.append(BlockStored(bytes([i]), b""))
    assert [n for n, _ in log.since(2)] == [3, 4, 5]
    assert log.since(1) is None  # event 2 was dropped
    assert log.since(5) == [] and log.since(6) is None


def test_a_snapshot_holds_only_stored_events():
    index = CacheIndex(BLOCK)
    with pytest.raises(ValueError, match="stored events only"):
        index.reset("a", 0, [BlockStored(b"k", b""), BlockEvicted(b"k")])


def test_the_hash_chain_is_the_caches():
    """The cache keys its blocks by `block_hashes`: the same keys its events carry."""
    cache = _caches(40)["a"]
    tokens = [2, 1, 0, 2, 1, 1, 0, 0, 2]
    _insert(cache, tokens)
    stored = [e.key for _, e in cache.events_since(0) if isinstance(e, BlockStored)]
    assert stored == block_hashes(tokens, BLOCK)


def test_a_disk_checkpoint_counts_without_its_blocks_and_names_its_tier():
    tokens = list(range(11))  # blocks of 4: two full blocks, a tail of 3
    keys = block_hashes(tokens, BLOCK)
    index = CacheIndex(BLOCK)
    index.reset("a", 0, [BlockStored(keys[0], b""), ev.CheckpointStored(keys[0], ())])
    index.reset("b", 0, [ev.CheckpointStored(keys[1], (8, 9, 10), ev.DISK)])  # no block at all
    prompt = [*tokens, 99]
    assert index.cached_tiers(prompt) == {"a": (4, ev.HOST), "b": (11, ev.DISK)}
    assert index.cached_lengths(prompt) == {"a": 4, "b": 11}
    # The same length in both tiers: host memory (no read to pay).
    index.apply("a", 1, BlockStored(keys[1], keys[0]))
    index.apply("a", 2, ev.CheckpointStored(keys[1], (8, 9, 10), ev.DISK))
    index.apply("a", 3, ev.CheckpointStored(keys[1], (8, 9, 10)))
    assert index.cached_tiers(prompt)["a"] == (11, ev.HOST)
    index.apply("b", 1, ev.CheckpointEvicted(keys[1], (8, 9, 10), ev.DISK))
    assert index.cached_tiers(prompt)["b"] == (0, ev.HOST)
    assert index.stats().checkpoint_entries == 3
