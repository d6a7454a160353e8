"""The Prometheus text rendering: exact counters, the exposition format's infinities."""

from __future__ import annotations

import math

from prfaas_jax.serving.router.metrics import Histogram, RouterSnapshot, render_metrics


def test_render():
    ttft = Histogram()
    for value in (0.02, 0.3, 40.0):
        ttft.observe(value)
    snapshot = RouterSnapshot(
        requests={("prfaas", "ok"): 3, ("pd", "error"): 1},
        in_flight=2,
        threshold=math.inf,
        threshold_changes={"capacity": 2},
        egress_bytes=1_479_070,
        egress_bytes_per_s=12345.5,
        link_capacity_bytes_per_s=2e6,
        queue_depth={("prfaas-0", "prfaas_prefill"): 4},
        decode_assigned={"pd-1": 5},
        instances={"pd_decode": 1},
        role_changes=1,
        ttft=ttft,
        exposed_transfer={"prfaas": Histogram(), "pd": Histogram()},
    )
    snapshot.exposed_transfer["prfaas"].observe(0.04)
    snapshot.exposed_transfer["prfaas"].observe(0.6)
    text = render_metrics(snapshot)
    lines = set(text.splitlines())
    assert 'prfaas_requests_total{route="prfaas",outcome="ok"} 3' in lines
    assert 'prfaas_requests_total{route="pd",outcome="error"} 1' in lines
    assert "prfaas_threshold_tokens +Inf" in lines
    assert "prfaas_egress_bytes_total 1479070" in lines
    assert "prfaas_egress_bytes_per_second 12345.5" in lines
    assert "prfaas_egress_utilization 0.00617275" in lines
    assert 'prfaas_queue_depth{instance="prfaas-0",role="prfaas_prefill"} 4' in lines
    assert 'prfaas_threshold_changes_total{reason="capacity"} 2' in lines
    assert 'prfaas_ttft_seconds_bucket{le="0.025"} 1' in lines
    assert 'prfaas_ttft_seconds_bucket{le="30"} 2' in lines
    assert 'prfaas_ttft_seconds_bucket{le="+Inf"} 3' in lines
    assert "prfaas_ttft_seconds_count 3" in lines
    assert text.endswith("\n") and "# TYPE prfaas_ttft_seconds histogram" in lines
    # One exposed-transfer histogram per route, the route a label.
    assert "# TYPE prfaas_exposed_transfer_seconds histogram" in lines
    assert 'prfaas_exposed_transfer_seconds_bucket{route="prfaas",le="0.05"} 1' in lines
    assert 'prfaas_exposed_transfer_seconds_bucket{route="prfaas",le="+Inf"} 2' in lines
    assert 'prfaas_exposed_transfer_seconds_sum{route="prfaas"} 0.64' in lines
    assert 'prfaas_exposed_transfer_seconds_count{route="pd"} 0' in lines


def test_render_prefix_cache():
    fields = {
        "used_bytes": 4096,
        "capacity_bytes": 65536,
        "lookups": 5,
        "hits": 4,
        "evictions": 2,
        "reused_tokens": 900,
        "computed_tokens": 300,
        "export_bytes": 0,
        "import_bytes": 57600,
    }
    snapshot = RouterSnapshot(
        requests={},
        in_flight=0,
        threshold=64,
        threshold_changes={},
        egress_bytes=0,
        egress_bytes_per_s=0.0,
        link_capacity_bytes_per_s=0.0,
        queue_depth={},
        decode_assigned={},
        instances={},
        role_changes=0,
        ttft=Histogram(),
        prompt_tokens=1200,
        cached_tokens=900,
        prefix_moves=1,
        prefix_cache={"pd-0": fields},
    )
    lines = set(render_metrics(snapshot).splitlines())
    assert {"prfaas_prompt_tokens_total 1200", "prfaas_cached_tokens_total 900"} <= lines
    assert "prfaas_prefix_moves_total 1" in lines
    assert 'prfaas_prefix_cache_hits_total{instance="pd-0"} 4' in lines
    assert 'prfaas_prefix_cache_evictions_total{instance="pd-0"} 2' in lines
    assert 'prfaas_prefill_tokens_total{instance="pd-0",kind="computed"} 300' in lines
    assert 'prfaas_prefix_transfer_bytes_total{instance="pd-0",direction="import"} 57600' in lines
