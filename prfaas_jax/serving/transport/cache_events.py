"""Prefix-cache events on the wire: `batch_to_proto` and `batch_from_proto`
(`prfaas.v1.PrefixEventBatch` ↔ the events of prfaas_jax/prefix_events.py).

A batch is either a snapshot (the whole content as stored events, as of event ``last_seq``) or
the events numbered ``last_seq − n + 1 … last_seq``. The reader checks everything before an
event reaches its index: the kind, 16-byte keys (the root is the empty key, allowed only as a
parent or a checkpoint's block), a tail shorter than a block of in-range token ids, a known
tier (checkpoints only), a block size equal to the one the reader expects, and a snapshot that
holds stored events only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from prfaas_jax.errors import UserError
from prfaas_jax.prefix_events import (
    DISK,
    HOST,
    ROOT,
    BlockEvicted,
    BlockStored,
    CacheEvent,
    CheckpointEvicted,
    CheckpointStored,
)
from prfaas_jax.serving.proto import prfaas_pb2 as pb

KEY_BYTES = 16  # blake2b digest size of the hash chain (prefix_events.block_hashes)
_Kind = pb.PrefixEvent.Kind
_TIER_TO_PROTO = {HOST: pb.PrefixEvent.TIER_HOST, DISK: pb.PrefixEvent.TIER_DISK}
_TIER_FROM_PROTO = {value: tier for tier, value in _TIER_TO_PROTO.items()}


@dataclasses.dataclass(frozen=True)
class EventBatch:
    snapshot: bool
    last_seq: int
    events: list[CacheEvent]

    @property
    def first_seq(self) -> int:
        """The number of the first event (a batch of events, not a snapshot)."""
        return self.last_seq - len(self.events) + 1


def event_to_proto(event: CacheEvent) -> pb.PrefixEvent:
    match event:
        case BlockStored(key=key, parent=parent):
            return pb.PrefixEvent(kind=_Kind.BLOCK_STORED, key=key, parent=parent)
        case BlockEvicted(key=key):
            return pb.PrefixEvent(kind=_Kind.BLOCK_EVICTED, key=key)
        case CheckpointStored(block=block, tail=tail, tier=tier):
            kind, tier_value = _Kind.CHECKPOINT_STORED, _TIER_TO_PROTO[tier]
            return pb.PrefixEvent(kind=kind, key=block, tail=tail, tier=tier_value)
        case CheckpointEvicted(block=block, tail=tail, tier=tier):
            kind, tier_value = _Kind.CHECKPOINT_EVICTED, _TIER_TO_PROTO[tier]
            return pb.PrefixEvent(kind=kind, key=block, tail=tail, tier=tier_value)
    raise TypeError(f"not a cache event: {event!r}")


def batch_to_proto(
    events: Sequence[CacheEvent], *, snapshot: bool, last_seq: int, block_size: int
) -> pb.PrefixEventBatch:
    return pb.PrefixEventBatch(
        snapshot=snapshot,
        last_seq=last_seq,
        block_size=block_size,
        events=[event_to_proto(event) for event in events],
    )


def _key(value: bytes, what: str, *, root_ok: bool) -> bytes:
    if len(value) == KEY_BYTES or (root_ok and value == ROOT):
        return bytes(value)
    allowed = f"{KEY_BYTES} bytes" + (" or empty (the root)" if root_ok else "")
    raise UserError(f"{what} is {len(value)} bytes; expected {allowed}")


def event_from_proto(message: pb.PrefixEvent, block_size: int, vocab_size: int) -> CacheEvent:
    kind = message.kind
    if kind in (_Kind.BLOCK_STORED, _Kind.BLOCK_EVICTED):
        if message.tail or message.tier:
            raise UserError("a block event carries no tail and no tier")
        key = _key(message.key, "a block key", root_ok=False)
        if kind == _Kind.BLOCK_EVICTED:
            if message.parent:
                raise UserError("a block eviction carries no parent")
            return BlockEvicted(key)
        return BlockStored(key, _key(message.parent, "a parent key", root_ok=True))
    if kind in (_Kind.CHECKPOINT_STORED, _Kind.CHECKPOINT_EVICTED):
        if message.parent:
            raise UserError("a checkpoint event carries no parent")
        block = _key(message.key, "a checkpoint's block", root_ok=True)
        tail = tuple(message.tail)
        if len(tail) >= block_size:
            raise UserError(f"a checkpoint tail of {len(tail)} tokens; blocks are {block_size}")
        if any(not 0 <= token < vocab_size for token in tail):
            raise UserError(f"a checkpoint tail holds a token outside [0, {vocab_size})")
        if block == ROOT and not tail:
            raise UserError("a checkpoint of the empty prefix")
        tier = _TIER_FROM_PROTO.get(message.tier)
        if tier is None:
            raise UserError(f"unknown checkpoint tier {message.tier}")
        if kind == _Kind.CHECKPOINT_EVICTED:
            return CheckpointEvicted(block, tail, tier)
        return CheckpointStored(block, tail, tier)
    raise UserError(f"unknown prefix-cache event kind {kind}")


def batch_from_proto(
    message: pb.PrefixEventBatch, *, block_size: int, vocab_size: int
) -> EventBatch:
    """The checked batch; UserError (one line) when any of it is malformed."""
    if message.block_size != block_size:
        raise UserError(f"the cache's blocks are {message.block_size} tokens, not {block_size}")
    events = [event_from_proto(event, block_size, vocab_size) for event in message.events]
    if message.snapshot:
        if any(not isinstance(event, BlockStored | CheckpointStored) for event in events):
            raise UserError("a snapshot holds stored events only")
    elif not events or len(events) > message.last_seq:
        raise UserError(f"a batch of {len(events)} events ending at number {message.last_seq}")
    return EventBatch(message.snapshot, message.last_seq, events)
