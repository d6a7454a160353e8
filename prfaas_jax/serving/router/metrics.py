"""The router's Prometheus endpoint: `render_metrics(snapshot) -> str` and `MetricsServer`.

`MetricsServer` serves `GET /metrics` (text exposition format 0.0.4) from a daemon thread on
127.0.0.1; every scrape renders a fresh `RouterSnapshot`. Metric names:

    prfaas_requests_total{route, outcome}        counter  finished requests ("ok" | "error" |
                                                          "cancelled"; route "none": never routed)
    prfaas_retries_total                         counter  attempts after a fault
    prfaas_resumed_total                         counter  streams continued after a lost decode
    prfaas_rejected_total                        counter  refused at admission (overload, SLO)
    prfaas_instances_down                        gauge    instances left out of routing now
    prfaas_requests_in_flight                    gauge
    prfaas_threshold_tokens                      gauge    the routing threshold t
    prfaas_threshold_changes_total{reason}       counter  controller updates of t
    prfaas_egress_bytes_total                    counter  PrfaaS → PD link bytes
    prfaas_egress_bytes_per_second               gauge    over the controller's window
    prfaas_link_capacity_bytes_per_second        gauge    learned from the link's transfers
    prfaas_link_capacity_samples                 gauge    transfers it was learned from
    prfaas_link_saved_bytes_total                counter  kept off the link by increments
    prfaas_cache_rule_total{rule}                counter  "scarce" | "abundant", where they differ
    prfaas_link_tcp_retransmitted_segments_total counter  where the kernel counts them (--netns)
    prfaas_egress_utilization                    gauge    rate / cap
    prfaas_queue_depth{instance, role}           gauge    router-side outstanding prefills
    prfaas_decode_assigned{instance}             gauge    requests on each decode node
    prfaas_instances{role}                       gauge
    prfaas_role_changes_total                    counter
    prfaas_ttft_seconds                          histogram
    prfaas_exposed_transfer_seconds{route}       histogram prefill end → first token
    prfaas_router_lookup_seconds                 histogram a request's cached-prefix lookup
    prfaas_router_cpu_seconds_total              counter  the router process's CPU time
    prfaas_cache_index_lookups_total{source}     counter  per-instance lengths: "index" | "asked"
    prfaas_cache_index_overestimates_total       counter  prefills that reused less than routed on
    prfaas_cache_index_instances_current         gauge    instances the index is in step with
    prfaas_prompt_tokens_total                   counter  prompt tokens of finished requests
    prfaas_cached_tokens_total                   counter  of those, reused from a cached prefix
    prfaas_prefix_moves_total                    counter  prefixes fetched from another instance
    prfaas_prefix_cache_bytes{instance}          gauge    bytes held (KV blocks + checkpoints)
    prfaas_prefix_cache_capacity_bytes{instance} gauge
    prfaas_prefix_cache_lookups_total{instance}  counter  prefills that consulted the cache
    prfaas_prefix_cache_hits_total{instance}     counter  of those, with a reusable prefix
    prfaas_prefix_cache_evictions_total{instance} counter
    prfaas_prefill_tokens_total{instance, kind}  counter  "reused" or "computed" prompt tokens
    prfaas_prefix_transfer_bytes_total{instance, direction}  counter  "export" | "import" state

Token hit rate = cached / prompt tokens; the per-instance series come from each worker's
`GetStats` (`PrefixCacheStats`), as polled by the router's control loop.
"""

from __future__ import annotations

