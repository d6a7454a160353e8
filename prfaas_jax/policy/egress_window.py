"""A link's egress rate from its cumulative byte counter: `EgressWindow`.

The threshold controller and the adaptive wire precision both measure egress utilisation this
way: the counter is sampled every control period, and the rate is the bytes between the oldest
and the newest sample within ``window_s``. A counter that goes back (a worker restarted and its
counter began again) starts the window afresh.
"""

from __future__ import annotations

import collections


class EgressWindow:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, egress_bytes: int) -> None:
        """One sample of the cumulative counter at ``now``."""
        if self._samples and egress_bytes < self._samples[-1][1]:
            self._samples.clear()  # a worker restarted: its counter began again
        self._samples.append((now, egress_bytes))
        while now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def rate(self) -> float:
        """Bytes/s over the window (0 before two samples)."""
        if len(self._samples) < 2:
            return 0.0
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
