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
