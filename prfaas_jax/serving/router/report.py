"""The router's reports: `router_stats` (the `GetStats` reply) and `router_snapshot` (what the
Prometheus endpoint renders), both from the `RouterCore` and the control loop's
`ControlCounters`; the workers' polled prefix cache counters included.

Separate from serving/router/control.py, which runs the loop that fills the counters: this
module only reads them, under the core's lock, and renders them.
"""

from __future__ import annotations

import dataclasses
import time

from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.router.core import RouterCore
from prfaas_jax.serving.router.metrics import RouterSnapshot
from prfaas_jax.serving.router.record import Outcome, Route
from prfaas_jax.serving.transport.messages import role_to_proto


@dataclasses.dataclass
class ControlCounters:
    """What the control loop measured and did; written and read under the core's lock."""

    egress_bytes: int = 0  # the PrfaaS workers' link egress, summed
    egress_rate: float = 0.0  # bytes/s over control.RATE_WINDOW_S
    capacity: float = 0.0  # the PrfaaS link's capacity the controller uses, bytes/s
    capacity_samples: int = 0  # transfers it was learned from (0: the configured bandwidth)
    retransmitted: int = 0  # TCP segments the link retransmitted, where the kernel counts them
    rtt_s: float = 0.0  # the link's round trip TCP measured on the transfers (0: none lately)
    data_retransmitted: int = 0  # segments TCP resent on the transfers' data connections
    threshold_changes: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason
    last_reason: str = ""
    role_changes: int = 0


def router_stats(core: RouterCore, counters: ControlCounters) -> pb.RouterStats:
    """`GetStats`: the router's counters, each worker's last polled stats (with the role the
    router records), and the control loop's."""
    with core.lock:
        workers = []
        for w in core.workers.values():
            stats = pb.WorkerStats(name=w.name)
            if w.stats is not None:
                stats.CopyFrom(w.stats)
            # The router's record is current; a polled role may predate a switch.
            stats.role = role_to_proto(w.role)
            workers.append(stats)
        return pb.RouterStats(
            threshold=core.threshold,
            requests_prfaas=core.finished.get((Route.PRFAAS, Outcome.OK), 0),
            requests_pd=core.finished.get((Route.PD, Outcome.OK), 0),
            requests_failed=sum(n for (_, o), n in core.finished.items() if o is not Outcome.OK),
            requests_in_flight=len(core.in_flight),
            egress_bytes=counters.egress_bytes,
            egress_bytes_per_s=counters.egress_rate,
            link_capacity_bytes_per_s=counters.capacity,
            link_capacity_samples=counters.capacity_samples,
            tcp_retransmitted_segments=counters.retransmitted,
            link_rtt_s=counters.rtt_s,
            link_data_retransmitted_segments=counters.data_retransmitted,
            threshold_changes=sum(counters.threshold_changes.values()),
            role_changes=counters.role_changes,
            last_threshold_reason=counters.last_reason,
            workers=workers,
            draining={w.name: w.draining_to.value for w in core.workers.values() if w.draining_to},
            model=core.config.model.preset,
            vocab_size=core.cfg.vocab_size,
            max_len=core.config.engine.max_len,
            prefix_moves=core.prefix_moves,
            decode_cache_local=core.decode_cache_local,
            prompt_tokens=core.prompt_tokens,
            cached_tokens=core.cached_tokens,
            retries=core.retries,
            resumed=core.resumed,
            rejected=core.rejected,
            saved_bytes=core.saved_bytes,
            cache_rules=core.cache_rule.counts,
            cache_index=_index_stats(core),
            lookups=core.lookup_time.count,
            lookup_s=core.lookup_time.total,
            router_cpu_s=time.process_time(),
            wire_narrowed=core.wire.narrowed,
            wire_utilization=core.wire.utilization,
        )


def _index_stats(core: RouterCore) -> pb.CacheIndexStats:
    """The cache index's counters (``enabled`` false without one); under the core's lock."""
    stats = pb.CacheIndexStats() if core.cache_feed is None else core.cache_feed.stats()
    stats.overestimates = core.overestimates
    return stats


def router_snapshot(core: RouterCore, counters: ControlCounters) -> RouterSnapshot:
    """What the Prometheus endpoint renders (serving/router/metrics.py), from the same counters."""
    cache_fields = pb.PrefixCacheStats.DESCRIPTOR.fields
    with core.lock:
        workers = list(core.workers.values())
        instances: dict[str, int] = {}
        for w in workers:
            instances[w.role.value] = instances.get(w.role.value, 0) + 1
        return RouterSnapshot(
            requests=dict(core.finished),
            in_flight=len(core.in_flight),
            threshold=core.threshold,
            threshold_changes=dict(counters.threshold_changes),
            egress_bytes=counters.egress_bytes,
            egress_bytes_per_s=counters.egress_rate,
            link_capacity_bytes_per_s=counters.capacity,
            link_capacity_samples=counters.capacity_samples,
            tcp_retransmitted_segments=counters.retransmitted,
            link_rtt_s=counters.rtt_s,
            queue_depth={
                (w.name, w.role.value): w.outstanding_prefills for w in workers if w.role.is_prefill
            },
            decode_assigned={
                w.name: w.assigned_decodes for w in workers if w.role is Role.PD_DECODE
            },
            instances=instances,
            role_changes=counters.role_changes,
            # Copies: the scrape renders them after the lock is let go.
            ttft=core.ttft.copy(),
            exposed_transfer={route: h.copy() for route, h in core.exposed_transfer.items()},
            prompt_tokens=core.prompt_tokens,
            cached_tokens=core.cached_tokens,
            prefix_moves=core.prefix_moves,
            decode_cache_local=core.decode_cache_local,
            retries=core.retries,
            resumed=core.resumed,
            rejected=core.rejected,
            saved_bytes=core.saved_bytes,
            cache_rules=dict(core.cache_rule.counts),
            down=sum(w.down for w in workers),
            prefix_cache={
                w.name: {f.name: getattr(w.stats.prefix_cache, f.name) for f in cache_fields}
                for w in workers
                if w.stats is not None and w.stats.HasField("prefix_cache")
            },
            cache_index=_index_fields(_index_stats(core)),
            lookup_time=core.lookup_time.copy() if core.config.prefix_cache.enabled else None,
            router_cpu_s=time.process_time(),
            wire_narrowed=dict(core.wire.narrowed),
        )


def _index_fields(stats: pb.CacheIndexStats) -> dict[str, int]:
    if not stats.enabled:
        return {}
    return {f.name: int(getattr(stats, f.name)) for f in pb.CacheIndexStats.DESCRIPTOR.fields}
