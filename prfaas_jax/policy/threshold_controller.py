"""Short-timescale threshold control (arXiv 2604.15039 §3.4.3): `ThresholdController`.

Also exposes `ControllerConfig`, `LinkObservation` (what the router measures each control
period) and `ThresholdUpdate` (a change of t and why).

Each period the router reports the PrfaaS link's cumulative egress bytes, its capacity (learned
from the transfers: policy/link_capacity.py), the PrfaaS queue depth and, where the kernel counts
the link's TCP alone (a namespace of its own), its sent and retransmitted segments. The
controller keeps egress utilisation u = (egress rate over the last `utilization_window_s`) /
capacity and the TCP loss (retransmitted / sent segments over the same window), and re-solves t
(`live_model.solve_threshold`: the throughput model on the recent uncached-length distribution,
with the link's capacity and the observed arrival rate) when, in this order,

    |capacity / capacity at last solve − 1| ≥ capacity_change                ("capacity")
    TCP loss ≥ congestion_loss                  the path drops segments        ("congestion")
    u ≥ high_utilization                       the link is close to its cap   ("utilization")
    PrfaaS queue ≥ queue_surge                  requests pile up remotely      ("queue_surge")
    resolve_every_s since the last solve        drift of the length mix        ("periodic")

Hysteresis keeps t from flapping: a solution is applied only if it moves t by at least
`hysteresis` (relative); raising t is allowed at once, but lowering it — which sends more bytes
over the link — only when the link is cool (u ≤ low_utilization) or its capacity grew, and not
within `min_dwell_s` of the previous change. A congested link (TCP loses segments: queues
overflow somewhere on the path) is solved for as if it had `congestion_backoff` of its capacity,
so t rises before the goodput drop shows in the learned capacity. `resolve` forces a re-solve
for a new cluster shape (the long-timescale rebalancer calls it after a role change).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from prfaas_jax.policy.egress_window import EgressWindow
from prfaas_jax.policy.live_model import (
    ClusterShape,
    LiveProfiles,
    TrafficWindow,
    live_model,
    solve_threshold,
)


@dataclass(frozen=True)
class ControllerConfig:
    candidates: tuple[float, ...]  # thresholds the search may pick (tokens)
    high_utilization: float = 0.85
    low_utilization: float = 0.5
    target_utilization: float = 0.7  # the link load a solution must predict at most
    queue_surge: int = 4
    capacity_change: float = 0.2
    hysteresis: float = 0.1
    min_dwell_s: float = 2.0
    resolve_every_s: float = 30.0
    utilization_window_s: float = 2.0
    rate_horizon_s: float = 10.0  # arrival rate Λ_obs is measured over this
    congestion_loss: float = 0.02  # retransmitted / sent TCP segments that mean congestion
    congestion_backoff: float = 0.8  # the capacity fraction a congested link is solved for
    min_samples: int = 8  # requests in the window before the first solve

    def __post_init__(self) -> None:
        if not self.candidates or sorted(self.candidates) != list(self.candidates):
            raise ValueError("candidates must be a non-empty increasing sequence of thresholds")
        if not 0 < self.low_utilization < self.high_utilization:
            raise ValueError("need 0 < low_utilization < high_utilization")
        if not 0 < self.target_utilization <= self.high_utilization:
            raise ValueError("need 0 < target_utilization ≤ high_utilization")
        if self.queue_surge < 1 or self.min_samples < 1:
            raise ValueError("queue_surge and min_samples must be ≥ 1")
        if min(self.hysteresis, self.min_dwell_s, self.capacity_change) < 0:
            raise ValueError("hysteresis, min_dwell_s and capacity_change must be ≥ 0")
        if not (self.resolve_every_s > 0 and self.utilization_window_s > 0):
            raise ValueError("resolve_every_s and utilization_window_s must be positive")
        if not self.rate_horizon_s > 0:
            raise ValueError("rate_horizon_s must be positive")
        if not (0 < self.congestion_loss <= 1 and 0 < self.congestion_backoff <= 1):
            raise ValueError("need 0 < congestion_loss ≤ 1 and 0 < congestion_backoff ≤ 1")


@dataclass(frozen=True)
class LinkObservation:
    now: float
    egress_bytes: int  # cumulative bytes the PrfaaS cluster has sent over the link
    capacity_bytes_per_s: float  # what the link carries now (learned from transfers)
    prfaas_queue_depth: int
    out_segments: int = 0  # cumulative TCP segments sent on the link (0: not counted)
    retransmitted_segments: int = 0  # cumulative, of those


@dataclass(frozen=True)
class ThresholdUpdate:
    threshold: float
    previous: float
    reason: str  # "capacity", "congestion", "utilization", "queue_surge", "periodic", "rebalance"
    utilization: float  # measured when the decision was made
    predicted_bytes_per_s: float  # link demand the new t predicts at the observed arrival rate
    at: float


class ThresholdController:
    """Keeps t where the throughput model puts it for the live link and traffic."""

    def __init__(
        self,
        config: ControllerConfig,
        profiles: LiveProfiles,
        shape: ClusterShape,
        traffic: TrafficWindow,
        threshold: float,
    ) -> None:
        if config.rate_horizon_s > traffic.rate_memory_s:
            raise ValueError(
                f"rate_horizon_s {config.rate_horizon_s} exceeds the traffic window's memory "
                f"of {traffic.rate_memory_s} s"
            )
        self.config, self.profiles, self.shape, self.traffic = config, profiles, shape, traffic
        self._threshold = float(threshold)
        self._egress = EgressWindow(config.utilization_window_s)
        self._capacity = 0.0
        self._solved_capacity: float | None = None
        self._last_solve = -math.inf
        self._last_change = -math.inf
        self._utilization = 0.0
        self._segments: collections.deque[tuple[float, int, int]] = collections.deque()
        self._loss = 0.0
        self.history: list[ThresholdUpdate] = []

    @property
    def threshold(self) -> float:
        return self._threshold

    @property
    def utilization(self) -> float:
        """Egress rate over capacity at the last observation."""
        return self._utilization

    @property
    def loss(self) -> float:
        """Retransmitted over sent TCP segments in the utilisation window (0 when not counted)."""
        return self._loss

    def egress_rate(self) -> float:
        """Bytes/s over the utilisation window (0 before two observations)."""
        return self._egress.rate()

    def observe(self, obs: LinkObservation) -> ThresholdUpdate | None:
        """Fold in one period's measurement; returns the change of t it caused, if any."""
        if obs.capacity_bytes_per_s <= 0:
            raise ValueError(f"link capacity must be positive, got {obs.capacity_bytes_per_s}")
        self._egress.add(obs.now, obs.egress_bytes)
        self._capacity = obs.capacity_bytes_per_s
        self._utilization = self.egress_rate() / obs.capacity_bytes_per_s
        self._loss = self._window_loss(obs)
        reason = self._trigger(obs)
        if reason is None or len(self.traffic) < self.config.min_samples:
            return None
        return self._solve(obs.now, reason)

    def _window_loss(self, obs: LinkObservation) -> float:
        segments = self._segments
        if segments and obs.out_segments < segments[-1][1]:
            segments.clear()  # a worker restarted: its counters began again
        segments.append((obs.now, obs.out_segments, obs.retransmitted_segments))
        while obs.now - segments[0][0] > self.config.utilization_window_s:
            segments.popleft()
        (_, out0, re0), (_, out1, re1) = segments[0], segments[-1]
        return (re1 - re0) / (out1 - out0) if out1 > out0 else 0.0

    def _trigger(self, obs: LinkObservation) -> str | None:
        cfg = self.config
        solved = self._solved_capacity
        if solved is not None and abs(obs.capacity_bytes_per_s / solved - 1) >= cfg.capacity_change:
            return "capacity"
        if self._loss >= cfg.congestion_loss:
            return "congestion"
        if self._utilization >= cfg.high_utilization:
            return "utilization"
        if obs.prfaas_queue_depth >= cfg.queue_surge:
            return "queue_surge"
        if solved is None or obs.now - self._last_solve >= cfg.resolve_every_s:
            return "periodic"
        return None

    def resolve(self, now: float, shape: ClusterShape) -> ThresholdUpdate | None:
        """Re-solve t for a new cluster shape (after a role change); hysteresis still applies."""
        self.shape = shape
        if self._capacity <= 0 or len(self.traffic) < self.config.min_samples:
            return None
        return self._solve(now, "rebalance")

    def _solve(self, now: float, reason: str) -> ThresholdUpdate | None:
        cfg = self.config
        grew = self._solved_capacity is not None and self._capacity > self._solved_capacity
        self._last_solve = now
        if self.shape.num_prfaas == 0:
            self._solved_capacity = self._capacity
            return None
        capacity = self._capacity
        if self._loss >= cfg.congestion_loss:
            capacity *= cfg.congestion_backoff
        model = live_model(self.profiles, self.shape, self.traffic, capacity)
        solution = solve_threshold(
            model,
            self.shape,
            self.config.candidates,
            arrival_rate=self.traffic.arrival_rate(now, cfg.rate_horizon_s),
            egress_bytes_per_s=capacity,
            target_utilization=cfg.target_utilization,
        )
        new, old = solution.threshold, self._threshold
        if abs(new - old) < cfg.hysteresis * max(abs(old), 1.0):
            self._solved_capacity = self._capacity
            return None
        if new < old:
            cool = self._utilization <= cfg.low_utilization or grew
            if not cool or now - self._last_change < cfg.min_dwell_s:
                # Not now; the capacity trigger (if that was the cause) stays armed.
                return None
        self._solved_capacity = self._capacity
        update = ThresholdUpdate(
            new, old, reason, self._utilization, solution.demand_bytes_per_s, now
        )
        self._threshold, self._last_change = new, now
        self.history.append(update)
        return update


def threshold_candidates(step: int, max_len: int) -> Sequence[float]:
    """Every multiple of `step` tokens from `step` to `max_len` (a candidate grid)."""
    if step < 1 or max_len < step:
        raise ValueError(f"need 1 ≤ step ≤ max_len, got step {step}, max_len {max_len}")
    return tuple(float(t) for t in range(step, max_len + 1, step))
