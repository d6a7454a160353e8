"""The router's index of every instance's prefix cache, kept from their event streams:
`CacheFeed` (`[router] cache_index`, on by default when `[prefix_cache]` is).

One thread per instance follows its `PrefixCache.Events` stream (serving/worker/prefix.py):
first a snapshot of the whole cache, then each batch of events as the cache stores and evicts,
applied to one `CacheIndex` (policy/cache_index.py). `lookup` then answers the routing rule's
cached lengths for a prompt without a round trip, at a cost that grows with the prompt, not
with the number of instances, and only the instances the index cannot answer for are asked
with `Lookup` (`lookup_prefixes`):

* one whose stream is not in step: not yet synchronised, broken (the instance died or
  restarted: the thread resubscribes and installs a fresh snapshot), or out of order (a batch
  that is not the next — the thread drops the instance and resubscribes);
* one whose last prefill reply named a cache event the index has not applied yet
  (`PrefillReply.cache_seq`, recorded by `saw_reply`). So an index answer always reflects, at
  least, every prompt that instance has kept and replied for: the next turn of a conversation
  finds its previous turn, exactly as the fan-out lookup would.

What the index cannot promise is the events still in flight: an eviction on the instance after
its last applied event. Routing on that costs a recompute (the instance matches its own cache
when it prefills, and reports what it reused), never a wrong output. The router counts it
(``overestimates``) and corrects the index at once: it drops that instance (asked directly
from then on) and subscribes again for a fresh snapshot (`resync`), so an index that went wrong
for any reason is put right by the next request that notices.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence

import grpc

from prfaas_jax.errors import UserError
from prfaas_jax.policy.cache_index import CacheIndex
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.router.handles import lookup_prefixes
from prfaas_jax.serving.transport.cache_events import batch_from_proto

log = logging.getLogger("prfaas.router")
RESUBSCRIBE_S = 0.5  # the wait before following a broken stream again


@dataclasses.dataclass
class FeedCounters:
    events: int = 0  # events applied
    snapshots: int = 0  # snapshots installed
    answered: int = 0  # per-instance lengths the index gave
    asked: int = 0  # per-instance lengths asked by Lookup instead


@dataclasses.dataclass
class _Follower:
    stub: pb_grpc.PrefixCacheStub
    stop: threading.Event
    thread: threading.Thread
    call: grpc.Future | None = None


class CacheFeed:
    """The index, the threads that keep it, and lookups answered from it."""

    def __init__(self, block_size: int, vocab_size: int) -> None:
        self.index = CacheIndex(block_size)
        self.vocab_size = vocab_size
        self.counters = FeedCounters()
        self._lock = threading.Lock()  # the index, the counters, `_replied`
        self._replied: dict[str, int] = {}  # instance → cache_seq of its last prefill reply
        self._followers: dict[str, _Follower] = {}

    # --- following instances ----------------------------------------------------------------

    def follow(self, name: str, stub: pb_grpc.PrefixCacheStub) -> None:
        """Follow ``name``'s cache through ``stub`` (replacing an earlier stub: a restarted
        instance starts with an empty cache and numbers its events from 1 again)."""
        self.forget(name)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._run, args=(name, stop), name=f"cache-feed-{name}", daemon=True
        )
        with self._lock:
            self._followers[name] = _Follower(stub, stop, thread)
        thread.start()

    def forget(self, name: str) -> None:
        with self._lock:
            follower = self._followers.pop(name, None)
            self.index.drop(name)
            self._replied.pop(name, None)
        if follower is not None:
            follower.stop.set()
            if follower.call is not None:
                follower.call.cancel()

    def close(self) -> None:
        with self._lock:
            names = list(self._followers)
        for name in names:
            self.forget(name)

    def _run(self, name: str, stop: threading.Event) -> None:
        """Subscribe, apply, and subscribe again after a break, until ``stop``."""
        with self._lock:
            follower = self._followers.get(name)
        while follower is not None and not stop.is_set():
            call = follower.stub.Events(pb.PrefixEventsRequest(after=0))
            follower.call = call
            if stop.is_set():  # forgotten while subscribing
                call.cancel()
                return
            try:
                for message in call:
                    if not self._apply(name, message, stop):
                        call.cancel()  # out of step: start again from a snapshot
                        break
            except grpc.RpcError as err:
                if stop.is_set():
                    return
                if err.code() is grpc.StatusCode.CANCELLED:  # `resync`: subscribe again now
                    continue
                if err.code() in (
                    grpc.StatusCode.UNIMPLEMENTED,
                    grpc.StatusCode.FAILED_PRECONDITION,
                ):
                    log.info("%s keeps no prefix cache events (%s)", name, err.code().name)
                    with self._lock:
                        self.index.drop(name)
                        if self._followers.get(name) is follower:
                            del self._followers[name]  # asked, if it is ever a prefill instance
                    return
                log.info("cache events of %s broke off (%s)", name, err.code().name)
            with self._lock:
                if not stop.is_set():
                    self.index.drop(name)  # asked directly until a new snapshot is in
            stop.wait(RESUBSCRIBE_S)

    def _apply(self, name: str, message: pb.PrefixEventBatch, stop: threading.Event) -> bool:
        """Apply one batch; False when the instance is out of step (or the batch malformed)."""
        try:
            batch = batch_from_proto(
                message, block_size=self.index.block_size, vocab_size=self.vocab_size
            )
        except UserError as err:
            log.warning("bad cache events from %s: %s", name, err)
            return False
        with self._lock:
            if stop.is_set():
                return False
            if batch.snapshot:
                self.index.reset(name, batch.last_seq, batch.events)
                self.counters.snapshots += 1
                # Numbers above the snapshot's belong to an earlier process of this instance.
                if self._replied.get(name, 0) > batch.last_seq:
                    self._replied[name] = batch.last_seq
                return True
            for seq, event in enumerate(batch.events, start=batch.first_seq):
                if not self.index.apply(name, seq, event):
                    return False
                self.counters.events += 1
            return True

    def resync(self, name: str) -> None:
        """Drop what the index holds of ``name`` and install a fresh snapshot (the thread
        subscribes again): after a prefill reused less than the index said."""
        with self._lock:
            follower = self._followers.get(name)
            self.index.drop(name)
        if follower is not None and follower.call is not None:
            follower.call.cancel()

    # --- answering ------------------------------------------------------------------------

    def saw_reply(self, name: str, cache_seq: int) -> None:
        """``name`` replied to a prefill after its cache's event ``cache_seq``: until the index
        has applied it, ``name`` is asked, not answered for."""
        with self._lock:
            if cache_seq > self._replied.get(name, 0):
                self._replied[name] = cache_seq

    def lookup(
        self, prompt: Sequence[int], stubs: Mapping[str, pb_grpc.PrefixCacheStub]
    ) -> dict[str, int]:
        """Each of ``stubs``' instances' cached prefix of ``prompt``: from the index where it
        is in step, by `lookup_prefixes` for the rest."""
        with self._lock:
            lengths = self.index.cached_lengths(prompt)
            answered = {
                name: lengths[name]
                for name in stubs
                if name in lengths and self.index.last_seq(name) >= self._replied.get(name, 0)
            }
            asked = {name: stub for name, stub in stubs.items() if name not in answered}
            self.counters.answered += len(answered)
            self.counters.asked += len(asked)
        return answered | (lookup_prefixes(asked, prompt) if asked else {})

    def stats(self) -> pb.CacheIndexStats:
        with self._lock:
            index = self.index.stats()
            return pb.CacheIndexStats(
                enabled=True,
                instances=len(self._followers),
                current=sum(self.index.is_current(name) for name in self._followers),
                block_entries=index.block_entries,
                checkpoint_entries=index.checkpoint_entries,
                **dataclasses.asdict(self.counters),
            )
