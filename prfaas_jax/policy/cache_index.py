"""What every instance's prefix cache holds, kept from their events: `CacheIndex`.

The router's routing rule needs, per prefill instance, how long a prefix of the prompt that
instance's cache would reuse (engine/prefix_cache.py ``match``: the longest prefix with both its
KV blocks and a fixed-size-state checkpoint at exactly that length, short of the last token).
Asking every instance costs one RPC each per request, and a slow instance delays them all. The
index answers from the caches' events instead (prfaas_jax/prefix_events.py): ``BlockStored`` /
``BlockEvicted`` / ``CheckpointStored`` / ``CheckpointEvicted``, numbered per instance.

It keeps, per block key, the instances holding that block, and per (block, tail) the instances
holding that checkpoint, so a lookup walks the prompt's hash chain once — its cost grows with
the prompt and the checkpoints on its path, not with the number of instances.

A checkpoint in the disk tier (``tier = "disk"``: a file holding the whole prefix, its KV
included) needs no blocks: its block key names every token before its tail. Such checkpoints
are kept apart and count whatever blocks the instance holds; ``cached_tiers`` says which tier
each instance's answer comes from (a disk hit costs a read and is promoted to host memory).

An instance's events must arrive in order: ``apply`` takes the next number only. A gap (an
event lost, the log overrun) marks the instance *stale*; a stale or never-synchronised instance
is left out of the answers until ``reset`` installs a snapshot, so the caller asks that instance
directly (or counts it as holding nothing) in the meantime. An answer can still be out of date by
the events in flight; acting on it costs a recompute, never a wrong output, because the instance
matches its own cache when the prefill runs.

Pure: no I/O, no clock; not thread-safe (the caller holds a lock).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

from prfaas_jax.prefix_events import (
    DISK,
    HOST,
    ROOT,
    BlockEvicted,
    BlockStored,
    CacheEvent,
    CheckpointEvicted,
    CheckpointStored,
    block_hashes,
)


@dataclasses.dataclass
class _Instance:
    seq: int = 0  # the last event applied
    stale: bool = True  # no snapshot yet, or a gap since
    blocks: set[bytes] = dataclasses.field(default_factory=set)
    checkpoints: set[tuple[bytes, tuple[int, ...], str]] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class IndexStats:
    instances: int
    stale: int
    block_keys: int  # distinct blocks held by some instance
    block_entries: int  # (block, instance) pairs
    checkpoint_keys: int
    checkpoint_entries: int


class CacheIndex:
    """Every instance's cached prefixes, for caches of ``block_size``-token blocks."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {block_size}")
        self.block_size = block_size
        self._instances: dict[str, _Instance] = {}
        self._block_holders: dict[bytes, set[str]] = collections.defaultdict(set)
        # per tier: block key → tail → instances holding that checkpoint
        self._tiers: dict[str, dict[bytes, dict[tuple[int, ...], set[str]]]] = {
            tier: collections.defaultdict(dict) for tier in (HOST, DISK)
        }
        self._tails = self._tiers[HOST]

    # --- keeping it -------------------------------------------------------------------------

    def reset(self, instance: str, seq: int, stored: Iterable[CacheEvent]) -> None:
        """Replace what ``instance`` holds with a snapshot: the stored events of its whole
        content, reflecting its events up to ``seq``."""
        self.drop(instance)
        state = self._instances[instance] = _Instance(seq=seq, stale=False)
        for event in stored:
            if not isinstance(event, BlockStored | CheckpointStored):
                raise ValueError(f"a snapshot holds stored events only, got {event}")
            self._apply(instance, state, event)

    def apply(self, instance: str, seq: int, event: CacheEvent) -> bool:
        """Apply ``instance``'s event number ``seq``; False (and the instance stale) when it is
        not the next one, or the instance has no snapshot yet."""
        state = self._instances.setdefault(instance, _Instance())
        if state.stale or seq != state.seq + 1:
            state.stale = True
            return False
        state.seq = seq
        self._apply(instance, state, event)
        return True

    def drop(self, instance: str) -> None:
        """Forget ``instance`` (it left the cluster, or is about to be reset)."""
        state = self._instances.pop(instance, None)
        if state is None:
            return
        for key in state.blocks:
            self._discard(self._block_holders, key, instance)
        for block, tail, tier in state.checkpoints:
            self._discard_checkpoint(self._tiers[tier], block, tail, instance)

    def _apply(self, instance: str, state: _Instance, event: CacheEvent) -> None:
        match event:
            case BlockStored(key=key):
                state.blocks.add(key)
                self._block_holders[key].add(instance)
            case BlockEvicted(key=key):
                state.blocks.discard(key)
                self._discard(self._block_holders, key, instance)
            case CheckpointStored(block=block, tail=tail, tier=tier):
                state.checkpoints.add((block, tail, tier))
                self._tiers[tier][block].setdefault(tail, set()).add(instance)
            case CheckpointEvicted(block=block, tail=tail, tier=tier):
                state.checkpoints.discard((block, tail, tier))
                self._discard_checkpoint(self._tiers[tier], block, tail, instance)
            case _:
                raise TypeError(f"not a cache event: {event!r}")

    def _discard_checkpoint(
        self, tier: dict, block: bytes, tail: tuple[int, ...], instance: str
    ) -> None:
        tails = tier.get(block, {})
        self._discard(tails, tail, instance)
        if not tails:
            tier.pop(block, None)

    @staticmethod
    def _discard(holders: dict, key, instance: str) -> None:
        members = holders.get(key)
        if members is not None:
            members.discard(instance)
            if not members:
                del holders[key]

    # --- reading it -------------------------------------------------------------------------

    def is_current(self, instance: str) -> bool:
        """True when ``instance`` is synchronised (answers include it)."""
        state = self._instances.get(instance)
        return state is not None and not state.stale

    def last_seq(self, instance: str) -> int:
        state = self._instances.get(instance)
        return 0 if state is None else state.seq

    def cached_lengths(self, tokens: Sequence[int]) -> dict[str, int]:
        """For every synchronised instance, the length of the prefix of ``tokens`` its cache
        would reuse (``PrefixCache.match``: KV blocks and a checkpoint at exactly that length,
        or a disk-tier checkpoint, at most ``len(tokens) − 1``); 0 for one that holds none."""
        return {name: length for name, (length, _) in self.cached_tiers(tokens).items()}

    def cached_tiers(self, tokens: Sequence[int]) -> dict[str, tuple[int, str]]:
        """`cached_lengths` with the tier each length comes from (host memory on a tie; a
        length 0 is ``"host"``)."""
        current = {name for name, state in self._instances.items() if not state.stale}
        best = dict.fromkeys(current, (0, HOST))
        limit, bs = len(tokens) - 1, self.block_size
        if limit < 1:
            return best
        holding = set(current)  # instances holding every block of the path so far
        disk = self._tiers[DISK]
        path = [ROOT, *block_hashes(tokens[:limit], bs)]
        for depth, key in enumerate(path):
            if depth:
                holding &= self._block_holders.get(key, set())
            if not holding and not disk:
                break
            for tier, tails, allowed in ((HOST, self._tails, holding), (DISK, disk, current)):
                for tail, holders in tails.get(key, {}).items():
                    end = depth * bs + len(tail)
                    if end > limit or tuple(tokens[depth * bs : end]) != tail:
                        continue
                    for name in holders & allowed:
                        if end > best[name][0]:
                            best[name] = (end, tier)
        return best

    def stats(self) -> IndexStats:
        return IndexStats(
            instances=len(self._instances),
            stale=sum(state.stale for state in self._instances.values()),
            block_keys=len(self._block_holders),
            block_entries=sum(len(h) for h in self._block_holders.values()),
            checkpoint_keys=sum(len(t) for tier in self._tiers.values() for t in tier.values()),
            checkpoint_entries=sum(
                len(h) for tier in self._tiers.values() for t in tier.values() for h in t.values()
            ),
        )
