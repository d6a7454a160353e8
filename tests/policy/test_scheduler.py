"""The dual-timescale scheduler (policy/scheduler.py) on literal numbers: when each timescale
measures, and how a role change hands over to the threshold controller.

Profiles: PrfaaS prefill 1 ms/token, PD prefill 2 ms/token, state 1 KiB/token, decode 8 slots at
10 ms/step, a 1 MB/s link. Traffic: 5 requests/s, uncached lengths cycling through 16, 32, …,
256 (uniform), 16 output tokens each. Thresholds on a 16-token grid up to 256. With t = 16·j,
p = (16 − j)/16 of the requests are offloaded; the link caps Θ_prfaas at
(1e6 / 2^20) / (8(j + 17) / 1024) = 122.07 / (j + 17) req/s (below the 125 / (j + 17) its prefill
allows), a PD prefill node serves 1 / (0.002 · 8(j + 1)) = 62.5 / (j + 1) req/s, a decode node
8 / (0.01 · 16) = 50 req/s.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from toy_profiles import PROFILES

from prfaas_jax.policy.live_model import ClusterShape, TrafficWindow
from prfaas_jax.policy.rebalancer import Rebalancer, RebalancerConfig, StageObservation
from prfaas_jax.policy.routing import Role
from prfaas_jax.policy.scheduler import Scheduler
from prfaas_jax.policy.threshold_controller import (
    ControllerConfig,
    LinkObservation,
    threshold_candidates,
)

CONTROLLER = ControllerConfig(candidates=tuple(threshold_candidates(16, 256)))
REBALANCER = RebalancerConfig(cooldown_s=10.0, consecutive=2)
TWO_DECODERS = ClusterShape(num_prfaas=1, num_pd_prefill=1, num_pd_decode=2)
TWO_PREFILLERS = ClusterShape(num_prfaas=1, num_pd_prefill=2, num_pd_decode=1)


def traffic_until(now: float) -> TrafficWindow:
    """A window of the last 64 requests (four whole cycles of the lengths) arriving at 5/s up
    to `now`."""
    window = TrafficWindow(64)
    for i in range(int(now * 5) - 63, int(now * 5) + 1):
        window.record(i / 5, 16 * (1 + i % 16), 16)
    return window


def scheduler(window: TrafficWindow, *, now: float, controller=CONTROLLER) -> Scheduler:
    return Scheduler.build(
        PROFILES,
        window,
        TWO_DECODERS,
        64.0,
        controller=controller,
        rebalancer=REBALANCER,
        rebalance_period_s=5.0,
        now=now,
    )


def stages(
    now: float, shape: ClusterShape, threshold: float, *, queue: int
) -> Callable[[], StageObservation]:
    """Measures `queue` requests at PD prefill and one decode slot of the shape's in use."""
    slots = shape.num_pd_decode * PROFILES.decode_max_batch_size
    return lambda: StageObservation(now, shape, threshold, 1e6, queue, 1, slots)


def test_each_timescale_measures_only_when_it_acts():
    window = traffic_until(100.0)
    sched = scheduler(window, now=100.0, controller=None)
    assert sched.controller is None and sched.active

    def never() -> LinkObservation:
        raise AssertionError("the link is measured without a controller")

    measured = []

    def measure(now: float) -> StageObservation:
        measured.append(now)
        return stages(now, TWO_DECODERS, 64.0, queue=0)()

    for tick in range(21):  # a 0.5 s control period from 100 s to 110 s
        now = 100.0 + 0.5 * tick
        assert sched.observe_link(never) is None
        assert sched.observe_stages(now, lambda now=now: measure(now)) is None
    assert measured == [105.0, 110.0]  # every 5 s from the start, not at it


def test_a_link_with_no_capacity_measured_is_not_observed():
    sched = scheduler(traffic_until(10.0), now=10.0)
    assert sched.observe_link(lambda: LinkObservation(10.0, 0, 0.0, 0)) is None
    assert sched.controller is not None and sched.controller.history == []
    with pytest.raises(ValueError, match="capacity must be positive"):
        sched.controller.observe(LinkObservation(10.0, 0, 0.0, 0))  # what the guard spares


