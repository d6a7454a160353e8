"""The simulator's prefix-cache model (sim/cache_model.py): matches, LRU eviction, the prompt
bound."""

from prfaas_jax.sim.cache_model import CacheModel


def test_prefix_cache_matches_leading_blocks_and_evicts_the_least_recent():
    cache = CacheModel(capacity_blocks=4, block_len=512)
    cache.insert((1, 2, 3), 1600)  # 3 complete blocks
    assert cache.match((1, 2, 9), 2000) == 1024  # stops at the first missing block
    assert cache.match((1, 2, 3, 4), 1700) == 1536
    cache.insert((7, 8), 1100)  # 2 more blocks: 5 > 4, the least recently used (1) goes
    assert len(cache) == 4 and cache.match((1, 2), 1024) == 0
    assert cache.match((2, 3), 900) == 900  # never more than the prompt


def test_a_disk_tier_keeps_what_host_memory_evicts_and_promotes_it_on_a_hit():
    cache = CacheModel(capacity_blocks=2, block_len=100, disk_blocks=3)
    cache.insert((1, 2, 3, 4), 400)  # host: 3, 4; disk: 1, 2
    assert len(cache) == 2
    # A prefix may run through both tiers; the disk blocks it used come back to host memory.
    assert cache.match((1, 2, 3, 9), 500) == 300 and cache.last_disk_tokens == 200
    assert cache.hit_tokens_by_tier == {"host": 100, "disk": 200}
    # Host memory now holds 1, 2 (the promoted blocks, most recent); 3 and 4 went to disk.
    assert cache.match((1, 2), 300) == 200 and cache.last_disk_tokens == 0
    assert cache.match((3, 4), 300) == 200 and cache.last_disk_tokens == 200
    cache.insert((5, 6, 7, 8), 400)  # disk holds 3 blocks: the least recently used go
    assert cache.match((1,), 200) == 0 and cache.match((5, 6), 300) == 200
    # Without a disk tier the same inserts forget what they evict.
    plain = CacheModel(capacity_blocks=2, block_len=100)
    plain.insert((1, 2, 3, 4), 400)
    assert plain.match((1, 2, 3), 400) == 0 and plain.last_disk_tokens == 0
