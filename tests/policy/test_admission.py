"""TTFT prediction and admission (policy/admission.py) on literal numbers."""

from __future__ import annotations

import math

import pytest

from prfaas_jax.policy.admission import (
    AdmissionPolicy,
    DecodeBacklog,
    LinkCost,
    PrefillBacklog,
    RejectionKind,
    TtftPrediction,
    admit,
    predict_ttft,
)
from prfaas_jax.policy.profiles import Profile

# The toy cluster's profiles: T_prefill(l) = 0.005 + 2.5e-4·l (PD), 0.002 + 1e-4·l (PrfaaS).
PD = Profile.polynomial([0.005, 2.5e-4])
PRFAAS = Profile.polynomial([0.002, 1e-4])
# S_kv(l) = 0.001·l MiB over 1 MiB/s: a state of l tokens is on the wire for 0.001·l s.
LINK = LinkCost(2**20, 0.005, Profile.polynomial([0.0, 0.001]))


def test_an_idle_pd_instance_costs_only_the_prefill():
    prediction = predict_ttft(200, 200, PrefillBacklog(PD), DecodeBacklog(0, 8, 1.0))
    # T(200) = 0.005 + 0.05 = 0.055; no queue, no link, a free slot.
    assert prediction == TtftPrediction(0.0, pytest.approx(0.055), 0.0, 0.0)
    assert prediction.total_s == pytest.approx(0.055)


def test_the_queue_ahead_costs_its_prefills_at_the_mean_length():
    backlog = PrefillBacklog(PD, requests=4, tokens=400)
    prediction = predict_ttft(200, 200, backlog, DecodeBacklog(3, 8, 1.0))
    # Mean queued length 400 / 4 = 100: 4 · T(100) = 4 · (0.005 + 0.025) = 0.12.
    assert prediction.queue_s == pytest.approx(0.12)
    # 0.12 + T(200) = 0.12 + 0.055; 3 assigned < 8 slots: no slot wait.
    assert prediction.total_s == pytest.approx(0.175)
    assert prediction.decode_wait_s == 0.0


def test_the_mean_length_is_exact_for_a_linear_profile_and_low_for_a_convex_one():
    # Linear: requests of 50 and 150 tokens cost T(50) + T(150) = 0.0175 + 0.0425 = 0.06
    # = 2 · T(100).
    linear = predict_ttft(1, 1, PrefillBacklog(PD, 2, 200), DecodeBacklog())
    assert linear.queue_s == pytest.approx(0.06)
    # Quadratic T(l) = 1e-6·l²: 2 · T(100) = 0.02, below T(50) + T(150) = 0.0025 + 0.0225.
    square = Profile.polynomial([0.0, 0.0, 1e-6])
    convex = predict_ttft(1, 1, PrefillBacklog(square, 2, 200), DecodeBacklog())
    assert convex.queue_s == pytest.approx(0.02)


def test_across_the_link_the_slower_stage_paces_the_queue_and_the_state_crosses():
    backlog = PrefillBacklog(PRFAAS, requests=2, tokens=1000)
    prediction = predict_ttft(300, 400, backlog, DecodeBacklog(0, 4, 2.0), link=LINK)
    # Mean queued length 500: engine 2 · T(500) = 2 · 0.052 = 0.104, link 2 · 0.5 = 1.0.
    assert prediction.queue_s == pytest.approx(1.0)
    # T(300) = 0.002 + 0.03 = 0.032; the whole 400-token state: 0.4 s + 5 ms latency.
    assert prediction.prefill_s == pytest.approx(0.032)
    assert prediction.transfer_s == pytest.approx(0.405)
    assert prediction.total_s == pytest.approx(1.437)


def test_a_fast_link_leaves_the_engine_as_the_bottleneck():
    fast = LinkCost(1000 * 2**20, 0.0, LINK.kv_size_mib)
    prediction = predict_ttft(1, 1, PrefillBacklog(PRFAAS, 2, 1000), DecodeBacklog(), link=fast)
    # Link 2 · 0.0005 = 0.001 < engine 2 · T(500) = 0.104.
    assert prediction.queue_s == pytest.approx(0.104)