import dataclasses
import http.server
import math
import threading
from collections.abc import Callable

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LOOKUP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclasses.dataclass
class Histogram:
    buckets: tuple[float, ...] = TTFT_BUCKETS
    counts: list[int] = dataclasses.field(default_factory=list)  # per bucket; [] → zeros
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclasses.dataclass(frozen=True)
class RouterSnapshot:
    requests: dict[tuple[str, str], int]  # (route, outcome) → count
    in_flight: int
    threshold: float
    threshold_changes: dict[str, int]
    egress_bytes: int
    egress_bytes_per_s: float
    link_capacity_bytes_per_s: float
    queue_depth: dict[tuple[str, str], int]  # (instance, role) → outstanding prefills
    decode_assigned: dict[str, int]
    instances: dict[str, int]  # role → count
    role_changes: int
    ttft: Histogram
    exposed_transfer: dict[str, Histogram] = dataclasses.field(default_factory=dict)  # by route
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefix_moves: int = 0
    retries: int = 0
    resumed: int = 0
    rejected: int = 0
    down: int = 0
    link_capacity_samples: int = 0
    saved_bytes: int = 0
    cache_rules: dict[str, int] = dataclasses.field(default_factory=dict)  # rule → requests
    tcp_retransmitted_segments: int = 0
    # instance → its PrefixCacheStats fields (prfaas.proto), as last polled
    prefix_cache: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # the router's cache index: CacheIndexStats fields (empty without one)
    cache_index: dict[str, int] = dataclasses.field(default_factory=dict)
    lookup_time: Histogram | None = None  # each request's cached-prefix lookup, seconds
    router_cpu_s: float = 0.0  # the router process's CPU time


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"  # the exposition format's spelling
    if math.isnan(value):
        return "NaN"
    # Counters must stay exact: 1479070 bytes, not 1.47907e+06.
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def render_metrics(s: RouterSnapshot) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, rows: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in rows)

    metric(
        "prfaas_requests_total",
        "counter",
        "Finished requests by route and outcome.",
        [(_labels(route=r, outcome=o), n) for (r, o), n in sorted(s.requests.items())],
    )
    metric("prfaas_requests_in_flight", "gauge", "Requests in flight.", [("", s.in_flight)])
    metric("prfaas_threshold_tokens", "gauge", "Routing threshold t (tokens).", [("", s.threshold)])
    metric(
        "prfaas_threshold_changes_total",
        "counter",
        "Threshold updates by the controller, by trigger.",
        [(_labels(reason=r), n) for r, n in sorted(s.threshold_changes.items())],
    )
    metric(
        "prfaas_egress_bytes_total", "counter", "PrfaaS to PD link bytes.", [("", s.egress_bytes)]
    )
    metric(
        "prfaas_egress_bytes_per_second",
        "gauge",
        "PrfaaS egress rate over the controller window.",
        [("", s.egress_bytes_per_s)],
    )
    metric(
        "prfaas_link_capacity_bytes_per_second",
        "gauge",
        "Capacity of the inter-cluster link, learned from its transfers.",
        [("", s.link_capacity_bytes_per_s)],
    )
    metric(
        "prfaas_cache_rule_total",
        "counter",
        "Requests the two prefix-cache rules would route differently, by the rule chosen.",
        [(_labels(rule=r), n) for r, n in sorted(s.cache_rules.items())],
    )
    if s.cache_index:
        index = s.cache_index
        metric(
            "prfaas_cache_index_lookups_total",
            "counter",
            "Per-instance cached lengths, by source: the router's cache index or a Lookup RPC.",
            [
                (_labels(source="index"), index["answered"]),
                (_labels(source="asked"), index["asked"]),
            ],
        )
        metric(
            "prfaas_cache_index_overestimates_total",
            "counter",
            "Requests whose prefill reused less than the cached length routing used.",
            [("", index["overestimates"])],
        )
        metric(
            "prfaas_cache_index_instances_current",
            "gauge",
            "Instances the cache index is in step with.",
            [("", index["current"])],
        )
    metric(
        "prfaas_link_saved_bytes_total",
        "counter",
        "State bytes kept off the link: KV the decode side already held.",
        [("", s.saved_bytes)],
    )
    metric(
        "prfaas_link_capacity_samples",
        "gauge",
        "Transfers the link capacity was learned from (0: the configured bandwidth).",
        [("", s.link_capacity_samples)],
    )
    metric(
        "prfaas_link_tcp_retransmitted_segments_total",
        "counter",
        "TCP segments the link retransmitted (counted under --netns only).",
        [("", s.tcp_retransmitted_segments)],
    )
    cap = s.link_capacity_bytes_per_s
    metric(
        "prfaas_egress_utilization",
        "gauge",
        "Egress rate over link capacity.",
        [("", s.egress_bytes_per_s / cap if cap > 0 else 0.0)],
    )
    metric(
        "prfaas_queue_depth",
        "gauge",
        "Outstanding prefills per prefill instance.",
        [(_labels(instance=i, role=r), n) for (i, r), n in sorted(s.queue_depth.items())],
    )
    metric(
        "prfaas_decode_assigned",
        "gauge",
        "Requests assigned to each decode instance.",
        [(_labels(instance=i), n) for i, n in sorted(s.decode_assigned.items())],
    )
    metric(
        "prfaas_instances",
        "gauge",
        "Instances per role.",
        [(_labels(role=r), n) for r, n in sorted(s.instances.items())],
    )
    metric("prfaas_role_changes_total", "counter", "PD role switches.", [("", s.role_changes)])
    metric("prfaas_retries_total", "counter", "Attempts after a fault.", [("", s.retries)])
    metric(
        "prfaas_resumed_total", "counter", "Streams resumed after a lost decode.", [("", s.resumed)]
    )
    metric("prfaas_rejected_total", "counter", "Refused at admission.", [("", s.rejected)])
    metric("prfaas_instances_down", "gauge", "Instances left out of routing.", [("", s.down)])
    _prefix_metrics(s, metric)
    _histograms(lines, "prfaas_ttft_seconds", "Time to first token at the router.", {"": s.ttft})
    if s.lookup_time is not None:
        _histograms(
            lines,
            "prfaas_router_lookup_seconds",
            "A request's lookup of every prefill instance's cached prefix at the router.",
            {"": s.lookup_time},
        )
    metric(
        "prfaas_router_cpu_seconds_total",
        "counter",
        "CPU time of the router process.",
        [("", s.router_cpu_s)],
    )
    _histograms(
        lines,
        "prfaas_exposed_transfer_seconds",
        "Prefill end to first token: the state transfer compute did not hide.",
        {route: hist for route, hist in sorted(s.exposed_transfer.items())},
        label="route",
    )
    return "\n".join(lines) + "\n"


