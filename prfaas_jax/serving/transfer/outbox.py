"""`Outbox`: a state's frames between the engine thread and the streams that carry them.

The engine thread `put`s each frame as it is made; gRPC's request-stream thread of each push
takes them (`frames_to_send`). A PrfaaS worker's frames take their place on the link's token
bucket when they are made, not when a sender gets to them. A transfer striped over N streams
(`[link] streams`, serving/transfer/stripes.py) has N lanes: the header, the trailer and the
handoff go on lane 0, the data frames round-robin over all lanes.

A transfer that ends early — the router gave up, a push failed, `[faults]` cut the link — is
abandoned: every push is cancelled, so the decode worker sees cancelled streams, never a short
one it would take for a complete, malformed state.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Sequence

import grpc

from prfaas_jax.engine.codec.format import DATA_MAGIC, FrameParts
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.faults import TransferFaults
from prfaas_jax.serving.transport.link import LinkShaper

_CLOSED = None
_CANCEL_WAIT_S = 5.0  # bounds the wait for gRPC to act on a cancel (it takes milliseconds)


class Outbox:
    """Frames between the engine thread (`put`) and the push streams (`frames_to_send`),
    shaped by the link when there is one (module docstring)."""

    def __init__(
        self, shaper: LinkShaper | None, context: grpc.ServicerContext, *, lanes: int = 1
    ) -> None:
        if lanes < 1:
            raise ValueError(f"an outbox needs ≥ 1 lane, got {lanes}")
        self._shaper, self._context, self.lanes = shaper, context, lanes
        self._queues: list[queue.Queue[tuple[bytes, float] | None]] = [
            queue.Queue() for _ in range(lanes)
        ]
        self._next_lane = 0
        self._stopped = threading.Event()  # the sender gave up: drop what is still made
        self.frames = self.wire_bytes = 0
        self.pushes: list[grpc.Future] = []  # one per lane, lane 0 first
        self.faults: TransferFaults | None = None  # `[faults]`: this transfer's planned faults

    def put(self, frame: bytes | FrameParts) -> None:
        if self._stopped.is_set():
            return
        if self.faults is not None:
            frame = self.faults.corrupt(bytes(frame))
        lane = 0
        if self.lanes > 1 and bytes(frame[: len(DATA_MAGIC)]) == DATA_MAGIC:
            lane, self._next_lane = self._next_lane, (self._next_lane + 1) % self.lanes
        # The frame joins the link's queue when it is made, not when the sender gets to it.
        arrival = self._shaper.admit(len(frame)) if self._shaper is not None else 0.0
        self.frames += 1
        self.wire_bytes += len(frame)
        self._queues[lane].put((frame, arrival))

    def put_all(self, frames: Iterable[bytes | FrameParts]) -> None:
        for frame in frames:
            self.put(frame)

    def close(self) -> None:
        for lane in self._queues:
            lane.put(_CLOSED)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        self._stopped.set()

    def cancel(self) -> None:
        """Abandon the transfer: the decode worker sees cancelled streams, not short ones."""
        self.stop()
        for push in self.pushes:
            push.cancel()
        self.close()  # wakes the sending threads if they wait for a frame

    def cut_reason(self) -> str:
        faults = self.faults
        if faults is not None and faults.dropped:
            where = "inter-cluster link" if self._shaper is not None else "link"
            return f"{where} dropped after {faults.cut_after} of {faults.num_frames} frames"
        return "the transfer was cancelled"

    def _abandon(self) -> None:
        """End every push without a clean end: cancel them, and return from the request stream
        only once gRPC has seen the cancels. Returning first would half-close a stream, which
        the decode worker could read as a complete state that is short (INVALID_ARGUMENT and a
        refused state in its log) instead of a cut transfer."""
        self.stop()
        for push in self.pushes:
            cancelled = threading.Event()
            push.add_done_callback(lambda _, done=cancelled: done.set())
            push.cancel()
            cancelled.wait(_CANCEL_WAIT_S)

    def frames_to_send(self, lane: int = 0) -> Iterator[tuple[bytes, bool]]:
        """``(frame, queued)`` of ``lane`` as they may go: ``queued`` when the frame was made
        before the previous one left, so it follows it onto the wire back to back (the receiver
        times the link on such frames: policy/link_capacity.py)."""
        sent, lane_queue = 0, self._queues[lane]
        while True:
            try:
                item, queued = lane_queue.get_nowait(), sent > 0
            except queue.Empty:
                item, queued = lane_queue.get(), False
            if item is _CLOSED:
                return
            if self._stopped.is_set() or not self._context.is_active():
                self._abandon()  # the router gave up on this request: stop using the link
                return
            if self.faults is not None and self.faults.cut(sent):
                self._abandon()  # a dead link: the receiver sees no clean end
                return
            frame, arrival = item
            if self._shaper is not None:
                frame = self._shaper.deliver(frame, arrival)
            yield frame, queued
            sent += 1


def striped_sample(replies: Sequence[pb.PushStateReply]) -> tuple[int, float]:
    """One link sample from the pushes of a transfer, ``(bytes, seconds)``: the decode worker
    times a striped transfer's frames on one clock (the sender's) and replies on stream 0, so
    the replies' bytes and seconds add up."""
    return sum(r.backlog_bytes for r in replies), sum(r.backlog_s for r in replies)