def test_a_role_change_re_solves_t_for_the_new_shape():
    window = traffic_until(10.0)
    sched = scheduler(window, now=10.0)
    # Two decode nodes: Λ_max = min(Θ_prfaas / p, Θ_pd-p / (1 − p), 100) is largest at j = 9:
    # min(122.07 / 26 / (7/16), 62.5 / 10 / (9/16)) = min(10.73, 11.11), so t = 144.
    first = sched.observe_link(lambda: LinkObservation(10.0, 0, 1e6, 0))
    assert first is not None and (first.reason, first.previous, first.threshold) == (
        "periodic",
        64.0,
        144.0,
    )
    # At t = 144 the stages are (4.70 + 6.25) / 100 = 0.11 of decode: prefill-bound, and the
    # PD prefill queue (3 per node) confirms it; two agreeing periods move a decode node.
    assert sched.observe_stages(15.0, stages(15.0, TWO_DECODERS, 144.0, queue=3)) is None
    change = sched.observe_stages(20.0, stages(20.0, TWO_DECODERS, 144.0, queue=3))
    assert change is not None
    assert (change.from_role, change.to_role) == (Role.PD_DECODE, Role.PD_PREFILL)
    assert change.ratio == pytest.approx((122.07 / 26 + 6.25) / 100, rel=1e-3)
    assert change.shape_after == TWO_PREFILLERS
    assert sched.rebalancer is not None and sched.rebalancer.switching
    # The node switched. Two PD prefill nodes serve 125 / (j + 1): j = 11 now wins,
    # min(122.07 / 28 / (5/16), 125 / 12 / (11/16), 50) = min(13.95, 15.15), over j = 12's
    # min(16.84, 125 / 13 / (12/16) = 12.82): t rises to 176.
    update = sched.finished(23.0, TWO_PREFILLERS)
    assert update is not None and (update.reason, update.previous, update.threshold) == (
        "rebalance",
        144.0,
        176.0,
    )
    assert update.at == 23.0 and not sched.rebalancer.switching
    assert [u.threshold for u in sched.controller.history] == [144.0, 176.0]
    # The cooldown (10 s) runs from the switch: the pressure persists, but nothing moves.
    for now in (25.0, 30.0):
        assert sched.observe_stages(now, stages(now, TWO_PREFILLERS, 176.0, queue=9)) is None


def test_an_abandoned_change_keeps_t_and_starts_the_cooldown():
    sched = scheduler(traffic_until(10.0), now=10.0)
    assert sched.observe_link(lambda: LinkObservation(10.0, 0, 1e6, 0)) is not None  # t = 144
    for now in (15.0, 20.0):
        change = sched.observe_stages(now, stages(now, TWO_DECODERS, 144.0, queue=3))
    assert change is not None
    assert sched.finished(21.0, None) is None  # no node drained in time: t stays
    assert sched.controller is not None and len(sched.controller.history) == 1
    # Proposed again once the cooldown is over (at 31 s) and two periods agree.
    proposed = [
        now
        for now in (25.0, 30.0, 35.0, 40.0)
        if sched.observe_stages(now, stages(now, TWO_DECODERS, 144.0, queue=3))
    ]
    assert proposed == [40.0]


def test_either_timescale_may_be_off():
    window = traffic_until(10.0)
    off = Scheduler.build(
        PROFILES,
        window,
        TWO_DECODERS,
        64.0,
        controller=None,
        rebalancer=None,
        rebalance_period_s=5.0,
        now=0.0,
    )
    assert not off.active and off.controller is None and off.rebalancer is None
    assert off.observe_stages(100.0, stages(100.0, TWO_DECODERS, 64.0, queue=9)) is None
    with pytest.raises(RuntimeError):
        off.finished(100.0, TWO_PREFILLERS)
    only_t = Scheduler(None, None, rebalance_period_s=0.0, now=0.0)  # no period to check
    assert not only_t.active
    with pytest.raises(ValueError, match="rebalance_period_s"):
        Scheduler(None, Rebalancer(REBALANCER, PROFILES, window), rebalance_period_s=0.0, now=0.0)
