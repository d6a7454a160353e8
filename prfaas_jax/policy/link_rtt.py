"""The inter-cluster link's round trip, measured by TCP on the transfers' own connections:
`RttMeter`.

Each delivered transfer that used the data path (serving/transfer/data_path.py) brings the
smoothed round trip the kernel measured on its connection (`TCP_INFO`'s `tcpi_rtt`): what the
link's segments actually took, queueing in the shaper and the delay line included — never what
an emulator was configured with. `RttMeter` keeps an exponentially weighted mean of those
samples (weight ¼ by default, close to TCP's own smoothing over a handful of transfers) and
forgets it when no sample came for `stale_s`, as `CapacityMeter` does: the router then falls
back to the configured latency until a transfer measures the link again. Pure: the caller passes
the time.
"""

from __future__ import annotations


class RttMeter:
    """A smoothed round trip from per-transfer samples; times are the caller's clock."""

    def __init__(self, *, weight: float = 0.25, stale_s: float = 30.0) -> None:
        if not 0 < weight <= 1 or stale_s <= 0:
            raise ValueError("weight must be in (0, 1] and stale_s positive")
        self.weight, self.stale_s = weight, stale_s
        self._rtt = 0.0
        self._last: float | None = None
        self.samples = 0

    def add(self, rtt_s: float, now: float) -> bool:
        """Fold in one transfer's round trip; False (ignored) for 0.0, an unmeasured one."""
        if rtt_s <= 0:
            return False
        if self.estimate(now) == 0.0:
            self._rtt = rtt_s
        else:
            self._rtt += self.weight * (rtt_s - self._rtt)
        self._last, self.samples = now, self.samples + 1
        return True

    def estimate(self, now: float) -> float:
        """Seconds; 0.0 before the first sample and once none came for ``stale_s``."""
        if self._last is None or now - self._last > self.stale_s:
            return 0.0
        return self._rtt
