"""The router's Prometheus metrics as a scraper reads them.

Oracles: the exposition parsed back by prometheus_client's text parser (not the code that
writes it), against the `RouterSnapshot` each test builds — names, types, labels, values —
and, over a router in this process, against its `GetStats` reply and the requests sent.
Label values with a quote, a backslash and a newline come back exactly; the text carries them
escaped as the format says. The exact text lines asserted are the ones whose spelling the
format fixes (`+Inf`, a float's shortest repr).
"""

from __future__ import annotations

import math
import urllib.error

import pytest
from serving_support import (
    fake_config,
    generate,
    parse_metrics,
    sample,
    scrape_metrics,
    serve_in_process,
)

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.router.control import RouterControl
from prfaas_jax.serving.router.metrics import (
    LOOKUP_BUCKETS,
    Histogram,
    MetricsServer,
    RouterSnapshot,
    render_metrics,
)

CACHE_FIELDS = {
    "used_bytes": 4096,
    "capacity_bytes": 65536,
    "lookups": 5,
    "hits": 4,
    "evictions": 2,
    "disk_used_bytes": 8192,
    "spills": 3,
    "disk_hits": 1,
    "reused_tokens": 900,
    "computed_tokens": 300,
    "export_bytes": 0,
    "import_bytes": 57600,
}

# Every family the endpoint can show, with its type: the module docstring's table.
FAMILIES = {
    "prfaas_requests_total": "counter",
    "prfaas_retries_total": "counter",
    "prfaas_resumed_total": "counter",
    "prfaas_rejected_total": "counter",
    "prfaas_instances_down": "gauge",
    "prfaas_requests_in_flight": "gauge",
    "prfaas_threshold_tokens": "gauge",
    "prfaas_threshold_changes_total": "counter",
    "prfaas_egress_bytes_total": "counter",
    "prfaas_egress_bytes_per_second": "gauge",
    "prfaas_link_capacity_bytes_per_second": "gauge",
    "prfaas_link_capacity_samples": "gauge",
    "prfaas_link_saved_bytes_total": "counter",
    "prfaas_cache_rule_total": "counter",
    "prfaas_wire_narrowed_total": "counter",
    "prfaas_link_tcp_retransmitted_segments_total": "counter",
    "prfaas_link_rtt_seconds": "gauge",
    "prfaas_egress_utilization": "gauge",
    "prfaas_queue_depth": "gauge",
    "prfaas_decode_assigned": "gauge",
    "prfaas_instances": "gauge",
    "prfaas_role_changes_total": "counter",
    "prfaas_ttft_seconds": "histogram",
    "prfaas_exposed_transfer_seconds": "histogram",
    "prfaas_router_lookup_seconds": "histogram",
    "prfaas_router_cpu_seconds_total": "counter",
    "prfaas_cache_index_lookups_total": "counter",
    "prfaas_cache_index_overestimates_total": "counter",
    "prfaas_cache_index_instances_current": "gauge",
    "prfaas_prompt_tokens_total": "counter",
    "prfaas_cached_tokens_total": "counter",
    "prfaas_prefix_moves_total": "counter",
    "prfaas_decode_cache_local_total": "counter",
    "prfaas_prefix_cache_bytes": "gauge",
    "prfaas_prefix_cache_capacity_bytes": "gauge",
    "prfaas_prefix_cache_lookups_total": "counter",
    "prfaas_prefix_cache_hits_total": "counter",
    "prfaas_prefix_cache_evictions_total": "counter",
    "prfaas_prefix_cache_disk_bytes": "gauge",
    "prfaas_prefix_cache_spills_total": "counter",
    "prfaas_prefix_cache_disk_hits_total": "counter",
    "prfaas_prefill_tokens_total": "counter",
    "prfaas_prefix_transfer_bytes_total": "counter",
}

