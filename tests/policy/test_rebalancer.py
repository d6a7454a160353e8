"""The long-timescale rebalancer on literal numbers.

Profiles: PD prefill 4 ms/token, PrfaaS prefill 1.6 ms/token, state 1 KiB/token, decode 4 slots
at 20 ms/step; t = 64, so the prompts below (48 and 16 tokens) all stay in the PD cluster.
"""

from __future__ import annotations

import pytest

from prfaas_jax.policy.live_model import ClusterShape, LiveProfiles, TrafficWindow
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.rebalancer import Rebalancer, RebalancerConfig, StageObservation
from prfaas_jax.policy.routing import Role

PROFILES = LiveProfiles(
    prfaas_prefill_s=Profile.polynomial([0.0, 0.0016]),
    pd_prefill_s=Profile.polynomial([0.0, 0.004]),
    kv_size_mib=Profile.polynomial([0.0, 1 / 1024]),
    decode_max_batch_size=4,
    decode_step_s=0.02,
)
START = ClusterShape(num_prfaas=1, num_pd_prefill=1, num_pd_decode=2)
CONFIG = RebalancerConfig(cooldown_s=10.0, consecutive=2)


def window(prompt_len: int, output_len: int) -> TrafficWindow:
    traffic = TrafficWindow(16)
    for i in range(16):
        traffic.record(i * 0.1, prompt_len, output_len)
    return traffic


def observe(
    rebalancer: Rebalancer, now: float, shape: ClusterShape, *, queue: int, assigned: int
) -> object:
    slots = shape.num_pd_decode * PROFILES.decode_max_batch_size
    return rebalancer.observe(StageObservation(now, shape, 64.0, 1e6, queue, assigned, slots))


def test_prefill_heavy_moves_a_decode_node_to_prefill():
    # 48-token prompts, 2 output tokens: Θ_pd-p = 1 / 0.192 = 5.21 req/s against
    # Θ_pd-d = 2 · 4 / (0.02 · 2) = 200 req/s: r = 0.026, far below 1/2.
    rebalancer = Rebalancer(CONFIG, PROFILES, window(48, 2))
    assert observe(rebalancer, 0.0, START, queue=5, assigned=1) is None  # 1 of 2 agreeing
    change = observe(rebalancer, 1.0, START, queue=5, assigned=1)
    assert change is not None
    assert (change.from_role, change.to_role) == (Role.PD_DECODE, Role.PD_PREFILL)
    assert change.ratio == pytest.approx(5.208 / 200, rel=1e-3)
    # After: Θ_pd-p = 10.4, Θ_pd-d = 100, r = 0.104: closer to 1.
    assert change.ratio_after == pytest.approx(10.417 / 100, rel=1e-3)
    assert change.shape_after == ClusterShape(1, 2, 1)
    # One switch at a time, then a cooldown.
    assert observe(rebalancer, 2.0, START, queue=5, assigned=1) is None
    rebalancer.finish(3.0)
    assert observe(rebalancer, 12.0, change.shape_after, queue=9, assigned=0) is None
    assert observe(rebalancer, 13.5, change.shape_after, queue=9, assigned=0) is None  # streak 1


def test_decode_heavy_moves_it_back():
    # 16-token prompts, 60 output tokens on (1, 2, 1): Θ_pd-p = 2 / 0.064 = 31.25 against
    # Θ_pd-d = 4 / (0.02 · 60) = 3.33: r = 9.4 > 2. Moving back gives r = 15.6 / 6.67 = 2.34.
    rebalancer = Rebalancer(CONFIG, PROFILES, window(16, 60))
    shape = ClusterShape(1, 2, 1)
    assert observe(rebalancer, 0.0, shape, queue=0, assigned=4) is None
    change = observe(rebalancer, 1.0, shape, queue=0, assigned=4)
    assert change is not None
    assert (change.from_role, change.to_role) == (Role.PD_PREFILL, Role.PD_DECODE)
    assert change.ratio == pytest.approx(31.25 / 3.333, rel=1e-3)
    assert change.ratio_after == pytest.approx(15.625 / 6.667, rel=1e-3)
    assert change.shape_after == START


def test_queues_must_confirm_what_the_model_says():
    rebalancer = Rebalancer(CONFIG, PROFILES, window(48, 2))
    for now in range(5):  # the model says prefill-bound, but no prefill queue: no move
        assert observe(rebalancer, float(now), START, queue=1, assigned=0) is None
    for now in range(5, 10):  # queue, but decode slots are full too: no move
        assert observe(rebalancer, float(now), START, queue=5, assigned=8) is None


def test_guardrails():
    rebalancer = Rebalancer(CONFIG, PROFILES, window(48, 2))
    single = ClusterShape(1, 1, 1)
    for now in range(4):  # the last decode node is never taken
        assert observe(rebalancer, float(now), single, queue=9, assigned=0) is None
    # A verdict that flips resets the streak.
    rebalancer = Rebalancer(CONFIG, PROFILES, window(48, 2))
    assert observe(rebalancer, 0.0, START, queue=5, assigned=1) is None
    assert observe(rebalancer, 1.0, START, queue=0, assigned=1) is None
    assert observe(rebalancer, 2.0, START, queue=5, assigned=1) is None
    assert observe(rebalancer, 3.0, START, queue=5, assigned=1) is not None
    # Too little traffic to model: nothing.
    sparse = TrafficWindow(16)
    sparse.record(0.0, 48, 2)
    rebalancer = Rebalancer(CONFIG, PROFILES, sparse)
    assert all(observe(rebalancer, float(t), START, queue=9, assigned=0) is None for t in range(4))


def test_config_is_validated():
    with pytest.raises(ValueError):
        RebalancerConfig(imbalance=1.0)
    with pytest.raises(ValueError):
        RebalancerConfig(min_decode=0)
