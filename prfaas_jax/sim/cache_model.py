"""The simulator's prefix-cache model: `CacheModel`.

One cluster's prefix-cache pool (the simulated counterpart of engine/prefix_cache.py): an LRU
set of block hashes (Mooncake `hash_ids`) holding at most `capacity_blocks` in host memory; a
prompt's cached prefix is its longest run of leading blocks in the set. It counts the tokens
looked up and the tokens found, for the run's hit rate.

With `disk_blocks`, a second tier below it (engine/prefix_disk.py): a block host memory evicts
moves to a disk LRU of at most `disk_blocks`, a prefix may run through blocks of either tier,
and a disk block it uses is promoted back to host memory. `match` also leaves the tokens of the
prefix found on disk in `last_disk_tokens` (the read the simulator charges at the disk's
bandwidth), and `hit_tokens_by_tier` counts each tier's share.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


class CacheModel:
    """LRU pool of block hashes with room for `capacity_blocks` (module docstring)."""

    def __init__(self, capacity_blocks: int, block_len: int, disk_blocks: int = 0) -> None:
        if min(capacity_blocks, disk_blocks) < 0 or block_len < 1:
            raise ValueError("need capacity_blocks ≥ 0, disk_blocks ≥ 0 and block_len ≥ 1")
        self.capacity_blocks, self.block_len = capacity_blocks, block_len
        self.disk_blocks = disk_blocks
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._disk: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.hit_tokens_by_tier = {"host": 0, "disk": 0}
        self.last_disk_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hash_ids: Sequence[int], prompt_len: int) -> int:
        """Tokens of the prompt's longest cached prefix (whole blocks, at most the prompt)."""
        blocks, disk, count, from_disk = self._blocks, self._disk, 0, []
        for block in hash_ids:
            if block in blocks:
                blocks.move_to_end(block)
            elif block in disk:
                from_disk.append(block)
            else:
                break
            count += 1
        for block in from_disk:  # promoted: read back into host memory
            del disk[block]
            blocks[block] = None
        self._fit()
        cached = min(count * self.block_len, prompt_len)
        self.last_disk_tokens = min(len(from_disk) * self.block_len, cached)
        self.lookup_tokens += prompt_len
        self.hit_tokens += cached
        self.hit_tokens_by_tier["disk"] += self.last_disk_tokens
        self.hit_tokens_by_tier["host"] += cached - self.last_disk_tokens
        return cached

    def insert(self, hash_ids: Sequence[int], num_tokens: int) -> None:
        """Adds the complete blocks of the first `num_tokens` tokens (partial blocks are not
        reusable: prefix-cache blocks must be fully populated)."""
        if self.capacity_blocks == 0 and self.disk_blocks == 0:
            return
        blocks = self._blocks
        for block in hash_ids[: num_tokens // self.block_len]:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                self._disk.pop(block, None)
                blocks[block] = None
        self._fit()

    def _fit(self) -> None:
        """Spill host memory's least recently used blocks to disk, and drop disk's."""
        while len(self._blocks) > self.capacity_blocks:
            block, _ = self._blocks.popitem(last=False)
            if self.disk_blocks:
                self._disk[block] = None
        while len(self._disk) > self.disk_blocks:
            self._disk.popitem(last=False)
