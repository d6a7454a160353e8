"""`PushReader`: a `PushState` stream's frames handed on as they arrive, timed on the link's clock.

Every frame's arrival is stamped, with the arrival of the frame before it from the same sender
(its first message's `sender`, else its connection) — of this transfer, of another stripe of it,
or of another transfer that overlaps it — so the decode worker can tell the sender what its
link carried (policy/link_capacity.py, `backlog_sample`). A stream
past the byte limit is refused as it comes, before it is held whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc

from prfaas_jax.policy.link_capacity import FrameArrival
from prfaas_jax.serving.proto import prfaas_pb2 as pb


class PushTooLongError(Exception):
    """A push's frames passed the reader's byte limit."""


class PushReader:
    """Reads pushes; one per decode worker, shared by its streams (module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._last_arrival: dict[str, float] = {}  # per sender

    def read(
        self,
        first: pb.StateChunk,
        chunks: Iterator[pb.StateChunk],
        context: grpc.ServicerContext,
        take: Callable[[bytes], None],
    ) -> tuple[list[FrameArrival], bool]:
        """Hands the stream's frames (after its first message) to ``take`` as they arrive;
        returns their arrivals and whether the stream ended with a `last` message (a striped
        stream's clean end). `PushTooLongError` as soon as the frames pass ``max_bytes``; what
        ``take`` raises ends the read."""
        arrivals: list[FrameArrival] = []
        total, sender = 0, first.sender or context.peer()
        for chunk in chunks:
            if chunk.last:
                return arrivals, True
            with self._lock:
                now = time.perf_counter()
                previous, self._last_arrival[sender] = self._last_arrival.get(sender), now
            arrivals.append(FrameArrival(now, len(chunk.frame), chunk.queued, previous))
            total += len(chunk.frame)
            if total > self.max_bytes:
                raise PushTooLongError
            take(chunk.frame)
        return arrivals, False
