"""The simulator's prefix-cache model: `CacheModel`.

One cluster's prefix-cache pool (the simulated counterpart of engine/prefix_cache.py): an LRU
set of block hashes (Mooncake `hash_ids`) holding at most `capacity_blocks`; a prompt's cached
prefix is its longest run of leading blocks in the set. It counts the tokens looked up and the
tokens found, for the run's hit rate.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


class CacheModel:
    """LRU pool of block hashes with room for `capacity_blocks` (module docstring)."""

    def __init__(self, capacity_blocks: int, block_len: int) -> None:
        if capacity_blocks < 0 or block_len < 1:
            raise ValueError("need capacity_blocks ≥ 0 and block_len ≥ 1")
        self.capacity_blocks, self.block_len = capacity_blocks, block_len
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hit_tokens = 0
        self.lookup_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hash_ids: Sequence[int], prompt_len: int) -> int:
        """Tokens of the prompt's longest cached prefix (whole blocks, at most the prompt)."""
        blocks, count = self._blocks, 0
        for block in hash_ids:
            if block not in blocks:
                break
            blocks.move_to_end(block)
            count += 1
        cached = min(count * self.block_len, prompt_len)
        self.lookup_tokens += prompt_len
        self.hit_tokens += cached
        return cached

    def insert(self, hash_ids: Sequence[int], num_tokens: int) -> None:
        """Adds the complete blocks of the first `num_tokens` tokens (partial blocks are not
        reusable: prefix-cache blocks must be fully populated)."""
        if self.capacity_blocks == 0:
            return
        blocks = self._blocks
        for block in hash_ids[: num_tokens // self.block_len]:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
