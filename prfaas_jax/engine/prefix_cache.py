"""Hybrid prefix cache pool: full-attention KV blocks and linear-state checkpoints in one budget.

A hybrid model's state has two kinds of parts (paper §3.2):

* **growing KV** (MLA, GQA): position ``p``'s entry depends only on tokens ``≤ p``, so it can be
  reused block by block — any prefix of cached blocks is valid (partial prefix match);
* **fixed-size state** (KDA / GDN / Lightning recurrences, short-conv tails, SWA windows): it
  summarises the whole prefix, so it is reusable only at exactly the length it was saved at.

``PrefixCache`` keeps the first as a tree of fixed-size token blocks keyed by a hash chain
(``block_hashes``: ``h_i = blake2b(h_{i−1} ‖ tokens_i)``, the identity a global cache manager can
compare across clusters), and the second as *checkpoints* hanging off a block: the fixed-size
state at length ``L`` plus the KV of the ``L mod block_size`` tokens after the block. The engine
saves checkpoints at block boundaries every ``checkpoint_every`` blocks while it prefills
(``checkpoint_lengths``) and at the end of each prompt, so a multi-turn follow-up hits exactly.

``match(tokens)`` returns the longest prefix that has **both** its KV blocks and a checkpoint at
that exact length, capped at ``len(tokens) − 1`` so prefill always computes at least the last
token (whose logits give the first output token). Blocks and checkpoints share one byte budget
with LRU eviction that only ever removes checkpoints and *leaf* blocks (no child block, no
checkpoint): a checkpoint can therefore never outlive the KV prefix it needs.

Every change is also recorded as an event (prfaas_jax/prefix_events.py) in ``events``, a
sequence-numbered log read through ``events_since`` (or ``wait_events``, which blocks until the
next one), and ``snapshot`` gives the whole content as events (all under the lock): what a
cluster-wide index (policy/cache_index.py) needs to answer ``match``'s length without asking
this cache.

Tiers. With a ``disk`` (engine/prefix_disk.py), a checkpoint the budget evicts spills there
with the KV of its whole prefix, as one verified file, before it leaves host memory; ``match``
finds the longest prefix in either tier and promotes a disk entry longer than the host hit (read,
checked, stored again in host memory) before returning it, so the rest of the cache code sees
host memory only. Disk entries are events too (``tier = "disk"``), in ``snapshot`` as well, so a
restarted worker's reloaded directory reaches the index with its first snapshot. ``prefetch``
promotes ahead of the match (a prefill reads its prefix back while it waits for the engine);
``probe`` answers the length a prefill would reuse without promoting anything.

The pool is shared by a worker's threads (prefill inserts while the router's lookups and other
instances' exports read), so every public method holds one lock; a ``PrefixHit`` keeps its
arrays alive, so ``build_state`` stays valid even if the hit is evicted after ``match``. The
module is over 450 lines because the tree, its LRU budget, the disk tier's spills and promotions
and the event log change together under that one lock: split, each part would need the others'.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence

import numpy as np

from prfaas_jax.config import LayerKind, ModelConfig
from prfaas_jax.engine.codec.layout import (
    KvPrefix,
    TensorSpec,
    canonical_arrays,
    canonical_tensors,
    state_from_arrays,
)
from prfaas_jax.engine.prefix_disk import DiskEntry, DiskTier
from prfaas_jax.model.state import ModelState
from prfaas_jax.prefix_events import (
    DISK,
    HOST,
    ROOT,
    BlockEvicted,
    BlockStored,
    CacheEvent,
    CheckpointEvicted,
    CheckpointStored,
    EventLog,
    block_hashes,
    checkpoint_key,
)


def _is_growing(spec: TensorSpec) -> bool:
    return spec.token_axis and spec.kind is not LayerKind.SWA


@dataclasses.dataclass(eq=False)
class _Checkpoint:
    length: int
    tail_kv: list[np.ndarray]  # growing tensors for the positions after the owning block
    fixed: list[np.ndarray]  # recurrent states, conv tails, SWA windows at exactly `length`
    nbytes: int
    last_used: int
    from_disk: bool = False  # promoted from the disk tier and not yet hit since


@dataclasses.dataclass(eq=False)
class _Block:
    key: bytes  # its hash chain value (ROOT for the root)
    depth: int  # full blocks from the root up to and including this one
    tokens: tuple[int, ...]
    kv: list[np.ndarray]  # growing tensors for this block's positions
    parent: _Block | None
    nbytes: int
    last_used: int
    children: dict[bytes, _Block] = dataclasses.field(default_factory=dict)
    checkpoints: dict[tuple[int, ...], _Checkpoint] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """A reusable prefix: ``length`` tokens, the blocks leading to it and its checkpoint;
    ``tier``, where ``match`` found it: host memory, or the disk tier (read back for it)."""

    length: int
    blocks: tuple[_Block, ...]
    checkpoint: _Checkpoint
    tier: str = HOST


@dataclasses.dataclass
class CacheStats:
    capacity_bytes: int
    used_bytes: int = 0
    blocks: int = 0
    checkpoints: int = 0
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    spills: int = 0  # evicted checkpoints written to the disk tier
    disk_hits: int = 0  # hits promoted from the disk tier


class PrefixCache:
    """One cluster's (or instance's) hybrid prefix cache, held in host memory."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        capacity_bytes: int,
        block_size: int = 64,
        checkpoint_every: int = 4,
        disk: DiskTier | None = None,
    ):
        """``disk``: the tier evicted checkpoints spill to (module docstring); None: none."""
        if block_size < 1 or checkpoint_every < 1 or capacity_bytes < 0:
            raise ValueError("block_size and checkpoint_every must be ≥ 1, capacity_bytes ≥ 0")
        self.cfg = cfg
        self.block_size = block_size
        self.checkpoint_every = checkpoint_every
        self.stats = CacheStats(capacity_bytes=capacity_bytes)
        self._clock = itertools.count(1)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # notified when events are appended
        self._root = _Block(ROOT, depth=0, tokens=(), kv=[], parent=None, nbytes=0, last_used=0)
        self.events = EventLog()
        self.disk = disk

    # --- what to save -----------------------------------------------------------------------

    def checkpoint_lengths(self, prompt_len: int) -> list[int]:
        """Lengths at which prefill of a ``prompt_len`` prompt should hand states to ``insert``."""
        stride = self.block_size * self.checkpoint_every
        return [*range(stride, prompt_len, stride), prompt_len]

    def insert(
        self, tokens: Sequence[int], state: ModelState, *, row: int = 0, kv_only: bool = False
    ) -> None:
        """Store the state of ``tokens`` (row ``row`` of ``state`` has absorbed exactly them);
        ``kv_only``: the full blocks of KV only, no checkpoint (a decode worker's cache, which
        receives the fixed-size state with every transfer anyway)."""
        length, arrays = canonical_arrays(state, self.cfg, row)
        if length != len(tokens):
            raise ValueError(f"state holds {length} tokens but {len(tokens)} were given")
        with self._lock:
            seq = self.events.last_seq
            self._insert(tokens, length, arrays, kv_only=kv_only)
            if self.events.last_seq != seq:
                self._changed.notify_all()

    def _insert(
        self,
        tokens: Sequence[int],
        length: int,
        arrays: list[tuple[TensorSpec, np.ndarray]],
        *,
        kv_only: bool = False,
    ) -> None:
        growing = [a for spec, a in arrays if _is_growing(spec)]
        fixed = [a for spec, a in arrays if not _is_growing(spec)]
        bs = self.block_size
        node, now = self._root, next(self._clock)
        for depth, key in enumerate(block_hashes(tokens, bs), start=1):
            child = node.children.get(key)
            if child is None:
                kv = [np.array(a[(depth - 1) * bs : depth * bs]) for a in growing]
                block_tokens = tuple(tokens[(depth - 1) * bs : depth * bs])
                child = _Block(key, depth, block_tokens, kv, node, sum(a.nbytes for a in kv), now)
                node.children[key] = child
                self._account(child.nbytes, blocks=1)
                self.events.append(BlockStored(key, node.key))
            child.last_used = now
            node = child
        if kv_only:
            self._evict()
            return
        tail = tuple(tokens[node.depth * bs :])
        if tail not in node.checkpoints:
            tail_kv = [np.array(a[node.depth * bs :]) for a in growing]
            fixed_copy = [np.array(a) for a in fixed]
            nbytes = sum(a.nbytes for a in tail_kv) + sum(a.nbytes for a in fixed_copy)
            node.checkpoints[tail] = _Checkpoint(length, tail_kv, fixed_copy, nbytes, now)
            self._account(nbytes, checkpoints=1)
            self.events.append(CheckpointStored(node.key, tail))
        node.checkpoints[tail].last_used = now
        self._evict()

    # --- lookup -----------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], *, record: bool = True) -> PrefixHit | None:
        """The longest reusable prefix of ``tokens`` shorter than ``tokens``, or None.

        ``record=False`` (an export) neither refreshes the hit's LRU position nor counts in
        ``stats``. Either way a longer prefix in the disk tier is promoted first; ``probe`` is
        the read-only question. A recorded hit on a prefix the disk tier gave back (here, or
        to `prefetch` since) has ``tier`` DISK, its later hits host memory's.
        """
        with self._lock:
            seq = self.events.last_seq
            best = self._find(tokens)
            entry = self._disk_longer(tokens, best)
            promoted = None if entry is None else self._promote(entry)
            if promoted is not None:
                best = promoted
            if self.events.last_seq != seq:
                self._changed.notify_all()
            if not record:
                return best
            self.stats.lookups += 1
            if best is not None:
                now = next(self._clock)
                for block in best.blocks:
                    block.last_used = now
                best.checkpoint.last_used = now
                if best.checkpoint.from_disk:  # its first hit since the disk tier gave it back
                    best = dataclasses.replace(best, tier=DISK)
                self.stats.disk_hits += best.checkpoint.from_disk
                best.checkpoint.from_disk = False
                self.stats.hits += 1
                self.stats.hit_tokens += best.length
            return best

    def prefetch(self, tokens: Sequence[int]) -> int:
        """Promote the disk tier's prefix of ``tokens`` into host memory now if it is longer than
        the host hit (a prefill waiting for its engine reads it meanwhile); its length, or 0."""
        if self.disk is None:  # no tier below: no lookup on every prefill
            return 0
        with self._lock:
            seq = self.events.last_seq
            entry = self._disk_longer(tokens, self._find(tokens))
            promoted = None if entry is None else self._promote(entry)
            if self.events.last_seq != seq:
                self._changed.notify_all()
            return 0 if promoted is None else promoted.length

    def probe(self, tokens: Sequence[int]) -> int:
        """The length ``match`` would reuse, from either tier, changing nothing."""
        with self._lock:
            best = self._find(tokens)
            entry = self._disk_longer(tokens, best)
            if entry is not None:
                return len(entry.tokens)
            return 0 if best is None else best.length

    def _disk_longer(self, tokens: Sequence[int], best: PrefixHit | None) -> DiskEntry | None:
        """The disk tier's longest entry for ``tokens`` if longer than the host hit."""
        if self.disk is None:
            return None
        entry = self.disk.longest(tokens, len(tokens) - 1)
        if entry is None or len(entry.tokens) <= (0 if best is None else best.length):
            return None
        return entry

    def _promote(self, entry: DiskEntry) -> PrefixHit | None:
        """Read a disk entry back into host memory, and the hit on it (its own arrays, valid
        even when the host budget cannot keep it); None (and the entry gone: a corrupt file is
        never used) when it fails its checks."""
        assert self.disk is not None
        state = self.disk.load(entry)
        if state is None:
            self.events.append(self._disk_event(CheckpointEvicted, entry.tokens))
            return None
        length, arrays = canonical_arrays(state, self.cfg, 0)
        self._insert(entry.tokens, length, arrays)
        hit = self._find([*entry.tokens, 0])
        if hit is not None and hit.length == length:  # host memory kept it
            hit.checkpoint.from_disk = True
            return hit
        growing = [a for spec, a in arrays if _is_growing(spec)]
        fixed = [a for spec, a in arrays if not _is_growing(spec)]
        now = next(self._clock)
        return PrefixHit(length, (), _Checkpoint(length, growing, fixed, 0, now, from_disk=True))

    def _disk_event(self, kind: type, tokens: Sequence[int]) -> CacheEvent:
        """The disk tier's stored or evicted event for its entry of ``tokens``."""
        return kind(*checkpoint_key(tokens, self.block_size), DISK)

    def _spill(self, node: _Block, tail: tuple[int, ...]) -> None:
        """Write the checkpoint (``node``, ``tail``) with its prefix's KV to the disk tier."""
        assert self.disk is not None
        path = []
        while node is not self._root:
            path.append(node)
            node = node.parent
        path.reverse()
        checkpoint = (path[-1] if path else self._root).checkpoints[tail]
        tokens = [t for block in path for t in block.tokens] + list(tail)
        if self.disk.holds(tokens):  # promoted from there earlier and unchanged since
            self.disk.touch(tokens)
            return
        state = self.build_state(PrefixHit(len(tokens), tuple(path), checkpoint), len(tokens))
        evicted = self.disk.put(tokens, state)
        if evicted is None:  # not written (the file system refused): the prefix is gone
            return
        self.stats.spills += 1
        others = [entry.tokens for entry in evicted if entry.tokens != tuple(tokens)]
        if len(others) == len(evicted):  # the new entry itself fits the bound
            self.events.append(self._disk_event(CheckpointStored, tokens))
        for other in others:
            self.events.append(self._disk_event(CheckpointEvicted, other))

    def kv_prefix(self, tokens: Sequence[int]) -> KvPrefix:
        """The KV rows of the longest run of cached full blocks that starts ``tokens``, short of
        the last token (no checkpoint needed: a transfer brings the fixed-size state). Host
        arrays that stay valid after an eviction; length 0 when nothing is cached."""
        with self._lock:
            path = self._path(tokens[: len(tokens) - 1])
            now = next(self._clock)
            for block in path:
                block.last_used = now
        length = len(path) * self.block_size
        if not path:
            return KvPrefix(0, {})
        growing = [spec for spec in canonical_tensors(self.cfg, length) if _is_growing(spec)]
        rows = {
            (spec.layer, spec.name): np.concatenate([block.kv[i] for block in path])
            for i, spec in enumerate(growing)
        }
        return KvPrefix(length, rows)

    def _path(self, tokens: Sequence[int]) -> list[_Block]:
        """The cached full blocks that start ``tokens``, in order (caller holds the lock)."""
        node, path, bs = self._root, [], self.block_size
        for depth, key in enumerate(block_hashes(tokens, bs)):
            child = node.children.get(key)
            if child is None or child.tokens != tuple(tokens[depth * bs : (depth + 1) * bs]):
                break
            path.append(child)
            node = child
        return path

    def _find(self, tokens: Sequence[int]) -> PrefixHit | None:
        limit, bs = len(tokens) - 1, self.block_size
        best: PrefixHit | None = None
        path = self._path(tokens[:limit])
        # A checkpoint hangs off the root or off a block of the path, `depth` blocks deep.
        for depth, node in enumerate([self._root, *path]):
            start = depth * bs
            for tail, checkpoint in node.checkpoints.items():
                end = start + len(tail)
                longer = best is None or end > best.length
                if longer and end <= limit and tuple(tokens[start:end]) == tail:
                    best = PrefixHit(end, tuple(path[:depth]), checkpoint)
        return best

    def build_state(self, hit: PrefixHit, capacity: int) -> ModelState:
        """The batch-1 state of the hit's prefix, growing caches of ``capacity`` positions."""
        if capacity < hit.length:
            raise ValueError(f"capacity {capacity} cannot hold the {hit.length}-token prefix")
        growing = iter(
            np.concatenate([*(b.kv[i] for b in hit.blocks), tail])
            for i, tail in enumerate(hit.checkpoint.tail_kv)
        )
        fixed = iter(hit.checkpoint.fixed)
        arrays = [
            (spec, next(growing) if _is_growing(spec) else next(fixed))
            for spec in canonical_tensors(self.cfg, hit.length)
        ]
        return state_from_arrays(self.cfg, hit.length, arrays, capacity)

    def events_since(self, seq: int) -> list[tuple[int, CacheEvent]] | None:
        """The events numbered after ``seq`` (`EventLog.since`: None when some were dropped, and
        the reader must start again from a ``snapshot``)."""
        with self._lock:
            return self.events.since(seq)

    def wait_events(self, seq: int, timeout: float) -> list[tuple[int, CacheEvent]] | None:
        """`events_since`, waiting up to ``timeout`` seconds for the first event after ``seq``
        (an empty list when none came): how a subscriber follows the cache as it changes."""
        with self._changed:
            self._changed.wait_for(lambda: self.events.last_seq != seq, timeout)
            return self.events.since(seq)

    def snapshot(self) -> tuple[int, list[CacheEvent]]:
        """The whole content as the events that store it (parents before children), and the
        number of the last event it reflects: an index reset to it and fed ``events.since``
        that number is exact."""
        with self._lock:
            stored: list[CacheEvent] = []
            stack = [self._root]
            while stack:
                node = stack.pop()
                if node is not self._root:
                    stored.append(BlockStored(node.key, node.parent.key))
                stored.extend(CheckpointStored(node.key, tail) for tail in node.checkpoints)
                stack.extend(node.children.values())
            if self.disk is not None:
                disk = self.disk.entries()
                stored.extend(self._disk_event(CheckpointStored, e.tokens) for e in disk)
            return self.events.last_seq, stored

    # --- budget -----------------------------------------------------------------------------

    def _account(self, nbytes: int, *, blocks: int = 0, checkpoints: int = 0) -> None:
        self.stats.used_bytes += nbytes
        self.stats.blocks += blocks
        self.stats.checkpoints += checkpoints

    def _nodes(self) -> list[_Block]:
        stack, nodes = [self._root], []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def _evict(self) -> None:
        """Drop least-recently-used checkpoints and leaf blocks until the pool fits its budget."""
        while self.stats.used_bytes > self.stats.capacity_bytes:
            victim, victim_time = None, None
            for node in self._nodes():
                for tail, checkpoint in node.checkpoints.items():
                    if victim_time is None or checkpoint.last_used < victim_time:
                        victim, victim_time = (node, tail), checkpoint.last_used
                is_leaf = node is not self._root and not node.children and not node.checkpoints
                if is_leaf and (victim_time is None or node.last_used < victim_time):
                    victim, victim_time = node, node.last_used
            if victim is None:
                return
            if isinstance(victim, tuple):
                node, tail = victim
                if self.disk is not None:
                    self._spill(node, tail)
                self._account(-node.checkpoints.pop(tail).nbytes, checkpoints=-1)
                self.events.append(CheckpointEvicted(node.key, tail))
            else:
                del victim.parent.children[victim.key]
                self._account(-victim.nbytes, blocks=-1)
                self.events.append(BlockEvicted(victim.key))
            self.stats.evictions += 1
