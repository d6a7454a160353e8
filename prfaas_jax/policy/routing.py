"""Per-request routing (arXiv 2604.15039 §3.3, §3.4.3): `route(prompt_len, view, now) -> Decision`.

Also exposes the roles and clusters (`Role`, `ClusterKind`), the router's view of the instances
(`InstanceLoad`, `ClusterView`), why a decision went where it did (`RouteReason`),
`pick_decode`, the decode-instance choice, and `choose_abundant` with its `LinkView`, the
per-request choice of the cache rule.

Base rule, on the *incremental uncached* length l (prompt minus the prefix a cache already
holds): l > t → PrfaaS, l ≤ t → PD prefill. With cache hits, l_total the prompt length and
l_prfaas, l_pd the longest prefix cached in each cluster:

    bandwidth scarce    (each cluster's cache judged on its own)
        l_total − l_pd ≤ t  → PD-P (reusing l_pd)        else → PrfaaS (reusing l_prfaas)
    bandwidth abundant  (compute is scarce: use the best prefix anywhere)
        l_prefix = max(l_prfaas, l_pd)
        l_total − l_prefix ≤ t → PD-P  else → PrfaaS; the prefix moves across clusters when the
        instance holding it is in the other cluster (`Decision.prefix_source`)

Decode-aware (Dynamo's effective input length, llm-d's decode-first scheduling): the PD
cluster's decode workers keep prefix caches too (`ClusterView.decode`), and a prefix one of them
holds is as good a local prefix as a PD prefill instance's — it moves inside the cluster, never
across the link. So the local side's cached length is the best of (PD prefill instance, decode
worker): l_pd above is ``max(l_pd_prefill, l_decode)`` in both rules. A request that goes local
only because of a decode worker's prefix — its uncached length against the PD prefill caches
alone is above t — is decided with `RouteReason.DECODE_CACHE`: one request kept off the link.

Which of the two rules applies is chosen per request (`choose_abundant`): moving the prefix
pays when the link has room (utilisation under a bound) and carrying its state over the spare
capacity takes less time than recomputing the tokens the other cluster would otherwise
prefill again; otherwise the link is the scarce resource and each cluster keeps to its own.

PrfaaS queue guard (Dynamo's conditional disaggregation): a request bound for PrfaaS stays local
when every PrfaaS instance already has `prfaas_max_queue` requests queued, since a deep queue
means the remote cluster is lagging and the local prefill finishes sooner.

Within the chosen cluster the instance is the one with the least estimated work after this
request, queued tokens + (l_total − its cached prefix): cache affinity, weighed against load in
the same unit (tokens to prefill). Ties go to the earlier instance in the view. The prefix the
request reuses is taken from the instance holding it, so an instance picked by load fetches it
(`Decision.prefix_source`) and keeps it.

Hot-prefix replication (`ClusterView.replicate_prefixes`): the work of every instance is counted
as if it held that prefix already, since it will be copied there — queued tokens + (l_total −
the reused prefix), ties to an instance that holds it itself. A prefix most requests share then
spreads to a second instance as soon as its holder has more queued work than another instance,
and from there by load, instead of queueing on its holder until the queue outweighs recomputing
the prefix. (The simulator's caches are one pool per cluster, so there every instance of a
cluster holds what the cluster holds: replication is implicit.)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ClusterKind(enum.Enum):
    PRFAAS = "prfaas"
    PD = "pd"


class Role(enum.Enum):
    """What an instance does now. PrfaaS instances stay prefill-only; PD nodes may switch."""

    PRFAAS_PREFILL = "prfaas_prefill"
    PD_PREFILL = "pd_prefill"
    PD_DECODE = "pd_decode"

    @property
    def cluster(self) -> ClusterKind:
        return ClusterKind.PRFAAS if self is Role.PRFAAS_PREFILL else ClusterKind.PD

    @property
    def is_prefill(self) -> bool:
        return self is not Role.PD_DECODE


class RouteReason(enum.StrEnum):
    """Why `route` sent a request where it did."""

    THRESHOLD = "threshold"  # its uncached length against t
    QUEUE_GUARD = "queue_guard"  # bound for PrfaaS, kept local: every PrfaaS queue is full
    NO_PRFAAS = "no_prfaas"  # no PrfaaS instance can take it
    NO_PD_PREFILL = "no_pd_prefill"  # no PD prefill instance can take it
    # Local by the threshold only because a decode worker holds a longer prefix: kept off the link.
    DECODE_CACHE = "decode_cache"


@dataclass(frozen=True)
class InstanceLoad:
    """One prefill instance as the router sees it when a request arrives."""

    name: str
    queue_depth: int = 0  # requests waiting or running on it
    queued_tokens: int = 0  # uncached tokens those requests still have to prefill
    cached_len: int = 0  # the longest prefix of *this* request the instance has cached

    def __post_init__(self) -> None:
        if min(self.queue_depth, self.queued_tokens, self.cached_len) < 0:
            raise ValueError(f"instance {self.name!r}: loads and cached_len must be ≥ 0")


@dataclass(frozen=True)
class ClusterView:
    """The threshold, the guard and the prefill instances that may take a request now
    (draining instances are left out by the caller)."""

    threshold: float
    prfaas: tuple[InstanceLoad, ...]
    pd_prefill: tuple[InstanceLoad, ...]
    prfaas_max_queue: int = 4
    bandwidth_abundant: bool = False
    # Weigh every instance of the chosen cluster as holding the prefix the request will reuse:
    # it is copied to whichever instance is picked (hot-prefix replication, module docstring).
    replicate_prefixes: bool = False
    # The PD cluster's decode workers, each with its cached prefix of this request (loads unused):
    # a local prefix source like a PD prefill instance's (module docstring, decode-aware).
    decode: tuple[InstanceLoad, ...] = ()

    def __post_init__(self) -> None:
        if not self.pd_prefill and not self.prfaas:
            raise ValueError("a cluster view needs at least one prefill instance")
        if self.prfaas_max_queue < 1:
            raise ValueError(f"prfaas_max_queue must be ≥ 1, got {self.prfaas_max_queue}")


@dataclass(frozen=True)
class Decision:
    """Where a request is prefilled, and from which cached prefix."""

    cluster: ClusterKind
    instance: str
    prefix_source: str | None  # instance holding the reused prefix; None: nothing reused
    cached_len: int  # tokens of the prompt that are not recomputed
    uncached_len: int  # tokens the chosen instance prefills
    reason: RouteReason
    decided_at: float  # the caller's clock, for traces

    @property
    def moves_prefix(self) -> bool:
        """True when the reused prefix sits on another instance and must be moved first (across
        clusters only in the bandwidth-abundant case)."""
        return self.prefix_source is not None and self.prefix_source != self.instance


def _best_cached(instances: Sequence[InstanceLoad]) -> InstanceLoad | None:
    best = None
    for inst in instances:
        if best is None or inst.cached_len > best.cached_len:
            best = inst
    return best


def _least_work(
    instances: Sequence[InstanceLoad], prompt_len: int, movable: int = 0
) -> InstanceLoad:
    """The instance with the least queued + uncached tokens, counting a ``movable`` prefix as
    every instance's own; on a tie, one that holds the prefix itself (nothing to copy)."""

    def work(inst: InstanceLoad) -> tuple[int, bool]:
        own = min(inst.cached_len, prompt_len)
        return inst.queued_tokens + prompt_len - max(own, movable), own < movable

    return min(instances, key=work)


