"""The short-timescale controller and the threshold solve, on literal numbers.

Profiles: PrfaaS prefill 1 ms/token, PD prefill 2 ms/token, state 1 KiB/token, decode 8 slots
at 10 ms/step. Traffic: 5 requests/s, uncached lengths cycling through 16, 32, …, 256, 16
output tokens each. Thresholds on a 16-token grid up to 256.
"""

from __future__ import annotations

import math

import pytest
from toy_profiles import PROFILES

from prfaas_jax.policy.live_model import (
    ClusterShape,
    TrafficWindow,
    live_model,
    solve_threshold,
)
from prfaas_jax.policy.threshold_controller import (
    ControllerConfig,
    LinkObservation,
    ThresholdController,
    threshold_candidates,
)

SHAPE = ClusterShape(num_prfaas=1, num_pd_prefill=1, num_pd_decode=1)
CANDIDATES = tuple(threshold_candidates(16, 256))


class Traffic:
    """Feeds a window at 5 requests/s from t = −10 s up to a given time. The window holds 64
    requests, four whole cycles of the 16 lengths, so its distribution never changes."""

    def __init__(self) -> None:
        self.window = TrafficWindow(64)
        self.count = 0

    def until(self, now: float) -> None:
        while -10.0 + self.count * 0.2 <= now:
            self.window.record(-10.0 + self.count * 0.2, 16 * (1 + self.count % 16), 16)
            self.count += 1


def test_candidates():
    assert threshold_candidates(16, 64) == (16.0, 32.0, 48.0, 64.0)
    with pytest.raises(ValueError):
        threshold_candidates(0, 64)


def test_solve_balances_the_prefill_stages_when_the_link_is_idle():
    window = TrafficWindow(16)
    for i in range(16):
        window.record(0.0, 16 * (i + 1), 16)
    model = live_model(PROFILES, SHAPE, window, egress_bytes_per_s=1e6)
    solution = solve_threshold(
        model, SHAPE, CANDIDATES, arrival_rate=0.0, egress_bytes_per_s=1e6, target_utilization=0.7
    )
    # t = 144: 7 of 16 lengths above (p = 0.4375), E[L | L > t] = 208, E[L | L ≤ t] = 80.
    # Θ_prfaas = min(1 / 0.208, (1e6 / 2^20) / (208 / 1024)) = min(4.81, 4.70) = 4.70 req/s;
    # Θ_pd-p = 1 / 0.160 = 6.25; Λ_max = min(4.70 / 0.4375, 6.25 / 0.5625, 8 / 0.16) = 10.73.
    assert solution.threshold == 144
    assert solution.point.lambda_max == pytest.approx(10.73, abs=0.005)
    assert solution.meets_target and solution.demand_bytes_per_s == 0.0


def test_solve_respects_the_link_at_the_observed_rate():
    window = TrafficWindow(16)
    for i in range(16):
        window.record(0.0, 16 * (i + 1), 16)
    model = live_model(PROFILES, SHAPE, window, egress_bytes_per_s=2e5)
    solution = solve_threshold(
        model, SHAPE, CANDIDATES, arrival_rate=10.0, egress_bytes_per_s=2e5, target_utilization=0.7
    )
    # At 10 req/s only t = 256 (nothing offloaded) keeps demand under 0.7 · 200 KB/s.
    assert solution.threshold == 256 and solution.demand_bytes_per_s == 0.0
    # A cluster without PrfaaS instances routes everything locally.
    local = ClusterShape(0, 1, 1)
    solution = solve_threshold(
        live_model(PROFILES, local, window, 1.0),
        local,
        CANDIDATES,
        arrival_rate=10.0,
        egress_bytes_per_s=1.0,
        target_utilization=0.7,
    )
    assert solution.threshold == math.inf


def controller(traffic: Traffic, **overrides) -> ThresholdController:
    config = ControllerConfig(candidates=CANDIDATES, **overrides)
    return ThresholdController(config, PROFILES, SHAPE, traffic.window, threshold=64)


def test_a_10x_link_cut_raises_t_and_restoring_it_brings_t_back():
    traffic = Traffic()
    traffic.until(10.0)
    ctl = controller(traffic)
    first = ctl.observe(LinkObservation(10.0, 0, 1e6, 0))
    assert first is not None and (first.reason, first.previous, first.threshold) == (
        "periodic",
        64,
        144,
    )
    egress = 0
    for step in range(1, 4):  # 500 KB/s on a 1 MB/s link: nothing to do
        traffic.until(10.0 + 0.5 * step)
        egress += 250_000
        assert ctl.observe(LinkObservation(10.0 + 0.5 * step, egress, 1e6, 0)) is None
    assert ctl.utilization == pytest.approx(0.5)
    # The link drops to 100 KB/s: the very next period re-solves and raises t. Even t = 240
    # would send 5 req/s · 1/16 · 256 KiB = 80 KiB/s > 0.7 · 100 KB/s, so t = 256: no offload.
    traffic.until(12.0)
    egress += 50_000
    update = ctl.observe(LinkObservation(12.0, egress, 1e5, 3))
    assert update is not None and update.reason == "capacity"
    assert update.threshold == 256 > update.previous == 144
    for step in range(1, 5):  # the cut persists: t stays up
        traffic.until(12.0 + 0.5 * step)
        egress += 50_000
        assert ctl.observe(LinkObservation(12.0 + 0.5 * step, egress, 1e5, 0)) is None
    # Restored (after the dwell time): t comes back to where the traffic puts it.
    traffic.until(14.5)
    update = ctl.observe(LinkObservation(14.5, egress, 1e6, 0))
    assert update is not None and (update.reason, update.threshold) == ("capacity", 144)
    assert [u.threshold for u in ctl.history] == [144, 256, 144]


