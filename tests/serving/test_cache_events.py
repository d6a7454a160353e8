"""Prefix-cache events on the wire and the router's feed of them.

`batch_to_proto` / `batch_from_proto` (serving/transport/cache_events.py): every event kind
round-trips; every malformed batch is refused with a one-line `UserError`. `PrefixService.Events`
(serving/worker/prefix.py) streams a snapshot, then each prefill's events; a reader the log has
left behind gets a snapshot again. `CacheFeed` (serving/router/cache_feed.py) over a real worker
server: its answers equal the cache's own `match`; an instance whose last reply named an event
the index has not applied, or whose server went away, is asked instead; `resync` installs a
fresh snapshot; `forget` stops the thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc
import pytest
from serving_support import serve_workers, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.cached_prefill import CachedPrefill
from prfaas_jax.engine.fake import FakePrefillEngine
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.errors import UserError
from prfaas_jax.policy.cache_index import CacheIndex
from prfaas_jax.prefix_events import (
    DISK,
    ROOT,
    BlockEvicted,
    BlockStored,
    CheckpointEvicted,
    CheckpointStored,
    EventLog,
    block_hashes,
)
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.router.cache_feed import CacheFeed
from prfaas_jax.serving.transport.cache_events import batch_from_proto, batch_to_proto
from prfaas_jax.serving.worker.prefix import PrefixService

CFG = load_model_config("tiny")
BLOCK = 4
MAX_LEN = 128
KEY = bytes(range(16))
OTHER = bytes(range(1, 17))
Kind = pb.PrefixEvent.Kind


def _read(message: pb.PrefixEventBatch):
    return batch_from_proto(message, block_size=BLOCK, vocab_size=CFG.vocab_size)


# --- the wire --------------------------------------------------------------------------------


def test_every_event_kind_round_trips():
    events = [
        BlockStored(KEY, ROOT),
        BlockStored(OTHER, KEY),
        CheckpointStored(ROOT, (1, 2)),
        CheckpointStored(KEY, ()),
        CheckpointEvicted(OTHER, (3,)),
        BlockEvicted(OTHER),
        CheckpointStored(OTHER, (5,), DISK),
        CheckpointEvicted(OTHER, (5,), DISK),
    ]
    message = batch_to_proto(events, snapshot=False, last_seq=9, block_size=BLOCK)
    batch = _read(pb.PrefixEventBatch.FromString(message.SerializeToString()))
    assert (batch.snapshot, batch.last_seq, batch.first_seq, batch.events) == (False, 9, 2, events)
    assert [event.tier for event in message.events[6:]] == [pb.PrefixEvent.TIER_DISK] * 2
    stored = events[:4]
    snapshot = _read(batch_to_proto(stored, snapshot=True, last_seq=0, block_size=BLOCK))
    assert (snapshot.snapshot, snapshot.last_seq, snapshot.events) == (True, 0, stored)


BAD_EVENTS = [
    (pb.PrefixEvent(kind=Kind.BLOCK_STORED, key=KEY[:15], parent=ROOT), "15 bytes"),
    (pb.PrefixEvent(kind=Kind.BLOCK_STORED, key=ROOT, parent=ROOT), "0 bytes"),
    (pb.PrefixEvent(kind=Kind.BLOCK_STORED, key=KEY, parent=KEY + b"x"), "17 bytes"),
    (pb.PrefixEvent(kind=Kind.BLOCK_STORED, key=KEY, tail=[1]), "no tail"),
    (pb.PrefixEvent(kind=Kind.BLOCK_STORED, key=KEY, tier=1), "no tier"),
    (pb.PrefixEvent(kind=Kind.CHECKPOINT_STORED, key=KEY, tier=7), "unknown checkpoint tier"),
    (pb.PrefixEvent(kind=Kind.BLOCK_EVICTED, key=KEY, parent=OTHER), "no parent"),
    (pb.PrefixEvent(kind=Kind.CHECKPOINT_STORED, key=KEY, tail=[0] * BLOCK), "tail of 4"),
    (pb.PrefixEvent(kind=Kind.CHECKPOINT_STORED, key=KEY, tail=[CFG.vocab_size]), "outside"),
    (pb.PrefixEvent(kind=Kind.CHECKPOINT_STORED, key=KEY, tail=[-1]), "outside"),
    (pb.PrefixEvent(kind=Kind.CHECKPOINT_STORED, key=ROOT), "empty prefix"),
    (pb.PrefixEvent(kind=Kind.CHECKPOINT_EVICTED, key=KEY, parent=OTHER), "no parent"),
    (pb.PrefixEvent(kind=Kind.KIND_UNSPECIFIED, key=KEY), "unknown"),
    (pb.PrefixEvent(kind=17, key=KEY), "unknown"),
]


@pytest.mark.parametrize(("event", "word"), BAD_EVENTS)
def test_a_malformed_event_is_refused(event, word):
    with pytest.raises(UserError, match=word):
        _read(pb.PrefixEventBatch(last_seq=1, block_size=BLOCK, events=[event]))


def test_a_malformed_batch_is_refused():
    stored = pb.PrefixEvent(kind=Kind.BLOCK_STORED, key=KEY, parent=ROOT)
    evicted = pb.PrefixEvent(kind=Kind.BLOCK_EVICTED, key=KEY)
    with pytest.raises(UserError, match="blocks are 8 tokens, not 4"):
        _read(pb.PrefixEventBatch(last_seq=1, block_size=8, events=[stored]))
    with pytest.raises(UserError, match="stored events only"):
        _read(pb.PrefixEventBatch(snapshot=True, last_seq=3, block_size=BLOCK, events=[evicted]))
    with pytest.raises(UserError, match="a batch of 0 events"):
        _read(pb.PrefixEventBatch(last_seq=3, block_size=BLOCK))
    with pytest.raises(UserError, match="a batch of 2 events ending at number 1"):
        _read(pb.PrefixEventBatch(last_seq=1, block_size=BLOCK, events=[stored, evicted]))


# --- the stream ------------------------------------------------------------------------------


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % CFG.vocab_size for i in range(n)]


class Worker:
    """One worker's prefix cache, prefilled through as a prefill worker does, and served."""

    def __init__(self, capacity_bytes: int = 1 << 24, keep: int = 65536) -> None:
        self.cache = PrefixCache(
            CFG, capacity_bytes=capacity_bytes, block_size=BLOCK, checkpoint_every=2
        )
        self.cache.events = EventLog(keep)
        self.service = PrefixService(
            cfg=CFG, cache=self.cache, max_len=MAX_LEN, frame_bytes=1 << 16, shaper=None
        )
        self.engine = FakePrefillEngine(CFG)
        self.server = serve_workers(prefixes=self.service)
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.PrefixCacheStub(self.channel)

    def prefill(self, tokens: list[int]) -> None:
        CachedPrefill(self.cache).prefill(self.engine, tokens, max_len=MAX_LEN)

    def truth(self, tokens: list[int]) -> int:
        hit = self.cache.match(tokens, record=False)
        return 0 if hit is None else hit.length

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace_s=0.1)


