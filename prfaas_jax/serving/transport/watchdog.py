"""Stall detection for streaming calls: `Watchdog` and the `Watch` it hands out.

A worker that dies is noticed at once (its connections reset), but one that hangs — a stopped
process, a link that black-holes packets, a transfer stuck behind a wedged peer — leaves its
calls open until their deadline, which must be generous enough for the longest prefill. The
router therefore also bounds the time *between* signs of progress: each attempt's decode stream
is watched, every message it delivers counts as progress, and a call silent for longer than its
limit is cancelled (`Watch.fired` then tells the caller why its call ended). One daemon thread
checks every watched call a few times per second.

A call may be silent for a good reason: a decode stream says nothing while its prompt is
prefilled elsewhere, which can take longer than any sensible stall limit. Such a watch is given
`alive`, which returns when the work behind the silence last showed it is still under way (the
workers answering while the prefill call is outstanding), or None once there is no such work; the
silence then counts from the later of that and the last `touch`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc


class Watch:
    def __init__(
        self,
        call: grpc.Future,
        limit_s: float,
        clock: Callable[[], float],
        alive: Callable[[], float | None] | None = None,
    ) -> None:
        self.call, self.limit_s, self._clock, self._alive = call, limit_s, clock, alive
        self.last = clock()
        self.fired = False

    def touch(self) -> None:
        """Progress: the call delivered something."""
        self.last = self._clock()

    def overdue(self, now: float) -> bool:
        last = self.last
        if self._alive is not None:
            seen = self._alive()
            if seen is not None:
                last = max(last, seen)
        return now - last > self.limit_s


class Watchdog:
    def __init__(self, period_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s, self._clock = period_s, clock
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(
        self,
        call: grpc.Future,
        limit_s: float,
        alive: Callable[[], float | None] | None = None,
    ) -> Watch:
        """Cancel `call` if it goes `limit_s` seconds without a `touch` (or, with `alive`, a
        sign of life on this watchdog's clock); `close` when done."""
        watch = Watch(call, limit_s, self._clock, alive)
        with self._lock:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
                self._thread.start()
        return watch

    def close(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def check(self) -> int:
        """Cancel every overdue call now; returns how many."""
        now = self._clock()
        with self._lock:
            overdue = [w for w in self._watches if w.overdue(now)]
            for watch in overdue:
                watch.fired = True
                self._watches.discard(watch)
        for watch in overdue:
            watch.call.cancel()
        return len(overdue)

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            self.check()