def route(prompt_len: int, view: ClusterView, now: float) -> Decision:
    """The paper's routing rule for a prompt of `prompt_len` tokens (module docstring)."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be ≥ 1, got {prompt_len}")
    # A prefix is never the whole prompt: the last token is always computed for its logits.
    cap = prompt_len - 1

    def decide(
        cluster: ClusterKind,
        pool: Sequence[InstanceLoad],
        prefix: InstanceLoad | None,
        why: RouteReason,
    ) -> Decision:
        movable = (
            min(prefix.cached_len, cap) if prefix is not None and view.replicate_prefixes else 0
        )
        target = _least_work(pool, prompt_len, movable)
        own = min(target.cached_len, cap)
        if prefix is None or own >= min(prefix.cached_len, cap):
            # Reuse the chosen instance's own prefix, if any and as long (nothing to move).
            prefix = target if own > 0 else None
        cached = 0 if prefix is None else min(prefix.cached_len, cap)
        source = None if prefix is None else prefix.name
        return Decision(cluster, target.name, source, cached, prompt_len - cached, why, now)

    # The local cluster's best prefix: a PD prefill instance's, or a decode worker's if longer.
    best_local = _best_cached([*view.pd_prefill, *view.decode])
    if not view.prfaas:
        return decide(ClusterKind.PD, view.pd_prefill, best_local, RouteReason.NO_PRFAAS)
    if not view.pd_prefill:
        best = _best_cached(view.prfaas)
        return decide(ClusterKind.PRFAAS, view.prfaas, best, RouteReason.NO_PD_PREFILL)

    best_prfaas, best_pd = _best_cached(view.prfaas), _best_cached(view.pd_prefill)
    assert best_prfaas is not None and best_pd is not None and best_local is not None
    l_prfaas, l_pd = min(best_prfaas.cached_len, cap), min(best_pd.cached_len, cap)
    l_local = min(best_local.cached_len, cap)
    if view.bandwidth_abundant:
        prefix = best_prfaas if l_prfaas > l_local else best_local
        goes_local = prompt_len - max(l_prfaas, l_local) <= view.threshold
        without_decode = prompt_len - max(l_prfaas, l_pd) <= view.threshold
        local_prefix = remote_prefix = prefix
    else:
        goes_local = prompt_len - l_local <= view.threshold
        without_decode = prompt_len - l_pd <= view.threshold
        local_prefix, remote_prefix = best_local, best_prfaas
    if goes_local:
        why = RouteReason.THRESHOLD if without_decode else RouteReason.DECODE_CACHE
        return decide(ClusterKind.PD, view.pd_prefill, local_prefix, why)
    if all(inst.queue_depth >= view.prfaas_max_queue for inst in view.prfaas):
        return decide(ClusterKind.PD, view.pd_prefill, best_local, RouteReason.QUEUE_GUARD)
    open_prfaas = [inst for inst in view.prfaas if inst.queue_depth < view.prfaas_max_queue]
    return decide(ClusterKind.PRFAAS, open_prfaas, remote_prefix, RouteReason.THRESHOLD)


@dataclass(frozen=True)
class DecodeLoad:
    """One decode instance: requests assigned to it (running or waiting) and its slots."""

    name: str
    assigned: int
    max_slots: int

    def __post_init__(self) -> None:
        if self.assigned < 0 or self.max_slots < 1:
            raise ValueError(f"decode instance {self.name!r}: need assigned ≥ 0, max_slots ≥ 1")


@dataclass(frozen=True)
class LinkView:
    """The inter-cluster link as the router knows it now."""

    capacity_bytes_per_s: float  # learned from the transfers (policy/link_capacity.py)
    utilization: float  # egress rate over capacity, recent
    latency_s: float = 0.0


def choose_abundant(
    *,
    move_bytes: float,
    recompute_s: float,
    link: LinkView,
    max_utilization: float,
) -> bool:
    """Whether the bandwidth-abundant rule should route this request: moving a cached prefix's
    ``move_bytes`` over the link's spare capacity (plus latency) beats ``recompute_s`` of
    prefill, and the link is below ``max_utilization``."""
    if move_bytes <= 0 or recompute_s <= 0 or link.capacity_bytes_per_s <= 0:
        return False
    if link.utilization >= max_utilization:
        return False
    spare = link.capacity_bytes_per_s * (1.0 - link.utilization)
    return move_bytes / spare + link.latency_s < recompute_s


def pick_decode(instances: Sequence[DecodeLoad]) -> str:
    """The decode instance with the lowest fill (assigned / slots); ties to the earlier one."""
    if not instances:
        raise ValueError("no decode instance can take a request")
    return min(instances, key=lambda d: d.assigned / d.max_slots).name
