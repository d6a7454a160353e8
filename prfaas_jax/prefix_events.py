"""A prefix cache as a cluster-wide index sees it: `block_hashes` (and `checkpoint_key`), the
four events that change a cache, and `EventLog`, the sequence-numbered record of them.

A cache (engine/prefix_cache.py) keeps growing KV in fixed-size token blocks keyed by a hash
chain, ``h_i = blake2b(h_{i−1} ‖ tokens_i)`` with ``h_0 = b""`` (the root), so a block's key names
its whole prefix and two caches that hold the same key hold the same tokens. Fixed-size state is
kept as checkpoints hanging off a block (or the root): the state at exactly ``depth ·
block_size + len(tail)`` tokens, where ``tail`` is the tokens after the block. What a cache
holds is therefore described by

    BlockStored(key, parent)      CheckpointStored(block, tail)
    BlockEvicted(key)             CheckpointEvicted(block, tail)

A checkpoint event names its tier: ``"host"`` (host memory, its KV blocks stored as blocks) or
``"disk"`` (a file of the cache's disk tier holding the whole prefix, its KV included, so it
needs no block events: the block key already names every token before the tail). An index fed
these events in order answers "how long a prefix of this prompt would that
cache reuse" without asking it (policy/cache_index.py). The cache evicts only leaves — a block
with no child and no checkpoint — so the events never leave a checkpoint or a block without the
path to it.

`EventLog` numbers events from 1 and keeps the latest ``keep`` of them: a reader that asks for
the events after one the log no longer holds gets None, and must start again from a snapshot
(the cache's whole content as stored events, with the number of the last event it reflects).

Layer 0: no JAX, no NumPy, so the router can read it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import struct
from collections.abc import Sequence

ROOT = b""  # the key of the root: the empty prefix


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The hash chain of every full block of ``tokens`` (each token as little-endian int32)."""
    hashes, previous = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}i", *tokens[start : start + block_size])
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        hashes.append(previous)
    return hashes


def checkpoint_key(tokens: Sequence[int], block_size: int) -> tuple[bytes, tuple[int, ...]]:
    """The (block, tail) a checkpoint of exactly ``tokens`` hangs off."""
    keys = block_hashes(tokens, block_size)
    return (keys[-1] if keys else ROOT), tuple(tokens[len(keys) * block_size :])


@dataclasses.dataclass(frozen=True)
class BlockStored:
    key: bytes
    parent: bytes  # ROOT for a first block


@dataclasses.dataclass(frozen=True)
class BlockEvicted:
    key: bytes


HOST, DISK = "host", "disk"  # the tiers a checkpoint lives in
TIERS = (HOST, DISK)


@dataclasses.dataclass(frozen=True)
class CheckpointStored:
    block: bytes  # the block it hangs off (ROOT: none)
    tail: tuple[int, ...]  # the tokens after that block; its length is depth · bs + len(tail)
    tier: str = HOST


@dataclasses.dataclass(frozen=True)
class CheckpointEvicted:
    block: bytes
    tail: tuple[int, ...]
    tier: str = HOST


CacheEvent = BlockStored | BlockEvicted | CheckpointStored | CheckpointEvicted


class EventLog:
    """The latest ``keep`` events, numbered from 1 (not thread-safe: the cache's lock guards it)."""

    def __init__(self, keep: int = 65536) -> None:
        if keep < 1:
            raise ValueError(f"keep must be ≥ 1, got {keep}")
        self._events: collections.deque[tuple[int, CacheEvent]] = collections.deque(maxlen=keep)
        self.last_seq = 0

    def append(self, event: CacheEvent) -> int:
        self.last_seq += 1
        self._events.append((self.last_seq, event))
        return self.last_seq

    def since(self, seq: int) -> list[tuple[int, CacheEvent]] | None:
        """The events numbered after ``seq``, oldest first; None when some of them were dropped
        (the reader must resynchronise from a snapshot)."""
        if seq > self.last_seq or seq < 0:
            return None
        first = self._events[0][0] if self._events else self.last_seq + 1
        if seq + 1 < first:
            return None
        return [(n, event) for n, event in self._events if n > seq]
