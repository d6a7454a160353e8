"""Hybrid prefix cache: reuse changes no output, exact-length linear checkpoints, safe eviction;
and its disk tier (engine/prefix_disk.py): a checkpoint host memory evicts spills to a file, a
hit there is promoted and gives the logits a cold prefill gives, a restarted worker reloads the
directory (and the index learns it from the snapshot), a corrupt file is never used, and the
directory stays under its bound in LRU order. (One file: the disk tier's tests reuse the
programs the others compile.)"""

from __future__ import annotations

import errno
import random
from pathlib import Path

import jax.numpy as jnp
import pytest
from conftest import PRESETS, preset
from prefix_support import absorb, random_prompt

from prfaas_jax.engine import codec
from prfaas_jax.engine.prefix_cache import PrefixCache, block_hashes
from prfaas_jax.engine.prefix_disk import DiskTier, entry_name
from prfaas_jax.model import init_state
from prfaas_jax.policy.cache_index import CacheIndex
from prfaas_jax.prefix_events import (
    DISK,
    HOST,
    CheckpointEvicted,
    CheckpointStored,
    checkpoint_key,
)

BLOCK, CAPACITY, LONG = 8, 96, 1 << 30


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


# --- the disk tier ----------------------------------------------------------------------------


def pool(cfg, directory, *, host_bytes, disk_bytes=LONG):
    disk = DiskTier(directory, disk_bytes, cfg)
    # Checkpoints at each prompt's end only: one per prompt, the unit that spills.
    return PrefixCache(
        cfg, capacity_bytes=host_bytes, block_size=BLOCK, checkpoint_every=100, disk=disk
    )


def keep(cache, params, cfg, tokens):
    _, state = absorb(params, cfg, tokens, init_state(cfg, 1, CAPACITY))
    cache.insert(tokens, state)


def test_a_spilled_prefix_hits_from_disk_before_and_after_a_restart(tmp_path):
    cfg, params = preset("tiny")
    a, b = random_prompt(1, 40, cfg.vocab_size), random_prompt(2, 40, cfg.vocab_size)
    one = PrefixCache(cfg, capacity_bytes=LONG, block_size=BLOCK)
    keep(one, params, cfg, a)
    # Room for one prompt: keeping b evicts a's checkpoint, which spills.
    cache = pool(cfg, tmp_path, host_bytes=one.stats.used_bytes + 64)
    keep(cache, params, cfg, a)
    keep(cache, params, cfg, b)
    follow_up = a + random_prompt(3, 9, cfg.vocab_size)
    stored = [e for _, e in cache.events_since(0) if isinstance(e, CheckpointStored)]
    assert [e.tier for e in stored] == [HOST, HOST, DISK] and cache.stats.spills == 1
    assert cache.disk.holds(a) and (tmp_path / entry_name(a)).exists()

    # The index fed the events sees a's prefix on disk, as the cache's probe does.
    index = CacheIndex(BLOCK)
    index.reset("w", *cache.snapshot())
    assert index.cached_tiers(follow_up) == {"w": (40, DISK)}
    assert cache.probe(follow_up) == 40 and cache.stats.disk_hits == 0

    fresh, _ = absorb(params, cfg, follow_up, init_state(cfg, 1, CAPACITY))
    hit = cache.match(follow_up)  # promoted: read, checked, in host memory again
    assert hit is not None and hit.length == 40 and cache.stats.disk_hits == 1
    assert hit.tier == DISK
    reused, _ = absorb(params, cfg, follow_up[40:], cache.build_state(hit, CAPACITY))
    assert float(jnp.max(jnp.abs(reused - fresh[40:]))) <= 1e-4

    # A restarted worker: a new pool over the same directory, host memory empty.
    restarted = pool(cfg, tmp_path, host_bytes=one.stats.used_bytes + 64)
    assert restarted.disk.stats.entries >= 1 and restarted.disk.stats.dropped == 0
    index.reset("w", *restarted.snapshot())
    assert index.cached_tiers(follow_up) == {"w": (40, DISK)}
    # Read back ahead of the prefill (as a request waiting for its engine does): the match then
    # hits host memory, with no second read, and counts the hit as the disk tier's.
    assert restarted.prefetch(follow_up) == 40 and restarted.disk.stats.loads == 1
    hit = restarted.match(follow_up)
    assert hit is not None and (hit.length, hit.tier) == (40, DISK)
    assert restarted.disk.stats.loads == 1 and restarted.stats.disk_hits == 1
    again = restarted.match(follow_up)  # in host memory since: host memory's hit
    assert (again.length, again.tier) == (40, HOST) and restarted.stats.disk_hits == 1
    reused, _ = absorb(params, cfg, follow_up[40:], restarted.build_state(hit, CAPACITY))
    assert float(jnp.max(jnp.abs(reused - fresh[40:]))) <= 1e-4


