"""The inter-cluster link's capacity, learned from the transfers themselves: `CapacityMeter`.

Also `FrameArrival` and `backlog_sample`, which turn one transfer into a sample.

A state transfer is a run of frames. The sender marks each frame that was already made when the
previous one of its transfer left (`queued`): the link had a backlog, so the time since the
previous frame *from that sender* arrived (of this transfer, another stripe of it, or another
transfer that overlaps it) is the link's time for this frame — whatever the link is (a kernel
`tbf`, a token bucket in the sender, a real WAN). Frames that waited for the model instead (the
link idle before them) say nothing about the link and are left out. One transfer's sample is

    bytes of its timed frames  /  the sum of their inter-arrival times

over the later half (by bytes) of its timed frames, from a frame that starts a clump (see
`backlog_sample`): a link that was idle lets the first bytes of a backlog through at line rate
(a token bucket's burst, TCP's initial window), and the rate the link *sustains* is what the
throughput model needs. It is goodput, after TCP, TLS and gRPC — not the rate a shaper was
configured with.

`CapacityMeter` smooths the samples with an exponentially weighted mean of their rates (weight ½
by default): a cut by 8× moves the estimate by 44 % with the first transfer that sees it (the
controller re-solves at a 20 % change), and a recovery is within 15 % after three. Samples too
short to time (below `min_seconds` or `min_bytes`) are ignored. An estimate with no sample for
`stale_s` is dropped: t may have risen until nothing crosses the link, and a link nobody uses
cannot be measured, so the router falls back to the configured bandwidth, offloads again and
learns the link anew. Pure: the caller passes the time, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FrameArrival:
    at: float  # receiver's clock, seconds
    nbytes: int
    queued: bool  # the sender had made it before the previous frame of its transfer left
    previous: float | None  # when the sender's previous frame arrived (None: it is the first)


def backlog_sample(frames: Iterable[FrameArrival], *, skip: float = 0.5) -> tuple[int, float]:
    """``(bytes, seconds)`` the link took for a transfer's timed frames from the first one that
    starts a delivery past the first ``skip`` of their bytes (module docstring); ``(0, 0.0)``
    when none qualifies.

    Links deliver in clumps (a `tbf` releases a 64 KiB GSO segment at a time; the receiver reads
    several frames per wake-up): a clump's time is the gap before its first frame. So counting
    starts at a frame whose gap is at least half what its bytes take at the mean pace (gap per
    byte over the timed frames) — the start of a clump, or any frame of a smooth stream, small
    ones included — never inside a clump, which would credit its later frames with no time.
    A frame reaches the receiver whole, but the link carries it in pieces: the first counted
    frame may have been partly delivered with the clump before, so half of its bytes count
    (the error stays within half a frame either way).
    """
    if not 0 <= skip < 1:
        raise ValueError(f"skip must be in [0, 1), got {skip}")
    timed = [
        (f.nbytes, max(f.at - f.previous, 0.0))
        for f in frames
        if f.queued and f.previous is not None
    ]
    if not timed:
        return 0, 0.0
    total = sum(n for n, _ in timed)
    pace = sum(gap for _, gap in timed) / total if total else 0.0  # seconds per byte
    start, before, counting = skip * total, 0, False
    nbytes, seconds = 0, 0.0
    for size, gap in timed:
        counted = size
        if not counting and before >= start and gap >= 0.5 * pace * size:
            # The clump's first frame straddles the interval's start: the link may have
            # carried part of it before the previous clump arrived. Count half of it.
            counting, counted = True, size // 2
        if counting:
            nbytes, seconds = nbytes + counted, seconds + gap
        before += size
    return nbytes, seconds


class CapacityMeter:
    """A smoothed link rate from `backlog_sample`s (module docstring); times are the caller's
    clock."""

    def __init__(
        self,
        *,
        weight: float = 0.5,
        min_seconds: float = 0.002,
        min_bytes: int = 4096,
        stale_s: float = 10.0,
    ) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        if min_seconds <= 0 or min_bytes < 0 or stale_s <= 0:
            raise ValueError("min_seconds and stale_s must be positive and min_bytes ≥ 0")
        self.weight, self.min_seconds, self.min_bytes = weight, min_seconds, min_bytes
        self.stale_s = stale_s
        self._rate = 0.0
        self._last: float | None = None  # when the estimate's latest sample came
        self.samples = 0  # samples taken, stale ones included

    def add(self, nbytes: int, seconds: float, now: float) -> bool:
        """Fold in one transfer's sample; False (ignored) when it is too short to time."""
        if seconds < self.min_seconds or nbytes < max(self.min_bytes, 1):
            return False
        rate = nbytes / seconds
        if self.estimate(now) == 0.0:  # nothing yet, or nothing recent: start again
            self._rate = rate
        else:
            self._rate += self.weight * (rate - self._rate)
        self._last = now
        self.samples += 1
        return True

    def estimate(self, now: float) -> float:
        """Bytes/s; 0.0 before the first sample and once none came for ``stale_s``: a link no
        transfer used lately is unknown (the caller falls back to what it was configured
        to be, sends, and learns again — the only way to notice a link that recovered)."""
        if self._last is None or now - self._last > self.stale_s:
            return 0.0
        return self._rate
