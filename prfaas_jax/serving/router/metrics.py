"""The router's Prometheus metrics: `RouterCollector` (its series, read from a `RouterSnapshot`
at every scrape), `render_metrics(snapshot) -> str`, `MetricsServer` (`GET /metrics`), and the
`Histogram` the router keeps its latencies in.

prometheus_client writes the exposition (text format 0.0.4: names, label values and help text
escaped as the format says); this module only says which families the router's numbers make.
`MetricsServer` serves it from a daemon thread on the router's host (over TLS, and to a scraper
with the router's token or certificate, when `[security]` sets them); every scrape reads a fresh
`RouterSnapshot` of the counters the router keeps anyway. The module runs over 450 lines because
it holds the whole catalogue, each family named here and written once below. Metric names:

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
    prfaas_wire_narrowed_total{precision}        counter  PrfaaS prefills sent narrowed ([wire])
    prfaas_link_tcp_retransmitted_segments_total counter  where the kernel counts them (--netns)
    prfaas_link_rtt_seconds                      gauge    the round trip TCP measured on transfers
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
    prfaas_decode_cache_local_total              counter  kept off the link by a decode prefix
    prfaas_prefix_cache_bytes{instance}          gauge    bytes held (KV blocks + checkpoints)
    prfaas_prefix_cache_capacity_bytes{instance} gauge
    prfaas_prefix_cache_lookups_total{instance}  counter  prefills that consulted the cache
    prfaas_prefix_cache_hits_total{instance}     counter  of those, with a reusable prefix
    prfaas_prefix_cache_evictions_total{instance} counter
    prfaas_prefix_cache_disk_bytes{instance}     gauge    bytes in the disk tier
    prfaas_prefix_cache_spills_total{instance}   counter  checkpoints spilled to the disk tier
    prfaas_prefix_cache_disk_hits_total{instance} counter hits promoted from the disk tier
    prfaas_prefill_tokens_total{instance, kind}  counter  "reused" or "computed" prompt tokens
    prfaas_prefix_transfer_bytes_total{instance, direction}  counter  "export" | "import" state

Token hit rate = cached / prompt tokens; the per-instance series come from each worker's
`GetStats` (`PrefixCacheStats`), as polled by the router's control loop.

Every counter above is a `CounterMetricFamily` named with its `_total`: the library writes the
same `_total` sample and TYPE line, and no `_created` series (a family only has one when given a
creation time, which these are not). Values are spelled as the library spells floats (`3.0`,
`1.47907e+06`: exact below 2**53) and labels in name order; `le` bounds keep their `%g` spelling
(`le="1"`), since to Prometheus 2 a respelled bound is a new series.
"""

from __future__ import annotations

import dataclasses
import http.server
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.transport.security import (
    bearer_matches,
    check_listen,
    http_ssl_context,
    read_token,
)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LOOKUP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclasses.dataclass
class Histogram:
    """Cumulative bucket counts (each bucket counts every value at or below its bound)."""

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

    def copy(self) -> Histogram:
        """A copy that later observations leave alone (a scrape renders it outside the lock)."""
        return dataclasses.replace(self, counts=list(self.counts))


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
    decode_cache_local: int = 0
    retries: int = 0
    resumed: int = 0
    rejected: int = 0
    down: int = 0
    link_capacity_samples: int = 0
    saved_bytes: int = 0
    cache_rules: dict[str, int] = dataclasses.field(default_factory=dict)  # rule → requests
    tcp_retransmitted_segments: int = 0
    link_rtt_s: float = 0.0
    # instance → its PrefixCacheStats fields (prfaas.proto), as last polled
    prefix_cache: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # the router's cache index: CacheIndexStats fields (empty without one)
    cache_index: dict[str, int] = dataclasses.field(default_factory=dict)
    lookup_time: Histogram | None = None  # each request's cached-prefix lookup, seconds
    router_cpu_s: float = 0.0  # the router process's CPU time
    wire_narrowed: dict[str, int] = dataclasses.field(default_factory=dict)  # precision → prefills


Rows = Iterable[tuple[Sequence[str], float]]  # each series' label values and its value


def _family(
    kind: type[CounterMetricFamily | GaugeMetricFamily],
    name: str,
    help_text: str,
    labels: Sequence[str],
    rows: Rows,
) -> Metric:
    family = kind(name, help_text, labels=labels)
    for values, value in rows:
        family.add_metric(values, value)
    return family


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


def _histogram(
    name: str, help_text: str, series: dict[tuple[str, ...], Histogram], labels: Sequence[str] = ()
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text, labels=labels)
    for values, hist in series.items():
        # `le` as the endpoint has always spelled it (module docstring); counts are cumulative.
        buckets = [(f"{b:g}", n) for b, n in zip(hist.buckets, hist.counts, strict=True)]
        family.add_metric(values, [*buckets, ("+Inf", hist.count)], hist.total)
    return family


