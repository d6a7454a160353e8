"""The emulated inter-cluster link: `LinkShaper`, a token bucket in the sender.

Also exposes `LinkProfile` (bandwidth, latency, burst, fluctuation schedule).

The PrfaaS → PD path is a long-haul Ethernet link; intra-cluster transfers are not shaped. The
bucket holds up to `burst_bytes` tokens and fills at the link rate

    rate(t) = bandwidth · factor(t)

where `bandwidth` is set at start (and by `set_link` at run time) and `factor(t)` follows the
schedule: piecewise constant, `factor = f_i` from `at_i` seconds after the shaper was built
until the next entry (1.0 before the first), repeating every `repeat_s` if that is positive.
A frame of n bytes takes n tokens; the bucket may go into debt, and the frame departs when the
debt is repaid, so over any interval T at most burst + ∫ rate dt bytes leave. Reservations are
made under a lock in call order, so concurrent transfers share the link first come, first
served. A frame *arrives* `latency_s` after it departs: `send` reserves every frame of a
transfer up front and yields each at its arrival time, so latency delays a transfer once
instead of once per frame; a sender whose frames appear over time `admit`s each as it is made
and `deliver`s it at its arrival time. The clock and sleep are injected (tests use a fake
clock).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkProfile:
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    burst_bytes: float = 16384.0
    schedule: tuple[tuple[float, float], ...] = ()  # (seconds after start, bandwidth factor)
    repeat_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.bandwidth_bytes_per_s > 0 and self.burst_bytes > 0 and self.latency_s >= 0):
            raise ValueError("a link needs bandwidth > 0, burst > 0 and latency ≥ 0")
        times = [at for at, _ in self.schedule]
        if times != sorted(times) or any(at < 0 or f <= 0 for at, f in self.schedule):
            raise ValueError("the schedule must be (at_s ≥ 0, factor > 0) pairs in time order")
        if self.repeat_s < 0 or (self.repeat_s and times and times[-1] >= self.repeat_s):
            raise ValueError("repeat_s must be 0 or exceed the last schedule time")


def schedule_factor(
    schedule: Sequence[tuple[float, float]], repeat_s: float, offset: float
) -> tuple[float, float]:
    """The bandwidth factor ``offset`` seconds into ``schedule`` (``(at_s, factor)`` pairs in
    time order, 1.0 before the first; the whole repeating every ``repeat_s`` if positive), and
    the next offset (> ``offset``) at which it may change; inf if never."""
    if not schedule:
        return 1.0, math.inf
    times = [at for at, _ in schedule]
    base = 0.0
    if repeat_s:
        cycles = math.floor(offset / repeat_s)
        base, offset = cycles * repeat_s, offset - cycles * repeat_s
    i = bisect.bisect_right(times, offset)
    factor = schedule[i - 1][1] if i > 0 else 1.0
    if i < len(times):
        return factor, base + times[i]
    if repeat_s:
        return factor, base + repeat_s
    return factor, math.inf


class LinkShaper:
    """A token-bucket shaper with a fluctuation schedule (module docstring)."""

    def __init__(
        self,
        profile: LinkProfile,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._profile, self._clock, self._sleep = profile, clock, sleep
        self._bandwidth, self._latency = profile.bandwidth_bytes_per_s, profile.latency_s
        self._start = clock()
        self._lock = threading.Lock()
        self._tokens = float(profile.burst_bytes)
        self._filled_at = self._start
        self._sent_bytes = 0
        self._sent_frames = 0

    # --- the schedule ---------------------------------------------------------------------

    def _factor_and_next(self, t: float) -> tuple[float, float]:
        """factor(t) and the next time (> t) it may change; inf if never."""
        profile = self._profile
        factor, next_offset = schedule_factor(profile.schedule, profile.repeat_s, t - self._start)
        return factor, self._start + next_offset

    def rate(self, t: float | None = None) -> float:
        """The link rate in bytes/s at time t (default: now)."""
        return self._bandwidth * self._factor_and_next(self._clock() if t is None else t)[0]

    @property
    def latency_s(self) -> float:
        return self._latency

    def _fill(self, now: float) -> None:
        t = self._filled_at
        while t < now:
            factor, change = self._factor_and_next(t)
            end = min(change, now)
            self._tokens += self._bandwidth * factor * (end - t)
            t = end
        self._tokens = min(self._tokens, self._profile.burst_bytes)
        self._filled_at = max(self._filled_at, now)

    def _repaid_at(self, now: float, debt: float) -> float:
        """When `debt` tokens will have accrued after `now`."""
        t = now
        while debt > 0:
            factor, change = self._factor_and_next(t)
            rate = self._bandwidth * factor
            if math.isinf(change) or rate * (change - t) >= debt:
                return t + debt / rate
            debt -= rate * (change - t)
            t = change
        return t

    # --- sending --------------------------------------------------------------------------

    def set_link(self, bandwidth_bytes_per_s: float, latency_s: float) -> None:
        """New base bandwidth and latency from now on (the schedule's factors still apply)."""
        if not (bandwidth_bytes_per_s > 0 and latency_s >= 0):
            raise ValueError("a link needs bandwidth > 0 and latency ≥ 0")
        with self._lock:
            self._fill(self._clock())
            self._bandwidth, self._latency = bandwidth_bytes_per_s, latency_s

    def reserve(self, nbytes: int) -> float:
        """Take `nbytes` tokens; returns when the frame may depart (now, or when debt is repaid)."""
        with self._lock:
            now = self._clock()
            self._fill(now)
            self._tokens -= nbytes
            return now if self._tokens >= 0 else self._repaid_at(now, -self._tokens)

    def admit(self, nbytes: int) -> float:
        """Queue a frame of `nbytes` on the link now; returns its arrival time (`deliver` it then).

        For frames produced over time (a state streamed while it is prefilled): each takes its
        place on the link when it exists, and latency still delays the stream only once.
        """
        return self.reserve(nbytes) + self._latency

    def deliver(self, frame: bytes, arrival: float) -> bytes:
        """`frame` once its `arrival` time has come (sleeps until then), counted as sent."""
        wait = arrival - self._clock()
        if wait > 0:
            self._sleep(wait)
        with self._lock:
            self._sent_bytes += len(frame)
            self._sent_frames += 1
        return frame

    def send(self, frames: Sequence[bytes]) -> Iterator[bytes]:
        """Yield `frames`, each at its arrival time through the link (all admitted up front)."""
        arrivals = [self.admit(len(frame)) for frame in frames]
        for frame, arrival in zip(frames, arrivals, strict=True):
            yield self.deliver(frame, arrival)

    @property
    def sent_bytes(self) -> int:
        """Bytes delivered so far (counted as each frame arrives)."""
        with self._lock:
            return self._sent_bytes

    @property
    def sent_frames(self) -> int:
        with self._lock:
            return self._sent_frames