def test_a_full_decode_instance_makes_the_request_wait_in_line_for_a_slot():
    # 10 assigned, 4 slots: 7th in line (10 − 4 + 1), a slot frees every 2.0 / 4 s: 3.5 s.
    prediction = predict_ttft(300, 400, PrefillBacklog(PRFAAS, 2, 1000), DecodeBacklog(10, 4, 2.0))
    assert prediction.decode_wait_s == pytest.approx(3.5)
    # The wait overlaps the prefill path (queue 0.104 + prefill 0.032): the larger one counts.
    assert prediction.total_s == pytest.approx(3.5)
    # Exactly full (4 assigned, 4 slots): the first in line, 1 · 2.0 / 4.
    first = predict_ttft(1, 1, PrefillBacklog(PD), DecodeBacklog(4, 4, 2.0))
    assert first.decode_wait_s == pytest.approx(0.5)


@pytest.mark.parametrize(("uncached_len", "state_len"), [(0, 5), (6, 5)])
def test_lengths_are_checked(uncached_len, state_len):
    with pytest.raises(ValueError, match="uncached_len"):
        predict_ttft(uncached_len, state_len, PrefillBacklog(PD), DecodeBacklog())


def test_backlogs_and_links_are_checked():
    with pytest.raises(ValueError, match="requests, tokens"):
        PrefillBacklog(PD, requests=-1)
    with pytest.raises(ValueError, match="max_slots"):
        DecodeBacklog(0, 0, 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        LinkCost(0.0, 0.0, LINK.kv_size_mib)


# --- admit ----------------------------------------------------------------------------------

SLOW = TtftPrediction(queue_s=2.9, prefill_s=0.2, transfer_s=0.1, decode_wait_s=0.0)


def test_the_in_flight_bound_comes_first():
    rejection = admit(SLOW, 256, ttft_slo_s=2.0, max_in_flight=256)
    assert rejection is not None and rejection.kind is RejectionKind.IN_FLIGHT
    assert rejection.reason == "256 requests in flight, the router's limit"
    assert admit(None, 255, ttft_slo_s=0.0, max_in_flight=256) is None


def test_a_predicted_slo_miss_is_refused_with_its_parts():
    # 2.9 + 0.2 + 0.1 = 3.2 s > 2 s.
    rejection = admit(SLOW, 0, ttft_slo_s=2.0, max_in_flight=256)
    assert rejection is not None and rejection.kind is RejectionKind.TTFT_SLO
    assert rejection.prediction == SLOW
    assert rejection.reason == (
        "predicted TTFT 3.2 s exceeds the 2 s SLO "
        "(queue 2.9 s, prefill 0.2 s, transfer 0.1 s, decode slot wait 0 s)"
    )


def test_the_slo_is_inclusive_and_zero_turns_it_off():
    exact = TtftPrediction(1.5, 0.5, 0.0, 0.0)  # 2.0 s
    assert admit(exact, 0, ttft_slo_s=2.0, max_in_flight=1) is None
    assert admit(SLOW, 0, ttft_slo_s=0.0, max_in_flight=1) is None
    with pytest.raises(ValueError, match="prediction"):
        admit(None, 0, ttft_slo_s=2.0, max_in_flight=1)


def test_the_policy_holds_validated_limits():
    policy = AdmissionPolicy(max_in_flight=2, ttft_slo_s=2.0)
    assert policy.predicts and not AdmissionPolicy().predicts
    assert policy.admit(SLOW, 0).kind is RejectionKind.TTFT_SLO
    assert policy.admit(None, 2).kind is RejectionKind.IN_FLIGHT
    for bad in ({"max_in_flight": 0}, {"ttft_slo_s": -1.0}, {"ttft_slo_s": math.nan}):
        with pytest.raises(ValueError):
            AdmissionPolicy(**bad)