# The unlabelled series and the snapshot field each shows.
SCALARS = {
    "prfaas_requests_in_flight": "in_flight",
    "prfaas_threshold_tokens": "threshold",
    "prfaas_egress_bytes_total": "egress_bytes",
    "prfaas_egress_bytes_per_second": "egress_bytes_per_s",
    "prfaas_link_capacity_bytes_per_second": "link_capacity_bytes_per_s",
    "prfaas_link_capacity_samples": "link_capacity_samples",
    "prfaas_link_saved_bytes_total": "saved_bytes",
    "prfaas_link_tcp_retransmitted_segments_total": "tcp_retransmitted_segments",
    "prfaas_link_rtt_seconds": "link_rtt_s",
    "prfaas_role_changes_total": "role_changes",
    "prfaas_retries_total": "retries",
    "prfaas_resumed_total": "resumed",
    "prfaas_rejected_total": "rejected",
    "prfaas_instances_down": "down",
    "prfaas_prompt_tokens_total": "prompt_tokens",
    "prfaas_cached_tokens_total": "cached_tokens",
    "prfaas_prefix_moves_total": "prefix_moves",
    "prfaas_decode_cache_local_total": "decode_cache_local",
    "prfaas_router_cpu_seconds_total": "router_cpu_s",
}


def snapshot(**fields) -> RouterSnapshot:
    """A snapshot of an idle router, `fields` set."""
    idle = {
        "requests": {},
        "in_flight": 0,
        "threshold": 64,
        "threshold_changes": {},
        "egress_bytes": 0,
        "egress_bytes_per_s": 0.0,
        "link_capacity_bytes_per_s": 0.0,
        "queue_depth": {},
        "decode_assigned": {},
        "instances": {},
        "role_changes": 0,
        "ttft": Histogram(),
    }
    return RouterSnapshot(**{**idle, **fields})


def full_snapshot(instance: str = "pd-0") -> RouterSnapshot:
    """Every field set, every optional family shown; `instance` names the instance and the
    route in every labelled series."""
    ttft, lookup = Histogram(), Histogram(LOOKUP_BUCKETS)
    for value in (0.02, 0.3, 40.0):
        ttft.observe(value)
    lookup.observe(0.002)
    exposed = {instance: Histogram(), "pd": Histogram()}
    exposed[instance].observe(0.2)
    return snapshot(
        requests={(instance, "ok"): 3, ("pd", "error"): 1, ("none", "cancelled"): 1},
        in_flight=2,
        threshold=80.5,
        threshold_changes={"capacity": 2, "periodic": 1},
        egress_bytes=2**40 + 3,
        egress_bytes_per_s=12345.5,
        link_capacity_bytes_per_s=2e6,
        queue_depth={(instance, "prfaas_prefill"): 4},
        decode_assigned={instance: 5},
        instances={"pd_decode": 1, "prfaas_prefill": 2},
        role_changes=1,
        ttft=ttft,
        exposed_transfer=exposed,
        prompt_tokens=1200,
        cached_tokens=900,
        prefix_moves=1,
        wire_narrowed={"int8": 4, "bf16": 2},
        decode_cache_local=3,
        retries=6,
        resumed=7,
        rejected=8,
        down=1,
        link_capacity_samples=9,
        saved_bytes=1000,
        cache_rules={"abundant": 2, "scarce": 1},
        tcp_retransmitted_segments=11,
        link_rtt_s=0.0412,
        prefix_cache={instance: CACHE_FIELDS},
        cache_index={"answered": 5, "asked": 1, "overestimates": 2, "current": 3},
        lookup_time=lookup,
        router_cpu_s=1.25,
    )