def test_hysteresis_lowering_waits_for_a_cool_link_and_the_dwell_time():
    traffic = Traffic()
    traffic.until(10.0)
    ctl = controller(traffic, min_dwell_s=5.0)
    ctl.observe(LinkObservation(10.0, 0, 1e6, 0))  # t = 144
    ctl.observe(LinkObservation(10.5, 0, 1e5, 0))  # cut: t = 256
    assert ctl.threshold == 256
    # Capacity back 1 s later: the solve says 144, but the dwell time (5 s) is not over.
    assert ctl.observe(LinkObservation(11.5, 0, 1e6, 0)) is None
    assert ctl.threshold == 256
    # The capacity trigger stays armed, so the next period after the dwell time lowers t.
    traffic.until(15.5)
    update = ctl.observe(LinkObservation(15.5, 0, 1e6, 0))
    assert update is not None and update.threshold == 144


def test_a_small_change_is_ignored():
    traffic = Traffic()
    traffic.until(10.0)
    ctl = controller(traffic, hysteresis=0.5)
    # 64 → 144 is a 125 % change; then a solve within 50 % of 144 is ignored.
    ctl.observe(LinkObservation(10.0, 0, 1e6, 0))
    assert ctl.threshold == 144
    traffic.until(11.0)
    assert ctl.observe(LinkObservation(11.0, 0, 0.9e6, 0)) is None  # −10 %: below the trigger
    assert ctl.observe(LinkObservation(11.5, 0, 0.7e6, 0)) is None  # re-solved, < 50 % change
    assert ctl.threshold == 144


def test_utilization_and_queue_triggers():
    traffic = Traffic()
    traffic.until(10.0)
    ctl = controller(traffic, resolve_every_s=1000.0)
    ctl.observe(LinkObservation(10.0, 0, 1e6, 0))
    t = ctl.threshold
    # 900 KB/s on a 1 MB/s link: u = 0.9 ≥ 0.85 re-solves; a burst of 100 requests in the
    # last second lifts the observed rate, so the solve moves t up.
    for i in range(100):
        traffic.window.record(10.0 + i * 0.01, 16 * (1 + i % 16), 16)
    update = ctl.observe(LinkObservation(11.0, 900_000, 1e6, 0))
    assert update is not None and update.reason == "utilization" and update.threshold > t
    assert ctl.utilization == pytest.approx(0.9)
    # A PrfaaS queue surge also re-solves (here it confirms t: no update).
    assert ctl.observe(LinkObservation(11.5, 900_000, 1e6, 10)) is None


def test_nothing_happens_before_min_samples():
    window = TrafficWindow(16)
    ctl = ThresholdController(
        ControllerConfig(candidates=CANDIDATES), PROFILES, SHAPE, window, threshold=64
    )
    window.record(0.0, 100, 16)
    assert ctl.observe(LinkObservation(1.0, 0, 1e6, 99)) is None
    assert ctl.threshold == 64


def test_config_is_validated():
    with pytest.raises(ValueError):
        ControllerConfig(candidates=())
    with pytest.raises(ValueError):
        ControllerConfig(candidates=CANDIDATES, low_utilization=0.9, high_utilization=0.8)
    with pytest.raises(ValueError):
        ThresholdController(
            ControllerConfig(candidates=CANDIDATES), PROFILES, SHAPE, TrafficWindow(4), 64
        ).observe(LinkObservation(0.0, 0, 0.0, 0))


def test_tcp_loss_on_the_link_raises_t_as_a_narrower_link_would():
    """Retransmitted / sent segments ≥ congestion_loss re-solves ("congestion") for
    congestion_backoff of the capacity: t lands where a clean link of that capacity puts it."""
    traffic = Traffic()
    traffic.until(10.0)
    ctl = controller(traffic, resolve_every_s=1000.0, congestion_backoff=0.5)
    ctl.observe(LinkObservation(10.0, 0, 1e6, 0, 1_000, 0))
    assert ctl.threshold == 144
    # 1 % loss: below the default 2 %, nothing happens.
    assert ctl.observe(LinkObservation(10.5, 0, 1e6, 0, 2_000, 10)) is None
    assert ctl.loss == pytest.approx(10 / 1_000)
    # 40 more retransmissions in the next 1,000 segments: 50 / 2,000 = 2.5 % over the window.
    update = ctl.observe(LinkObservation(11.0, 0, 1e6, 0, 3_000, 50))
    assert update is not None and update.reason == "congestion"
    narrower = controller(traffic, resolve_every_s=1000.0)
    narrower.observe(LinkObservation(11.0, 0, 0.5e6, 0))
    assert update.threshold == narrower.threshold > 144
    # Counters that go backwards (a restarted worker) start the window again: no loss yet.
    ctl.observe(LinkObservation(11.5, 0, 1e6, 0, 10, 10))
    assert ctl.loss == 0.0
