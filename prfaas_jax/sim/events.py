"""The simulator's clock and its two kinds of server: `EventLoop`, `FifoServer`, `SharedServer`.

`EventLoop` is a heap of (time, sequence, callback, argument); the sequence number makes ties
fire in the order they were scheduled, so a run is deterministic.

`FifoServer` is one prefill instance: requests wait in arrival order and are served one at a
time, each for the service time it is given.

`SharedServer` serves every active job at once (processor sharing), each at `rate(n)` work units
per second when n jobs are active: the inter-cluster link (n concurrent transfers share its
capacity C, rate C/n bytes/s each) and a decode instance (each of its n running requests
advances one token per step, rate 1/step_s(n)). All jobs then progress alike, so one virtual
clock tracks them:

    V(t) = ∫ rate(n(s), s) ds        a job added at V₀ with work w finishes when V = V₀ + w

The next completion is the smallest V₀ + w; whenever n or the capacity changes, V is brought up
to date and that completion is rescheduled. Stale completion events carry an old version number
and are ignored.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable
from typing import Any

Callback = Callable[[Any], None]


class EventLoop:
    """Discrete-event clock: `schedule(at, callback, arg)`, `run()`, `stop()`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callback, Any]] = []
        self._seq = itertools.count()
        self._stopped = False

    def schedule(self, at: float, callback: Callback, arg: Any = None) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), callback, arg))

    def stop(self) -> None:
        """Ends `run` after the current event."""
        self._stopped = True

    def run(self) -> None:
        heap, pop = self._heap, heapq.heappop
        self._stopped = False
        while heap and not self._stopped:
            at, _, callback, arg = pop(heap)
            self.now = at
            callback(arg)


class FifoServer:
    """One server, one job at a time, first come first served; `started(job, service_s)` fires
    when a job begins (if given), `done(job)` when it ends."""

    def __init__(
        self,
        loop: EventLoop,
        done: Callback,
        started: Callable[[Any, float], None] | None = None,
    ) -> None:
        self.loop, self._done, self._started = loop, done, started
        self.waiting: collections.deque[tuple[Any, float]] = collections.deque()
        self.current: Any = None

    def __len__(self) -> int:
        return len(self.waiting) + (self.current is not None)

    def submit(self, job: Any, service_s: float) -> None:
        if self.current is None:
            self._start(job, service_s)
        else:
            self.waiting.append((job, service_s))

    def _start(self, job: Any, service_s: float) -> None:
        self.current = job
        self.loop.schedule(self.loop.now + service_s, self._finish, job)
        if self._started is not None:
            self._started(job, service_s)

    def _finish(self, job: Any) -> None:
        self.current = None
        if self.waiting:
            self._start(*self.waiting.popleft())
        self._done(job)


class SharedServer:
    """Processor sharing with a per-job rate `rate(n)`; `capacity` scales it (module docstring).

    `rate(n)` is the rate of one job when n are active, before scaling by `capacity`; the work
    served per second is `n · rate(n) · capacity`, which `served` integrates.
    """

    def __init__(
        self,
        loop: EventLoop,
        rate: Callable[[int], float],
        capacity: float = 1.0,
        max_jobs: int | None = None,
    ) -> None:
        if not capacity > 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.loop, self._rate, self.capacity, self.max_jobs = loop, rate, capacity, max_jobs
        self._virtual = 0.0  # V at `_updated`
        self._updated = 0.0
        self._jobs: list[tuple[float, int, Callback, Any]] = []  # (finish V, seq, done, arg)
        self.waiting: collections.deque[tuple[float, Callback, Any]] = collections.deque()
        self._seq = itertools.count()
        self._version = 0
        self._scheduled: tuple[float, float] | None = None  # (finish V, job rate) armed now
        self.served = 0.0  # work completed or in progress, integrated exactly

    @property
    def active(self) -> int:
        return len(self._jobs)

    def _job_rate(self) -> float:
        return self._rate(len(self._jobs)) * self.capacity if self._jobs else 0.0

    def advance(self) -> None:
        """Brings V and `served` up to the clock (idempotent)."""
        now = self.loop.now
        if self._jobs and now > self._updated:
            rate = self._job_rate()
            self._virtual += rate * (now - self._updated)
            self.served += rate * len(self._jobs) * (now - self._updated)
        self._updated = now

    def _arm(self) -> None:
        if not self._jobs:
            self._scheduled = None
            return
        target, rate = self._jobs[0][0], self._job_rate()
        if self._scheduled == (target, rate):
            return  # the armed completion is still right: same next job, same speed
        self._version += 1
        self._scheduled = (target, rate)
        at = self.loop.now + max(target - self._virtual, 0.0) / rate
        self.loop.schedule(at, self._complete, self._version)

    def submit(self, work: float, done: Callback, arg: Any) -> None:
        """Starts a job of `work` units now (or queues it when `max_jobs` are running)."""
        if self.max_jobs is not None and len(self._jobs) >= self.max_jobs:
            self.waiting.append((work, done, arg))
            return
        self.advance()
        heapq.heappush(self._jobs, (self._virtual + work, next(self._seq), done, arg))
        self._arm()

    def set_capacity(self, capacity: float) -> None:
        if not capacity > 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.advance()
        self.capacity = capacity
        self._arm()

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self.advance()
        self._scheduled = None
        finished = []
        # Jobs due within rounding of V finish together; floating point must not strand them.
        while self._jobs and self._jobs[0][0] <= self._virtual * (1 + 1e-12) + 1e-9:
            _, _, done, arg = heapq.heappop(self._jobs)
            finished.append((done, arg))
        while self.waiting and (self.max_jobs is None or len(self._jobs) < self.max_jobs):
            work, done, arg = self.waiting.popleft()
            heapq.heappush(self._jobs, (self._virtual + work, next(self._seq), done, arg))
        self._arm()
        for done, arg in finished:
            done(arg)
