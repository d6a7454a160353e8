"""The prefix cache's disk tier (engine/prefix_disk.py) on the tiny hybrid model: a checkpoint
host memory evicts spills to a file, a hit there is promoted and gives the logits a cold prefill
gives, a restarted worker reloads the directory (and the index learns it from the snapshot), a
corrupt file is never used, and the directory stays under its bound in LRU order."""

from __future__ import annotations

import jax.numpy as jnp
from conftest import preset
from prefix_support import absorb, random_prompt

from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.engine.prefix_disk import DiskTier, entry_name
from prfaas_jax.model import init_state
from prfaas_jax.policy.cache_index import CacheIndex
from prfaas_jax.prefix_events import DISK, HOST, CheckpointEvicted, CheckpointStored

BLOCK, CAPACITY, LONG = 8, 96, 1 << 30


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
    reused, _ = absorb(params, cfg, follow_up[40:], cache.build_state(hit, CAPACITY))
    assert float(jnp.max(jnp.abs(reused - fresh[40:]))) <= 1e-4

    # A restarted worker: a new pool over the same directory, host memory empty.
    restarted = pool(cfg, tmp_path, host_bytes=one.stats.used_bytes + 64)
    assert restarted.disk.stats.entries >= 1 and restarted.disk.stats.dropped == 0
    index.reset("w", *restarted.snapshot())
    assert index.cached_tiers(follow_up) == {"w": (40, DISK)}
    hit = restarted.match(follow_up)
    assert hit is not None and hit.length == 40
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
        CheckpointEvicted(*cache._entry_key(a), DISK)
    ]
    # b's file is whole: it hits, though host memory keeps nothing.
    hit = cache.match([*b, 1])
    assert hit is not None and hit.length == 24 and cache.stats.disk_hits == 1
    # Damaged while the worker was down: dropped by the restart's scan.
    flip_byte(tmp_path / entry_name(b), 200)
    restarted = pool(cfg, tmp_path, host_bytes=0)
    assert restarted.disk.stats.dropped == 1 and restarted.disk.stats.entries == 0
    assert not list(tmp_path.iterdir()) and restarted.snapshot()[1] == []


def test_the_directory_stays_under_its_bound_in_lru_order(tmp_path):
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
