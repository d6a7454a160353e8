"""The front door's ``GET /metrics``: `FrontDoorMetrics`, its own request counters and, when it
knows the router's Prometheus endpoint (``router_metrics``, host:port), the router's exposition
after them, fetched at every scrape. A client that scrapes beside the API (AIPerf looks there)
finds the cluster's series on the API's port.

    prfaas_frontdoor_requests_total{endpoint, status}  counter  answered requests (HTTP status;
                                                               a stream counts at its 200)
    prfaas_frontdoor_router_metrics_up                 gauge    1 when this scrape read the
                                                               router's exposition, else 0

Both expositions are text format 0.0.4 and their names do not meet (the router's start with
``prfaas_`` but never ``prfaas_frontdoor_``), so one after the other is one valid exposition.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.request

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Gauge
from prometheus_client import generate_latest as exposition

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
ROUTER_SCRAPE_TIMEOUT_S = 5.0


class FrontDoorMetrics:
    """One front door's counters (a registry of its own: several doors may share a process)."""

    def __init__(
        self,
        router_metrics: str | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> None:
        """``tls`` and ``token``: how the router's endpoint wants to be read when the cluster has
        ``[security]`` (HTTPS, the bearer token)."""
        self.router_metrics, self.tls, self.token = router_metrics, tls, token
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "prfaas_frontdoor_requests",
            "requests the front door answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.router_up = Gauge(
            "prfaas_frontdoor_router_metrics_up",
            "1 when this scrape read the router's exposition, else 0",
            registry=self.registry,
        )

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def _router_exposition(self) -> bytes:
        scheme = "https" if self.tls is not None else "http"
        request = urllib.request.Request(f"{scheme}://{self.router_metrics}/metrics")
        if self.token is not None:
            request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(
            request, timeout=ROUTER_SCRAPE_TIMEOUT_S, context=self.tls
        ) as reply:
            return reply.read()

    async def render(self) -> bytes:
        """The exposition: the front door's series, then the router's (or, when it is unknown
        or does not answer, a comment saying so)."""
        if self.router_metrics is None:
            self.router_up.set(0)
            return exposition(self.registry) + b"# the router's metrics address is not known\n"
        try:
            router = await asyncio.to_thread(self._router_exposition)
        except OSError as err:
            self.router_up.set(0)
            note = f"# the router's metrics at {self.router_metrics} did not answer: {err}\n"
            return exposition(self.registry) + note.encode()
        self.router_up.set(1)
        return exposition(self.registry) + router
