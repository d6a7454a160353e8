"""The routing rule (paper §3.3–3.4.3, research/paper.md §4.1) on literal numbers."""

from __future__ import annotations

import pytest

from prfaas_jax.policy.routing import (
    ClusterKind,
    ClusterView,
    DecodeLoad,
    InstanceLoad,
    Role,
    pick_decode,
    route,
)

T = 64
PRFAAS, PD = (InstanceLoad("r0"),), (InstanceLoad("p0"),)


def view(*, prfaas=PRFAAS, pd=PD, **kw) -> ClusterView:
    return ClusterView(T, tuple(prfaas), tuple(pd), **kw)


@pytest.mark.parametrize(
    ("prompt_len", "cluster"),
    [(1, ClusterKind.PD), (63, ClusterKind.PD), (64, ClusterKind.PD), (65, ClusterKind.PRFAAS)],
)
def test_threshold_on_the_uncached_length(prompt_len, cluster):
    decision = route(prompt_len, view(), now=5.0)
    assert decision.cluster is cluster
    assert decision.uncached_len == prompt_len and decision.cached_len == 0
    assert decision.prefix_source is None and decision.reason == "threshold"
    assert decision.decided_at == 5.0


def test_queue_guard_keeps_long_requests_local_when_prfaas_lags():
    busy = (InstanceLoad("r0", queue_depth=2), InstanceLoad("r1", queue_depth=3))
    decision = route(300, view(prfaas=busy, prfaas_max_queue=2), 0.0)
    assert (decision.cluster, decision.instance, decision.reason) == (
        ClusterKind.PD,
        "p0",
        "queue_guard",
    )
    # One PrfaaS instance below the guard is enough, and it is the one chosen.
    open_one = (InstanceLoad("r0", queue_depth=2), InstanceLoad("r1", queue_depth=1))
    decision = route(300, view(prfaas=open_one, prfaas_max_queue=2), 0.0)
    assert (decision.cluster, decision.instance) == (ClusterKind.PRFAAS, "r1")


def test_missing_clusters():
    assert route(300, view(prfaas=()), 0.0).reason == "no_prfaas"
    decision = route(10, view(pd=()), 0.0)
    assert (decision.cluster, decision.reason) == (ClusterKind.PRFAAS, "no_pd_prefill")
    with pytest.raises(ValueError):
        ClusterView(T, (), ())


def test_bandwidth_scarce_judges_each_cluster_on_its_own_cache():
    # l_total − l_pd = 100 − 40 = 60 ≤ 64: stays local, reusing the PD prefix.
    decision = route(100, view(pd=(InstanceLoad("p0", cached_len=40),)), 0.0)
    assert (decision.cluster, decision.cached_len, decision.uncached_len) == (
        ClusterKind.PD,
        40,
        60,
    )
    assert decision.prefix_source == "p0" and not decision.moves_prefix
    # A PrfaaS prefix of 60 does not count for PD: 100 − 0 > 64 → PrfaaS, computing 40.
    decision = route(100, view(prfaas=(InstanceLoad("r0", cached_len=60),)), 0.0)
    assert (decision.cluster, decision.uncached_len, decision.prefix_source) == (
        ClusterKind.PRFAAS,
        40,
        "r0",
    )


def test_bandwidth_abundant_uses_the_best_prefix_anywhere():
    prfaas = (InstanceLoad("r0", cached_len=60),)
    decision = route(100, view(prfaas=prfaas, bandwidth_abundant=True), 0.0)
    # 100 − max(60, 0) = 40 ≤ 64: PD-P computes 40 tokens; the prefix crosses the link.
    assert (decision.cluster, decision.instance, decision.uncached_len) == (
        ClusterKind.PD,
        "p0",
        40,
    )
    assert decision.prefix_source == "r0" and decision.moves_prefix


def test_a_prefix_never_covers_the_last_token():
    decision = route(50, view(pd=(InstanceLoad("p0", cached_len=50),)), 0.0)
    assert (decision.cached_len, decision.uncached_len) == (49, 1)


def test_instance_choice_weighs_cache_affinity_against_load():
    # Work after the request = queued tokens + (prompt − cached prefix).
    a, b = InstanceLoad("a", queued_tokens=100), InstanceLoad("b")
    assert route(60, view(pd=(a, b)), 0.0).instance == "b"  # 160 vs 60
    a = InstanceLoad("a", queued_tokens=30, cached_len=50)
    assert route(60, view(pd=(a, b)), 0.0).instance == "a"  # 40 vs 60
    a = InstanceLoad("a", queued_tokens=70, cached_len=50)
    assert route(60, view(pd=(a, b)), 0.0).instance == "b"  # 80 vs 60
    tie = (InstanceLoad("x"), InstanceLoad("y"))
    assert route(60, view(pd=tie), 0.0).instance == "x"


def test_pick_decode_by_fill():
    loads = [DecodeLoad("d0", 6, 8), DecodeLoad("d1", 3, 4), DecodeLoad("d2", 5, 8)]
    assert pick_decode(loads) == "d2"  # 0.625 < 0.75 = 0.75
    assert pick_decode([DecodeLoad("d0", 1, 4), DecodeLoad("d1", 2, 8)]) == "d0"  # tie: first
    with pytest.raises(ValueError):
        pick_decode([])


def test_roles():
    assert Role.PRFAAS_PREFILL.cluster is ClusterKind.PRFAAS
    assert Role.PD_DECODE.cluster is ClusterKind.PD and not Role.PD_DECODE.is_prefill
    assert Role("pd_prefill").is_prefill