def _histograms(
    lines: list[str], name: str, help_text: str, series: dict[str, Histogram], label: str = ""
) -> None:
    """One histogram per ``series`` entry (its key the value of ``label``; "" and no label:
    a single unlabelled histogram)."""
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    for key, hist in series.items():
        own = f'{label}="{key}",' if label else ""
        tail = _labels(**{label: key}) if label else ""
        for bound, count in zip(hist.buckets, hist.counts, strict=True):
            lines.append(f'{name}_bucket{{{own}le="{bound:g}"}} {count}')
        lines.append(f'{name}_bucket{{{own}le="+Inf"}} {hist.count}')
        lines.append(f"{name}_sum{tail} {_number(hist.total)}")
        lines.append(f"{name}_count{tail} {hist.count}")


def _prefix_metrics(s: RouterSnapshot, metric: Callable[..., None]) -> None:
    metric(
        "prfaas_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished requests.",
        [("", s.prompt_tokens)],
    )
    metric(
        "prfaas_cached_tokens_total",
        "counter",
        "Prompt tokens reused from a cached prefix instead of prefilled.",
        [("", s.cached_tokens)],
    )
    metric(
        "prfaas_prefix_moves_total",
        "counter",
        "Requests whose reused prefix was fetched from another instance.",
        [("", s.prefix_moves)],
    )
    caches = sorted(s.prefix_cache.items())

    def per_instance(name: str, kind: str, help_text: str, field: str) -> None:
        metric(name, kind, help_text, [(_labels(instance=i), c[field]) for i, c in caches])

    per_instance("prfaas_prefix_cache_bytes", "gauge", "Prefix cache bytes held.", "used_bytes")
    per_instance(
        "prfaas_prefix_cache_capacity_bytes", "gauge", "Prefix cache budget.", "capacity_bytes"
    )
    per_instance(
        "prfaas_prefix_cache_lookups_total",
        "counter",
        "Prefills that consulted the cache.",
        "lookups",
    )
    per_instance(
        "prfaas_prefix_cache_hits_total", "counter", "Prefills that reused a prefix.", "hits"
    )
    per_instance(
        "prfaas_prefix_cache_evictions_total",
        "counter",
        "Blocks and checkpoints evicted.",
        "evictions",
    )
    metric(
        "prfaas_prefill_tokens_total",
        "counter",
        "Prompt tokens per prefill instance, reused or computed.",
        [
            (_labels(instance=i, kind=kind), c[f"{kind}_tokens"])
            for i, c in caches
            for kind in ("reused", "computed")
        ],
    )
    metric(
        "prfaas_prefix_transfer_bytes_total",
        "counter",
        "Prefix state bytes sent to or fetched from other instances.",
        [
            (_labels(instance=i, direction=d), c[f"{d}_bytes"])
            for i, c in caches
            for d in ("export", "import")
        ],
    )


class MetricsServer:
    """`GET /metrics` on `host`:`port` (0: any free port), served from a daemon thread."""

    def __init__(
        self, snapshot: Callable[[], RouterSnapshot], port: int = 0, host: str = "127.0.0.1"
    ) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render_metrics(snapshot()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes are not news

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