class RouterCollector(Collector):
    """The router's metric families, from `snapshot()` at each `collect()`."""

    def __init__(self, snapshot: Callable[[], RouterSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        yield from _routing_families(s)
        yield from _prefix_families(s)
        yield _histogram("prfaas_ttft_seconds", "Time to first token at the router.", {(): s.ttft})
        if s.lookup_time is not None:
            yield _histogram(
                "prfaas_router_lookup_seconds",
                "A request's lookup of every prefill instance's cached prefix at the router.",
                {(): s.lookup_time},
            )
        yield _counter(
            "prfaas_router_cpu_seconds_total", "CPU time of the router process.", s.router_cpu_s
        )
        yield _histogram(
            "prfaas_exposed_transfer_seconds",
            "Prefill end to first token: the state transfer compute did not hide.",
            {(route,): hist for route, hist in sorted(s.exposed_transfer.items())},
            labels=("route",),
        )


def _routing_families(s: RouterSnapshot) -> Iterator[Metric]:
    C, G = CounterMetricFamily, GaugeMetricFamily
    yield _family(
        C,
        "prfaas_requests_total",
        "Finished requests by route and outcome.",
        ("route", "outcome"),
        sorted(s.requests.items()),
    )
    yield _gauge("prfaas_requests_in_flight", "Requests in flight.", s.in_flight)
    yield _gauge("prfaas_threshold_tokens", "Routing threshold t (tokens).", s.threshold)
    yield _family(
        C,
        "prfaas_threshold_changes_total",
        "Threshold updates by the controller, by trigger.",
        ("reason",),
        [((r,), n) for r, n in sorted(s.threshold_changes.items())],
    )
    yield _counter("prfaas_egress_bytes_total", "PrfaaS to PD link bytes.", s.egress_bytes)
    yield _gauge(
        "prfaas_egress_bytes_per_second",
        "PrfaaS egress rate over the controller window.",
        s.egress_bytes_per_s,
    )
    yield _gauge(
        "prfaas_link_capacity_bytes_per_second",
        "Capacity of the inter-cluster link, learned from its transfers.",
        s.link_capacity_bytes_per_s,
    )
    yield _family(
        C,
        "prfaas_wire_narrowed_total",
        "PrfaaS prefills whose state crossed the link narrowed ([wire]), by precision.",
        ("precision",),
        [((p,), n) for p, n in sorted(s.wire_narrowed.items())],
    )
    yield _family(
        C,
        "prfaas_cache_rule_total",
        "Requests the two prefix-cache rules would route differently, by the rule chosen.",
        ("rule",),
        [((r,), n) for r, n in sorted(s.cache_rules.items())],
    )
    if s.cache_index:
        index = s.cache_index
        yield _family(
            C,
            "prfaas_cache_index_lookups_total",
            "Per-instance cached lengths, by source: the router's cache index or a Lookup RPC.",
            ("source",),
            [(("index",), index["answered"]), (("asked",), index["asked"])],
        )
        yield _counter(
            "prfaas_cache_index_overestimates_total",
            "Requests whose prefill reused less than the cached length routing used.",
            index["overestimates"],
        )
        yield _gauge(
            "prfaas_cache_index_instances_current",
            "Instances the cache index is in step with.",
            index["current"],
        )
    yield _counter(
        "prfaas_link_saved_bytes_total",
        "State bytes kept off the link: KV the decode side already held.",
        s.saved_bytes,
    )
    yield _gauge(
        "prfaas_link_capacity_samples",
        "Transfers the link capacity was learned from (0: the configured bandwidth).",
        s.link_capacity_samples,
    )
    yield _counter(
        "prfaas_link_tcp_retransmitted_segments_total",
        "TCP segments the link retransmitted (counted under --netns only).",
        s.tcp_retransmitted_segments,
    )
    yield _gauge(
        "prfaas_link_rtt_seconds",
        "The link's round trip as TCP measured it on the transfers (0: none measured lately).",
        s.link_rtt_s,
    )
    cap = s.link_capacity_bytes_per_s
    yield _gauge(
        "prfaas_egress_utilization",
        "Egress rate over link capacity.",
        s.egress_bytes_per_s / cap if cap > 0 else 0.0,
    )
    yield _family(
        G,
        "prfaas_queue_depth",
        "Outstanding prefills per prefill instance.",
        ("instance", "role"),
        sorted(s.queue_depth.items()),
    )
    yield _family(
        G,
        "prfaas_decode_assigned",
        "Requests assigned to each decode instance.",
        ("instance",),
        [((i,), n) for i, n in sorted(s.decode_assigned.items())],
    )
    yield _family(
        G,
        "prfaas_instances",
        "Instances per role.",
        ("role",),
        [((r,), n) for r, n in sorted(s.instances.items())],
    )
    yield _counter("prfaas_role_changes_total", "PD role switches.", s.role_changes)
    yield _counter("prfaas_retries_total", "Attempts after a fault.", s.retries)
    yield _counter("prfaas_resumed_total", "Streams resumed after a lost decode.", s.resumed)
    yield _counter("prfaas_rejected_total", "Refused at admission.", s.rejected)
    yield _gauge("prfaas_instances_down", "Instances left out of routing.", s.down)


def _prefix_families(s: RouterSnapshot) -> Iterator[Metric]:
    C, G = CounterMetricFamily, GaugeMetricFamily
    yield _counter(
        "prfaas_prompt_tokens_total", "Prompt tokens of finished requests.", s.prompt_tokens
    )
    yield _counter(
        "prfaas_cached_tokens_total",
        "Prompt tokens reused from a cached prefix instead of prefilled.",
        s.cached_tokens,
    )
    yield _counter(
        "prfaas_prefix_moves_total",
        "Requests whose reused prefix was fetched from another instance.",
        s.prefix_moves,
    )
    yield _counter(
        "prfaas_decode_cache_local_total",
        "Requests prefilled locally because a decode worker holds their prefix (kept off the "
        "link).",
        s.decode_cache_local,
    )
    caches = sorted(s.prefix_cache.items())
    for kind, name, help_text, field in (
        (G, "prfaas_prefix_cache_bytes", "Prefix cache bytes held.", "used_bytes"),
        (G, "prfaas_prefix_cache_capacity_bytes", "Prefix cache budget.", "capacity_bytes"),
        (C, "prfaas_prefix_cache_lookups_total", "Prefills that consulted the cache.", "lookups"),
        (C, "prfaas_prefix_cache_hits_total", "Prefills that reused a prefix.", "hits"),
        (C, "prfaas_prefix_cache_evictions_total", "Blocks and checkpoints evicted.", "evictions"),
        (G, "prfaas_prefix_cache_disk_bytes", "Prefix cache disk tier bytes.", "disk_used_bytes"),
        (C, "prfaas_prefix_cache_spills_total", "Checkpoints spilled to disk.", "spills"),
        (C, "prfaas_prefix_cache_disk_hits_total", "Hits promoted from disk.", "disk_hits"),
    ):
        yield _family(kind, name, help_text, ("instance",), [((i,), c[field]) for i, c in caches])
    yield _family(
        C,
        "prfaas_prefill_tokens_total",
        "Prompt tokens per prefill instance, reused or computed.",
        ("instance", "kind"),
        [((i, k), c[f"{k}_tokens"]) for i, c in caches for k in ("reused", "computed")],
    )
    yield _family(
        C,
        "prfaas_prefix_transfer_bytes_total",
        "Prefix state bytes sent to or fetched from other instances.",
        ("instance", "direction"),
        [((i, d), c[f"{d}_bytes"]) for i, c in caches for d in ("export", "import")],
    )


def metrics_registry(snapshot: Callable[[], RouterSnapshot]) -> CollectorRegistry:
    """A registry of the router's own: its collector only (none of the library's process or
    platform collectors, whose series the endpoint never had)."""
    registry = CollectorRegistry()
    registry.register(RouterCollector(snapshot))
    return registry


def render_metrics(snapshot: RouterSnapshot) -> str:
    """The exposition text of `snapshot`."""
    return generate_latest(metrics_registry(lambda: snapshot)).decode()


class _MetricsHTTPServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a failed TLS handshake or a dropped scrape: the client sees it, the log need not


class MetricsServer:
    """`GET /metrics` on `host`:`port` (0: any free port), served from a daemon thread.

    The library's exposition in Python's HTTP server rather than its `make_wsgi_app`: that app
    answers any path (this one: 404 but for /metrics) and gives a scraper that asks for it
    OpenMetrics, whose canonical `le="1.0"` would respell the buckets' series."""

    def __init__(
        self,
        snapshot: Callable[[], RouterSnapshot],
        port: int = 0,
        host: str = "127.0.0.1",
        security: SecuritySection | None = None,
    ) -> None:
        """With `security` certificates the endpoint is HTTPS (`http_ssl_context`: a scraper
        with the bearer token of its `token_file`, else with a CA-signed certificate); with a
        token, a scrape without it is 401. Beyond loopback it needs the certificates unless
        `allow_plaintext` (`check_listen`)."""
        registry = metrics_registry(snapshot)
        context = http_ssl_context(security)
        check_listen(security, host, "the router's metrics endpoint", tls=context is not None)
        token = read_token(security)

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 30  # s: a client that connects and says nothing frees its thread

            def do_GET(self) -> None:
                if not bearer_matches(self.headers.get("Authorization"), token):
                    self.send_error(401, "missing or invalid bearer token")
                    return
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes are not news

        self._httpd = _MetricsHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        if context is not None:
            # The handshake happens on the request's own thread, at its first read: a client
            # that never completes one holds up no other scrape.
            self._httpd.socket = context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