def test_render():
    ttft = Histogram()
    for value in (0.02, 0.3, 40.0):
        ttft.observe(value)
    s = snapshot(
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
    s.exposed_transfer["prfaas"].observe(0.04)
    s.exposed_transfer["prfaas"].observe(0.6)
    text = render_metrics(s)
    lines = set(text.splitlines())
    _, samples = parse_metrics(text)
    assert sample(samples, "prfaas_requests_total", route="prfaas", outcome="ok") == 3
    assert sample(samples, "prfaas_requests_total", route="pd", outcome="error") == 1
    assert "prfaas_threshold_tokens +Inf" in lines
    # Counters stay exact: 1479070 bytes, however the float is spelled.
    assert sample(samples, "prfaas_egress_bytes_total") == 1_479_070
    assert "prfaas_egress_bytes_per_second 12345.5" in lines
    assert "prfaas_egress_utilization 0.00617275" in lines
    depth = sample(samples, "prfaas_queue_depth", instance="prfaas-0", role="prfaas_prefill")
    assert depth == 4
    assert sample(samples, "prfaas_threshold_changes_total", reason="capacity") == 2
    assert sample(samples, "prfaas_ttft_seconds_bucket", le="0.025") == 1
    assert sample(samples, "prfaas_ttft_seconds_bucket", le="30") == 2
    assert sample(samples, "prfaas_ttft_seconds_bucket", le="+Inf") == 3
    assert sample(samples, "prfaas_ttft_seconds_count") == 3
    assert text.endswith("\n") and "# TYPE prfaas_ttft_seconds histogram" in lines
    # One exposed-transfer histogram per route, the route a label.
    assert "# TYPE prfaas_exposed_transfer_seconds histogram" in lines
    exposed = "prfaas_exposed_transfer_seconds"
    assert sample(samples, f"{exposed}_bucket", route="prfaas", le="0.05") == 1
    assert sample(samples, f"{exposed}_bucket", route="prfaas", le="+Inf") == 2
    assert sample(samples, f"{exposed}_sum", route="prfaas") == 0.64
    assert sample(samples, f"{exposed}_count", route="pd") == 0


def test_render_prefix_cache():
    s = snapshot(
        prompt_tokens=1200, cached_tokens=900, prefix_moves=1, prefix_cache={"pd-0": CACHE_FIELDS}
    )
    _, samples = parse_metrics(render_metrics(s))
    assert sample(samples, "prfaas_prompt_tokens_total") == 1200
    assert sample(samples, "prfaas_cached_tokens_total") == 900
    assert sample(samples, "prfaas_prefix_moves_total") == 1
    assert sample(samples, "prfaas_prefix_cache_hits_total", instance="pd-0") == 4
    assert sample(samples, "prfaas_prefix_cache_evictions_total", instance="pd-0") == 2
    assert sample(samples, "prfaas_prefix_cache_disk_bytes", instance="pd-0") == 8192
    assert sample(samples, "prfaas_prefix_cache_spills_total", instance="pd-0") == 3
    assert sample(samples, "prfaas_prefix_cache_disk_hits_total", instance="pd-0") == 1
    assert sample(samples, "prfaas_prefill_tokens_total", instance="pd-0", kind="computed") == 300
    transfer = "prfaas_prefix_transfer_bytes_total"
    assert sample(samples, transfer, instance="pd-0", direction="import") == 57600


def test_every_family_its_name_type_and_values():
    s = full_snapshot()
    types, samples = parse_metrics(render_metrics(s))
    assert types == FAMILIES
    for name, field in SCALARS.items():
        assert sample(samples, name) == getattr(s, field), name
    assert sample(samples, "prfaas_egress_bytes_total") == 2**40 + 3  # exact below 2**53
    assert sample(samples, "prfaas_egress_utilization") == 12345.5 / 2e6
    for (route, outcome), n in s.requests.items():
        assert sample(samples, "prfaas_requests_total", route=route, outcome=outcome) == n
    for reason, n in s.threshold_changes.items():
        assert sample(samples, "prfaas_threshold_changes_total", reason=reason) == n
    for rule, n in s.cache_rules.items():
        assert sample(samples, "prfaas_cache_rule_total", rule=rule) == n
    for role, n in s.instances.items():
        assert sample(samples, "prfaas_instances", role=role) == n
    for precision, n in s.wire_narrowed.items():
        assert sample(samples, "prfaas_wire_narrowed_total", precision=precision) == n
    assert sample(samples, "prfaas_cache_index_lookups_total", source="index") == 5
    assert sample(samples, "prfaas_cache_index_lookups_total", source="asked") == 1
    assert sample(samples, "prfaas_cache_index_overestimates_total") == 2
    assert sample(samples, "prfaas_cache_index_instances_current") == 3
    cache = {
        "prfaas_prefix_cache_bytes": "used_bytes",
        "prfaas_prefix_cache_capacity_bytes": "capacity_bytes",
        "prfaas_prefix_cache_lookups_total": "lookups",
    }
    for name, field in cache.items():
        assert sample(samples, name, instance="pd-0") == CACHE_FIELDS[field]
    reused = sample(samples, "prfaas_prefill_tokens_total", instance="pd-0", kind="reused")
    assert reused == 900
    lookup = "prfaas_router_lookup_seconds"
    assert sample(samples, f"{lookup}_bucket", le="0.001") == 0
    assert sample(samples, f"{lookup}_bucket", le="0.0025") == 1
    assert sample(samples, f"{lookup}_sum") == 0.002
    assert sample(samples, "prfaas_ttft_seconds_sum") == 0.02 + 0.3 + 40.0
    # Nothing the endpoint never had: no `_created` series, none of the library's own.
    assert all(name.startswith("prfaas_") for name, _ in samples)
    assert not any(name.endswith("_created") for name, _ in samples)


def test_an_idle_router_leaves_out_what_it_lacks():
    types, samples = parse_metrics(render_metrics(snapshot()))
    absent = {"prfaas_router_lookup_seconds", "prfaas_cache_index_lookups_total"}
    absent |= {"prfaas_cache_index_overestimates_total", "prfaas_cache_index_instances_current"}
    assert set(types) == set(FAMILIES) - absent
    assert not any(name == "prfaas_requests_total" for name, _ in samples)  # a family, no series


def test_label_values_round_trip():
    odd = 'pd "0" \\ a\nb'  # a double quote, a backslash, a newline
    text = render_metrics(full_snapshot(odd))
    _, samples = parse_metrics(text)
    assert sample(samples, "prfaas_decode_assigned", instance=odd) == 5
    assert sample(samples, "prfaas_queue_depth", instance=odd, role="prfaas_prefill") == 4
    assert sample(samples, "prfaas_requests_total", route=odd, outcome="ok") == 3
    assert sample(samples, "prfaas_exposed_transfer_seconds_count", route=odd) == 1
    assert sample(samples, "prfaas_prefix_cache_hits_total", instance=odd) == 4
    # On the wire: `\"`, `\\` and `\n` inside the quotes, each sample on a line of its own.
    assert 'prfaas_decode_assigned{instance="pd \\"0\\" \\\\ a\\nb"} 5.0' in text.splitlines()
    assert all(line.startswith(("#", "prfaas_")) for line in text.splitlines())


def test_the_endpoint_renders_each_scrape_afresh():
    state = {"retries": 0}
    server = MetricsServer(lambda: snapshot(**state))
    try:
        host, port = server.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        content_type, text = scrape_metrics(server.address)
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"
        assert sample(parse_metrics(text)[1], "prfaas_retries_total") == 0
        state["retries"] = 5
        _, text = scrape_metrics(server.address, "/metrics?x=1")
        assert sample(parse_metrics(text)[1], "prfaas_retries_total") == 5
        with pytest.raises(urllib.error.HTTPError) as err:
            scrape_metrics(server.address, "/other")
        assert err.value.code == 404
    finally:
        server.stop()


def test_the_endpoint_over_a_router_in_this_process(tmp_path):
    """Two requests, one per route (t = 64): the endpoint's series agree with `GetStats` and
    with what was sent."""
    cfg = load_model_config("tiny")
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml"))
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(cfg)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(cfg)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(cfg, max_slots=4, max_len=512)),
    }
    with serve_in_process(config, engines) as cluster:
        routes = [generate(cluster.router, [7] * n, 3).report.route for n in (100, 20)]
        assert routes == ["prfaas", "pd"]
        control = RouterControl(cluster.core)
        server = MetricsServer(control.snapshot)
        try:
            types, samples = parse_metrics(scrape_metrics(server.address)[1])
        finally:
            server.stop()
        stats = cluster.stats()
        # A snapshot is rendered after the router's lock is let go: its histograms are copies
        # that later requests leave alone.
        taken = control.snapshot()
        generate(cluster.router, [7] * 30, 3)
        assert (taken.ttft.count, sum(h.count for h in taken.exposed_transfer.values())) == (2, 2)
        assert control.snapshot().ttft.count == 3
    assert set(types) <= set(FAMILIES)
    for route, n in (("prfaas", stats.requests_prfaas), ("pd", stats.requests_pd)):
        assert sample(samples, "prfaas_requests_total", route=route, outcome="ok") == n == 1
        assert sample(samples, "prfaas_exposed_transfer_seconds_count", route=route) == 1
    assert sample(samples, "prfaas_ttft_seconds_count") == 2
    assert sample(samples, "prfaas_prompt_tokens_total") == stats.prompt_tokens == 120
    assert sample(samples, "prfaas_threshold_tokens") == stats.threshold == 64
    assert sample(samples, "prfaas_requests_in_flight") == stats.requests_in_flight == 0
    for role in ("prfaas_prefill", "pd_prefill", "pd_decode"):
        assert sample(samples, "prfaas_instances", role=role) == 1
    assert sample(samples, "prfaas_queue_depth", instance="prfaas-0", role="prfaas_prefill") == 0
    assert sample(samples, "prfaas_decode_assigned", instance="pd-1") == 0