def flip_byte(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_corrupt_file_is_dropped_and_the_prefix_recomputed(tmp_path):
    cfg, params = preset("tiny")
    a, b = random_prompt(4, 24, cfg.vocab_size), random_prompt(5, 24, cfg.vocab_size)
    cache = pool(cfg, tmp_path, host_bytes=0)  # nothing stays in host memory: all spills
    keep(cache, params, cfg, a)
    keep(cache, params, cfg, b)
    assert cache.disk.holds(a) and cache.disk.holds(b)
    # Damaged after the scan (a byte inside the state's last data frame): caught on load.
    flip_byte(tmp_path / entry_name(a), 200)
    seq = cache.events.last_seq
    assert cache.match([*a, 1]) is None  # recomputed, never used
    assert not (tmp_path / entry_name(a)).exists() and cache.disk.stats.dropped == 1
    assert [e for _, e in cache.events_since(seq)] == [
        CheckpointEvicted(*checkpoint_key(a, BLOCK), DISK)
    ]
    # b's file is whole: it hits, though host memory keeps nothing.
    hit = cache.match([*b, 1])
    assert hit is not None and hit.length == 24 and cache.stats.disk_hits == 1
    # Damaged while the worker was down: dropped by the restart's scan.
    flip_byte(tmp_path / entry_name(b), 200)
    restarted = pool(cfg, tmp_path, host_bytes=0)
    assert restarted.disk.stats.dropped == 1 and restarted.disk.stats.entries == 0
    assert not list(tmp_path.iterdir()) and restarted.snapshot()[1] == []


def test_the_directory_stays_under_its_bound_in_lru_order(tmp_path, monkeypatch):
    cfg, params = preset("tiny")
    prompts = [random_prompt(10 + i, 24, cfg.vocab_size) for i in range(4)]
    cache = pool(cfg, tmp_path, host_bytes=0, disk_bytes=LONG)
    keep(cache, params, cfg, prompts[0])
    size = cache.disk.stats.used_bytes  # one 24-token prefix's file
    cache = pool(cfg, tmp_path / "bounded", host_bytes=0, disk_bytes=2 * size)
    keep(cache, params, cfg, prompts[0])
    keep(cache, params, cfg, prompts[1])
    cache.match([*prompts[0], 1])  # prompts[0] used last (promoted, then spilled again)
    keep(cache, params, cfg, prompts[2])
    held = [p for p in prompts if cache.disk.holds(p)]
    assert held == [prompts[0], prompts[2]]
    assert cache.disk.stats.used_bytes <= 2 * size and cache.disk.stats.evictions == 1
    assert sorted(p.name for p in (tmp_path / "bounded").iterdir()) == sorted(
        entry_name(p) for p in held
    )

    # A full disk: the spill is dropped, the insert (the prefill that caused it) still succeeds.
    def full(path, frames):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(codec, "write_file", full)
    seq = cache.events.last_seq
    keep(cache, params, cfg, prompts[3])
    assert cache.disk.stats.write_failures == 1 and not cache.disk.holds(prompts[3])
    assert sorted(p.name for p in (tmp_path / "bounded").iterdir()) == sorted(
        entry_name(p) for p in held
    )
    assert not any(e.tier == DISK for _, e in cache.events_since(seq) if hasattr(e, "tier"))