@contextlib.contextmanager
def worker(**options) -> Iterator[Worker]:
    w = Worker(**options)
    try:
        yield w
    finally:
        w.close()


def test_the_stream_starts_with_a_snapshot_then_follows_each_prefill():
    with worker() as w:
        w.prefill(prompt(10))
        stream = w.stub.Events(pb.PrefixEventsRequest(after=0), timeout=30)
        first = _read(next(stream))
        assert first.snapshot and first.last_seq == w.cache.events.last_seq
        index = CacheIndex(BLOCK)
        index.reset("w", first.last_seq, first.events)
        for offset in (1, 2):
            w.prefill(prompt(10) + prompt(6, offset))
            batch = _read(next(stream))
            assert not batch.snapshot and batch.first_seq == index.last_seq("w") + 1
            for seq, event in enumerate(batch.events, start=batch.first_seq):
                assert index.apply("w", seq, event)
        assert index.last_seq("w") == w.cache.events.last_seq
        for query in (prompt(10), prompt(10) + prompt(6, 1) + [3], prompt(10) + prompt(6, 2)):
            assert index.cached_lengths(query) == {"w": w.truth(query)}
        stream.cancel()


def test_a_reader_the_log_has_left_behind_gets_a_snapshot():
    with worker(keep=4) as w:
        for offset in range(3):
            w.prefill(prompt(12, offset))
        assert w.cache.events.last_seq > 4
        stream = w.stub.Events(pb.PrefixEventsRequest(after=1), timeout=30)
        batch = _read(next(stream))
        assert batch.snapshot and batch.last_seq == w.cache.events.last_seq
        stream.cancel()
        # A reader still within the log gets only what it lacks.
        last = w.cache.events.last_seq
        stream = w.stub.Events(pb.PrefixEventsRequest(after=last - 2), timeout=30)
        batch = _read(next(stream))
        assert (batch.snapshot, batch.first_seq, batch.last_seq) == (False, last - 1, last)
        stream.cancel()


