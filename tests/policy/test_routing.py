"""The routing rule (paper §3.3–3.4.3, docs/design.md §3.7) on literal numbers."""

from __future__ import annotations

import pytest

from prfaas_jax.policy.routing import (
    ClusterKind,
    ClusterView,
    DecodeLoad,
    InstanceLoad,
    LinkView,
    Role,
    RouteReason,
    choose_abundant,
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
    assert decision.prefix_source is None and decision.reason is RouteReason.THRESHOLD
    assert decision.decided_at == 5.0


def test_queue_guard_keeps_long_requests_local_when_prfaas_lags():
    busy = (InstanceLoad("r0", queue_depth=2), InstanceLoad("r1", queue_depth=3))
    decision = route(300, view(prfaas=busy, prfaas_max_queue=2), 0.0)
    assert (decision.cluster, decision.instance, decision.reason) == (
        ClusterKind.PD,
        "p0",
        RouteReason.QUEUE_GUARD,
    )
    # One PrfaaS instance below the guard is enough, and it is the one chosen.
    open_one = (InstanceLoad("r0", queue_depth=2), InstanceLoad("r1", queue_depth=1))
    decision = route(300, view(prfaas=open_one, prfaas_max_queue=2), 0.0)
    assert (decision.cluster, decision.instance) == (ClusterKind.PRFAAS, "r1")


def test_missing_clusters():
    assert route(300, view(prfaas=()), 0.0).reason is RouteReason.NO_PRFAAS
    decision = route(10, view(pd=()), 0.0)
    assert (decision.cluster, decision.reason) == (ClusterKind.PRFAAS, RouteReason.NO_PD_PREFILL)
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


# Both bandwidth cases on one table: t = 200, a 1000-token prompt, PrfaaS instance r0 and PD
# prefill instance p0 holding the given cached prefixes.
# (l_prfaas, l_pd, abundant) → (cluster, instance computing, prefix source, cached, uncached)
CASES = [
    # scarce: only PD's own cache counts for PD; 1000 − 850 = 150 ≤ 200 → PD reuses 850.
    ((900, 850, False), (ClusterKind.PD, "p0", "p0", 850, 150)),
    # scarce: 1000 − 700 = 300 > 200 → PrfaaS, which reuses its own 900.
    ((900, 700, False), (ClusterKind.PRFAAS, "r0", "r0", 900, 100)),
    # scarce: PrfaaS's 600 is shorter than PD's 750, but PD cannot take it: 250 > 200.
    ((600, 750, False), (ClusterKind.PRFAAS, "r0", "r0", 600, 400)),
    # abundant: the best prefix anywhere (750 on PD) → 250 > 200 → PrfaaS, prefix moves PD → PrfaaS.
    ((600, 750, True), (ClusterKind.PRFAAS, "r0", "p0", 750, 250)),
    # abundant: 900 on PrfaaS → 100 ≤ 200 → PD computes 100, prefix moves PrfaaS → PD.
    ((900, 0, True), (ClusterKind.PD, "p0", "r0", 900, 100)),
    # abundant: 1000 − 850 = 150 ≤ 200 with the prefix already on PD: nothing moves.
    ((700, 850, True), (ClusterKind.PD, "p0", "p0", 850, 150)),
    # abundant, no cache anywhere: the plain threshold rule.
    ((0, 0, True), (ClusterKind.PRFAAS, "r0", None, 0, 1000)),
]


@pytest.mark.parametrize(("cached", "expected"), CASES)
def test_both_bandwidth_cases_with_literal_numbers(cached, expected):
    l_prfaas, l_pd, abundant = cached
    view = ClusterView(
        200,
        (InstanceLoad("r0", cached_len=l_prfaas),),
        (InstanceLoad("p0", cached_len=l_pd),),
        bandwidth_abundant=abundant,
    )
    d = route(1000, view, 0.0)
    assert (d.cluster, d.instance, d.prefix_source, d.cached_len, d.uncached_len) == expected
    assert d.moves_prefix == (d.prefix_source not in (None, d.instance))


def test_affinity_against_load_inside_a_cluster_with_cached_prefixes():
    # PrfaaS r0 holds 900 tokens of the prompt but has 2000 tokens queued; r1 is idle and cold.
    # Work after the request: r0 = 2000 + (1000 − 900) = 2100, r1 = 0 + 1000 = 1000 → r1, and
    # (bandwidth scarce) r0's prefix moves to r1 inside the PrfaaS cluster (r1 computes 100).
    prfaas = (InstanceLoad("r0", 1, 2000, cached_len=900), InstanceLoad("r1"))
    # Scarce: 1000 − l_pd = 1000 > 200 → PrfaaS.
    d = route(1000, ClusterView(200, prfaas, (InstanceLoad("p0"),)), 0.0)
    assert (d.cluster, d.instance, d.prefix_source, d.uncached_len) == (
        ClusterKind.PRFAAS,
        "r1",
        "r0",
        100,
    )
    # Abundant: 1000 − 900 = 100 ≤ 200 → PD computes the 100, the prefix crosses clusters.
    view = ClusterView(200, prfaas, (InstanceLoad("p0"),), bandwidth_abundant=True)
    d = route(1000, view, 0.0)
    assert (d.cluster, d.instance, d.prefix_source, d.uncached_len) == (
        ClusterKind.PD,
        "p0",
        "r0",
        100,
    )
    # With 800 queued instead, r0 wins: 800 + 100 = 900 < 1000, reusing its own prefix.
    prfaas = (InstanceLoad("r0", 1, 800, cached_len=900), InstanceLoad("r1"))
    d = route(1000, ClusterView(200, prfaas, (InstanceLoad("p0"),)), 0.0)
    assert (d.instance, d.prefix_source, d.moves_prefix) == ("r0", "r0", False)


def test_hot_prefix_replication_weighs_every_instance_as_holding_the_prefix():
    # r0 holds 900 tokens of a 1000-token prompt and has 800 tokens queued; r1 is idle.
    # By own cache: r0 = 800 + 100 = 900 < r1 = 0 + 1000 → r0 (the case above).
    # Replicating: r1 = 0 + (1000 − 900) = 100 < 900 → r1, fetching r0's prefix.
    prfaas = (InstanceLoad("r0", 1, 800, cached_len=900), InstanceLoad("r1"))
    replicating = ClusterView(200, prfaas, (InstanceLoad("p0"),), replicate_prefixes=True)
    d = route(1000, replicating, 0.0)
    assert (d.instance, d.prefix_source, d.cached_len, d.uncached_len) == ("r1", "r0", 900, 100)
    # One queued token is enough: r0 = 1 + 100 > r1 = 100.
    prfaas = (InstanceLoad("r0", 1, 1, cached_len=900), InstanceLoad("r1"))
    d = route(1000, ClusterView(200, prfaas, (), replicate_prefixes=True), 0.0)
    assert (d.instance, d.prefix_source) == ("r1", "r0")
    # A tie goes to the holder, listed second: nothing to copy.
    pd = (InstanceLoad("p0"), InstanceLoad("p1", cached_len=50))
    d = route(60, view(pd=pd, replicate_prefixes=True), 0.0)
    assert (d.instance, d.moves_prefix, d.uncached_len) == ("p1", False, 10)
    # Two holders: load decides between them, each reusing its own copy.
    pd = (InstanceLoad("p0", 1, 30, cached_len=50), InstanceLoad("p1", 1, 20, cached_len=50))
    d = route(60, view(pd=pd, replicate_prefixes=True), 0.0)
    assert (d.instance, d.prefix_source) == ("p1", "p1")
    # Nothing cached anywhere: least queued, as without replication.
    pd = (InstanceLoad("p0", 1, 30), InstanceLoad("p1", 1, 20))
    assert route(60, view(pd=pd, replicate_prefixes=True), 0.0).instance == "p1"


def test_queue_guard_keeps_a_cached_request_local_with_pd_prefix():
    # 1000 − 300 = 700 > 200 would go to PrfaaS, but its only instance has 4 queued.
    view = ClusterView(
        200,
        (InstanceLoad("r0", queue_depth=4, cached_len=900),),
        (InstanceLoad("p0", cached_len=300),),
        prfaas_max_queue=4,
    )
    d = route(1000, view, 0.0)
    assert (d.cluster, d.reason, d.prefix_source, d.uncached_len) == (
        ClusterKind.PD,
        RouteReason.QUEUE_GUARD,
        "p0",
        700,
    )


def test_a_prefix_moves_when_the_spare_link_carries_it_faster_than_it_is_recomputed():
    # 1 MB over 10 MB/s: 0.1 s, plus 5 ms of latency.
    def choose(utilization: float, recompute_s: float, capacity: float = 1e7) -> bool:
        link = LinkView(capacity, utilization, latency_s=0.005)
        return choose_abundant(
            move_bytes=1e6, recompute_s=recompute_s, link=link, max_utilization=0.85
        )

    assert choose(0.0, 0.106) and not choose(0.0, 0.104)
    # Half the link in use: the move takes 0.2 s of the spare half.
    assert choose(0.5, 0.206) and not choose(0.5, 0.2)
    # A link past the bound never takes a move, however slow the recompute.
    assert not choose(0.85, 100.0)
    # Nothing to move, nothing to recompute, or no known capacity: keep to the cluster's own.
    assert not choose(0.0, 0.0) and not choose(0.0, 1.0, capacity=0.0)
    empty = LinkView(1e7, 0.0)
    assert not choose_abundant(move_bytes=0, recompute_s=1.0, link=empty, max_utilization=0.85)


@pytest.mark.parametrize("prompt_len", [65, 100, 128, 129, 200])
@pytest.mark.parametrize("on_decode", [0, 36, 64, 100, 300])
def test_a_prefix_only_on_a_decode_worker_counts_for_the_local_side(prompt_len, on_decode):
    # The pure rule: effective uncached = prompt − min(decode prefix, prompt − 1); local iff ≤ t.
    effective = prompt_len - min(on_decode, prompt_len - 1)
    decision = route(prompt_len, view(decode=(InstanceLoad("d0", cached_len=on_decode),)), 0.0)
    local = effective <= T
    assert decision.cluster is (ClusterKind.PD if local else ClusterKind.PRFAAS)
    if local:
        # Every prompt here is above t: local only thanks to the decode worker's prefix, which
        # moves to the PD prefill instance inside the cluster.
        assert decision.reason is RouteReason.DECODE_CACHE
        assert (decision.instance, decision.prefix_source) == ("p0", "d0")
        assert decision.moves_prefix and decision.uncached_len == effective
    else:
        assert decision.reason is RouteReason.THRESHOLD
        assert decision.prefix_source is None and decision.uncached_len == prompt_len


def test_decode_prefix_against_the_prefill_side_caches():
    # 300 − 250 = 50 ≤ 64 with the decode worker's prefix; 300 − 200 = 100 > 64 without.
    decode = (InstanceLoad("d0", cached_len=120), InstanceLoad("d1", cached_len=250))
    pd = (InstanceLoad("p0", cached_len=200),)
    d = route(300, view(pd=pd, decode=decode), 0.0)
    assert (d.cluster, d.reason, d.prefix_source, d.uncached_len) == (
        ClusterKind.PD,
        RouteReason.DECODE_CACHE,
        "d1",
        50,
    )
    # The PD prefill instance's own prefix is enough already: a plain threshold decision,
    # reusing its own prefix when it is as long.
    pd = (InstanceLoad("p0", cached_len=250),)
    d = route(300, view(pd=pd, decode=decode), 0.0)
    assert (d.reason, d.prefix_source, d.moves_prefix) == (RouteReason.THRESHOLD, "p0", False)
    # Abundant: a PrfaaS prefix of 240 alone would keep it local; the decode prefix is longer.
    prfaas = (InstanceLoad("r0", cached_len=240),)
    d = route(300, view(prfaas=prfaas, decode=decode, bandwidth_abundant=True), 0.0)
    assert (d.cluster, d.reason, d.prefix_source, d.uncached_len) == (
        ClusterKind.PD,
        RouteReason.THRESHOLD,
        "d1",
        50,
    )
    # A decode prefix too short to bring it under t changes nothing: PrfaaS recomputes it all.
    d = route(300, view(decode=(InstanceLoad("d0", cached_len=200),)), 0.0)
    assert (d.cluster, d.prefix_source, d.uncached_len) == (ClusterKind.PRFAAS, None, 300)