def test_a_worker_without_a_cache_refuses_to_stream():
    service = PrefixService(cfg=CFG, cache=None, max_len=MAX_LEN, frame_bytes=1 << 16, shaper=None)
    server = serve_workers(prefixes=service)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stream = pb_grpc.PrefixCacheStub(channel).Events(pb.PrefixEventsRequest(), timeout=30)
            with pytest.raises(grpc.RpcError) as err:
                next(stream)
            assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop(grace_s=0.1)


# --- the router's feed -----------------------------------------------------------------------


def in_step(feed: CacheFeed, name: str, cache: PrefixCache) -> bool:
    return feed.index.is_current(name) and feed.index.last_seq(name) == cache.events.last_seq


def test_the_feed_answers_what_the_cache_would_match_without_asking():
    with worker() as a, worker() as b:
        feed = CacheFeed(BLOCK, CFG.vocab_size)
        try:
            feed.follow("a", a.stub)
            feed.follow("b", b.stub)
            system = prompt(20)
            a.prefill(system + prompt(5, 1))
            b.prefill(system[:9])
            assert wait_for(lambda: in_step(feed, "a", a.cache) and in_step(feed, "b", b.cache))
            stubs = {"a": a.stub, "b": b.stub}
            queries = [system + prompt(5, 1) + [1, 2], [*system, 9], [*system[:9], 4], [5]]
            for query in queries:
                assert feed.lookup(query, stubs) == {"a": a.truth(query), "b": b.truth(query)}
            assert (feed.counters.answered, feed.counters.asked) == (2 * len(queries), 0)
            assert any(feed.lookup(q, stubs)["a"] > 0 for q in queries)
            stats = feed.stats()
            assert (stats.instances, stats.current, stats.snapshots) == (2, 2, 2)
            assert stats.block_entries == len(block_hashes(system + prompt(5, 1), BLOCK)) + 2
        finally:
            feed.close()


def test_an_instance_the_index_is_behind_is_asked():
    with worker() as w:
        feed = CacheFeed(BLOCK, CFG.vocab_size)
        try:
            feed.follow("w", w.stub)
            w.prefill(prompt(16))
            assert wait_for(lambda: in_step(feed, "w", w.cache))
            query = [*prompt(16), 1]
            # A reply names an event the index has not seen: ask, and get the exact answer.
            feed.saw_reply("w", w.cache.events.last_seq + 1)
            assert feed.lookup(query, {"w": w.stub}) == {"w": 16}
            assert (feed.counters.answered, feed.counters.asked) == (0, 1)
            w.prefill(prompt(8, 3))  # the event named
            assert wait_for(lambda: in_step(feed, "w", w.cache))
            assert feed.lookup(query, {"w": w.stub}) == {"w": 16}
            assert (feed.counters.answered, feed.counters.asked) == (1, 1)
        finally:
            feed.close()


def test_resync_installs_a_fresh_snapshot():
    with worker() as w:
        feed = CacheFeed(BLOCK, CFG.vocab_size)
        try:
            feed.follow("w", w.stub)
            assert wait_for(lambda: in_step(feed, "w", w.cache))
            # The index goes wrong (a block it never saw), and a resync puts it right.
            feed.index.apply("w", feed.index.last_seq("w") + 1, BlockStored(KEY, ROOT))
            assert feed.stats().block_entries == 1
            feed.resync("w")
            assert wait_for(lambda: feed.counters.snapshots == 2 and in_step(feed, "w", w.cache))
            assert feed.stats().block_entries == 0
        finally:
            feed.close()


def test_a_lost_instance_is_asked_and_forget_stops_its_thread():
    a = Worker()
    feed = CacheFeed(BLOCK, CFG.vocab_size)
    try:
        feed.follow("a", a.stub)
        assert wait_for(lambda: in_step(feed, "a", a.cache))
        a.server.stop(grace_s=0.1)
        assert wait_for(lambda: not feed.index.is_current("a"))
        # Not answered from the index; the ask fails too, and counts as holding nothing.
        assert feed.lookup(prompt(9), {"a": a.stub}) == {"a": 0}
        assert feed.counters.asked == 1
        threads = [t for t in threading.enumerate() if t.name == "cache-feed-a"]
        feed.forget("a")
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive()
        assert feed.stats().instances == 0
    finally:
        feed.close()
        a.channel.close()
