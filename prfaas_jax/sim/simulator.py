"""The discrete-event cluster simulator: `Simulator(config, deployment).run() -> SimResult`.

A request's life, with the router's policy objects from `prfaas_jax/policy/` deciding, unchanged:

    arrive ── prefix-cache match in each cluster ── `route(prompt_len, ClusterView, now)` picks the
      │       cluster and instance, `pick_decode` the decode instance; the `TrafficWindow` records
      │       the request, as the gRPC router does
      ├─ PrfaaS: [prefix moves over the link if it sits in the other cluster] ─ FIFO prefill on
      │    H200 ─ state over the shared link (layer-wise: the first (K−1)/K of it while the prefill
      │    runs, the last chunk after) ─ first token
      └─ PD prefill: FIFO prefill on the local hardware ─ RDMA to decode (S_kv / rdma_gbps, never
           contended) ─ first token
    first token ── decode slot (BS_max per instance, L_out steps) ── done

Prefix caches (`[cache]`): one `CacheModel` per cluster, with a disk tier below host memory when
configured (a prefix read back from disk delays the prefill by its KV bytes over
`disk_gb_per_s`). With `decode_blocks`, the decode workers keep the states they receive in a
pool of their own; decode-aware routing (`[router] decode_aware`) hands its prefix to `route` as
`ClusterView.decode`, so a request kept local by it (`RouteReason.DECODE_CACHE`) is counted.

TTFT is arrival → first token: queueing, prefill and the state's arrival at the decode instance.
KV shipped for an offloaded request is S_kv(l) less the length-dependent part of the prefix the
PD cluster already holds, S_kv(c_pd) − S_kv(0): the recurrent state always travels.

Every control period a tick runs the router's control loop (`SimControl`: threshold controller,
rebalancer, role switches) and, every `bin_s`, samples the time series (`SimResult`). The
simulator is the `ControlledCluster` the control loop drives: it measures the link and the
stages, sets t, and drains, resumes or switches a node when the control asks.
"""

from __future__ import annotations

from collections.abc import Callable

from prfaas_jax.policy.live_model import ClusterShape
from prfaas_jax.policy.rebalancer import StageObservation
from prfaas_jax.policy.routing import (
    ClusterKind,
    ClusterView,
    InstanceLoad,
    Role,
    RouteReason,
    pick_decode,
    route,
)
from prfaas_jax.policy.threshold_controller import LinkObservation
from prfaas_jax.policy.wire_choice import AdaptiveWire
from prfaas_jax.sim.cache_model import CacheModel
from prfaas_jax.sim.cluster import DecodeInstance, LinkModel, PrefillInstance
from prfaas_jax.sim.config import DeploymentSpec, SimConfig
from prfaas_jax.sim.control import Node, SimControl
from prfaas_jax.sim.events import EventLoop
from prfaas_jax.sim.result import Sample, SimResult
from prfaas_jax.sim.workload import Request, generate_requests

BYTES_PER_MIB = 2**20
PROGRESS_EVERY = 1 << 16  # arrivals between progress callbacks


class Simulator:
    """One deployment under one workload (module docstring); `rate` overrides the workload's."""

    def __init__(
        self,
        config: SimConfig,
        deployment: DeploymentSpec,
        *,
        rate: float | None = None,
        stop_at_last_arrival: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.config, self.deployment = config, deployment
        self.loop = loop = EventLoop()
        self.stop_at_last_arrival, self.progress = stop_at_last_arrival, progress
        profiles = config.profiles
        self.kv_mib = profiles.kv_size_mib
        self.wire = None
        if deployment.adaptive_wire:
            if config.wire is None:
                raise ValueError(f"deployment {deployment.name}: adaptive_wire needs a [wire]")
            self.wire = AdaptiveWire(config.wire)
        self.threshold = deployment.threshold
        self.prfaas = [
            PrefillInstance(
                f"prfaas-{i}",
                Role.PRFAAS_PREFILL,
                loop,
                profiles.prfaas_prefill_s,
                self._prefilled,
                self._prefill_started,
            )
            for i in range(deployment.num_prfaas)
        ]
        self.pd_prefill = [
            self.pd_prefill_node(f"pd-{i}") for i in range(deployment.num_pd_prefill)
        ]
        self.decoders = [
            self.decode_node(f"pd-{deployment.num_pd_prefill + i}")
            for i in range(deployment.num_pd_decode)
        ]
        self.link = LinkModel(loop, config.link.schedule)
        self.ingress = LinkModel(loop, config.link.schedule)  # PD → PrfaaS prefix moves
        self.caches = None
        self.decode_cache: CacheModel | None = None
        if config.cache is not None:
            c = config.cache
            self.caches = {
                ClusterKind.PRFAAS: CacheModel(c.prfaas_blocks, c.block_len, c.prfaas_disk_blocks),
                ClusterKind.PD: CacheModel(c.pd_blocks, c.block_len, c.pd_disk_blocks),
            }
            if c.decode_blocks:
                self.decode_cache = CacheModel(c.decode_blocks, c.block_len)
        self.abundant = (
            config.router.bandwidth_abundant
            if deployment.bandwidth_abundant is None
            else deployment.bandwidth_abundant
        )
        self.max_queue = deployment.prfaas_max_queue or config.router.prfaas_max_queue
        self.refresh_serving()
        self.control = SimControl(self, loop, config, deployment)
        self.controller, self.rebalancer = self.control.controller, self.control.rebalancer
        num = min(config.workload.requests, len(config.workload.trace) or config.workload.requests)
        self.result = SimResult.empty(deployment, num)
        self._requests = generate_requests(config.workload, rate=rate)
        self.n_arrived = self.n_first = self.n_finished = 0
        self._arrivals_done = False
        self._next_bin = 0.0

    # --- construction and shape -----------------------------------------------------------

    def pd_prefill_node(self, name: str) -> PrefillInstance:
        return PrefillInstance(
            name, Role.PD_PREFILL, self.loop, self.config.profiles.pd_prefill_s, self._prefilled
        )

    def decode_node(self, name: str) -> DecodeInstance:
        profiles = self.config.profiles
        return DecodeInstance(
            name,
            self.loop,
            profiles.decode_max_batch_size,
            profiles.decode_step_s,
            self.config.decode_fixed_fraction,
        )

    def refresh_serving(self) -> None:
        self._serving_prfaas = [i for i in self.prfaas if not i.draining]
        self._serving_pd = [i for i in self.pd_prefill if not i.draining]
        self._serving_decode = [d for d in self.decoders if not d.draining]
        self._by_name = {i.name: i for i in (*self.prfaas, *self.pd_prefill)}
        self._decode_by_name = {d.name: d for d in self.decoders}

    def shape(self) -> ClusterShape:
        return ClusterShape(len(self.prfaas), len(self.pd_prefill), len(self.decoders))

    # --- what the control loop sees and does (`ControlledCluster`) -------------------------

    def link_observation(self, now: float, prfaas_queue: int) -> LinkObservation:
        link = self.link
        return LinkObservation(now, int(link.sent_bytes), link.capacity_bytes_per_s, prfaas_queue)

    def stage_observation(self, now: float) -> StageObservation:
        return StageObservation(
            now=now,
            shape=self.shape(),
            threshold=self.threshold,
            egress_bytes_per_s=self.link.capacity_bytes_per_s,
            pd_prefill_queue=sum(i.outstanding for i in self.pd_prefill),
            # What decode nodes hold (running or waiting for a slot), as the router reports it.
            decode_assigned=sum(d.held for d in self.decoders),
            decode_slots=len(self.decoders) * self.config.profiles.decode_max_batch_size,
        )

    def set_threshold(self, threshold: float) -> None:
        self.threshold = threshold

    def drain(self, role: Role) -> Node | None:
        nodes: list[Node] = [*self.pd_prefill] if role is Role.PD_PREFILL else [*self.decoders]
        pool = [n for n in nodes if not n.draining]
        if not pool:
            return None
        node = min(pool, key=lambda n: n.outstanding if isinstance(n, PrefillInstance) else n.held)
        node.draining = True
        self.refresh_serving()
        return node

    def resume(self, node: Node) -> None:
        node.draining = False
        self.refresh_serving()

    def switch(self, node: Node) -> None:
        if isinstance(node, PrefillInstance):
            self.pd_prefill.remove(node)
            self.decoders.append(self.decode_node(node.name))
        else:
            self.decoders.remove(node)
            self.pd_prefill.append(self.pd_prefill_node(node.name))
        self.refresh_serving()

    # --- running ----------------------------------------------------------------------------

    def run(self) -> SimResult:
        self._schedule_next_arrival()
        self.loop.schedule(0.0, self._tick)
        self.loop.run()
        now = self.loop.now
        caches = self.caches or {}
        self.result.close(
            self._sample(now, sum(i.outstanding for i in self.prfaas)),
            num_arrived=self.n_arrived,
            num_finished=self.n_finished,
            backlog=self.backlog(),
            threshold_updates=self.controller.history if self.controller is not None else (),
            role_changes=self.control.role_changes,
            cache_hit_rate={
                kind.value: cache.hit_tokens / cache.lookup_tokens if cache.lookup_tokens else 0.0
                for kind, cache in caches.items()
            },
        )
        return self.result

    def _schedule_next_arrival(self) -> None:
        request = next(self._requests, None)
        if request is None:
            self._arrivals_done = True
            if self.stop_at_last_arrival:
                self.loop.stop()
        else:
            self.loop.schedule(request.arrival, self._arrive, request)

    def _arrive(self, req: Request) -> None:
        now = self.loop.now
        self.n_arrived += 1
        if self.progress is not None and self.n_arrived % PROGRESS_EVERY == 0:
            self.progress(self.n_arrived)
        cached_prfaas = cached_pd = cached_decode = 0
        if self.caches is not None and req.hash_ids:
            cached_prfaas = self.caches[ClusterKind.PRFAAS].match(req.hash_ids, req.prompt_len)
            cached_pd = self.caches[ClusterKind.PD].match(req.hash_ids, req.prompt_len)
            if self.decode_cache is not None:
                cached_decode = self.decode_cache.match(req.hash_ids, req.prompt_len)
        # What the decode side holds of the prompt: the increment a transfer leaves out.
        req.cached_pd = cached_pd if self.decode_cache is None else cached_decode
        prfaas = self._serving_prfaas or self.prfaas
        pd_prefill = self._serving_pd or ([] if prfaas else self.pd_prefill)
        decoders = self._serving_decode or self.decoders
        decode_view = ()
        if self.config.router.decode_aware and cached_decode:
            decode_view = tuple(InstanceLoad(d.name, cached_len=cached_decode) for d in decoders)
        view = ClusterView(
            self.threshold,
            tuple([i.load(cached_prfaas) for i in prfaas]),
            tuple([i.load(cached_pd) for i in pd_prefill]),
            prfaas_max_queue=self.max_queue,
            bandwidth_abundant=self.abundant,
            decode=decode_view,
        )
        decision = route(req.prompt_len, view, now)
        decoder = self._decode_by_name[pick_decode([d.load() for d in decoders])]
        inst = self._by_name[decision.instance]
        req.prefill, req.decode = inst, decoder
        req.uncached_len = decision.uncached_len
        req.offloaded = decision.cluster is ClusterKind.PRFAAS
        inst.assign(decision.uncached_len)
        decoder.assigned += 1
        if self.control.records_traffic:
            self.control.traffic.record(now, decision.uncached_len, req.output_len)
        self.result.routed(req, now)
        source = decision.prefix_source
        from_decode = source in self._decode_by_name
        source_cluster = ClusterKind.PD if from_decode else None
        if source is not None and not from_decode:
            source_cluster = self._by_name[source].role.cluster
        disk_tokens = 0
        if self.caches is not None and source is not None and not from_decode:
            disk_tokens = min(self.caches[source_cluster].last_disk_tokens, decision.cached_len)
        self.result.cached(
            req.rid, decision.cached_len, disk_tokens, decision.reason is RouteReason.DECODE_CACHE
        )
        job = (req, decision.cached_len)
        if source is not None and source_cluster is not decision.cluster:
            # The prefix is reused from the other cluster: it crosses the link first.
            link = self.ingress if req.offloaded else self.link
            moved = self.kv_mib(decision.cached_len) * BYTES_PER_MIB
            link.send(moved, self._submit_prefill, job)
        elif disk_tokens:
            # Read back from the disk tier first (its KV bytes at the disk's rate).
            assert self.config.cache is not None
            read_s = (
                self.kv_mib(disk_tokens) * BYTES_PER_MIB / (self.config.cache.disk_gb_per_s * 1e9)
            )
            self.loop.schedule(now + read_s, self._submit_prefill, job)
        else:
            self._submit_prefill(job)
        self._schedule_next_arrival()

    def _submit_prefill(self, job: tuple[Request, int]) -> None:
        req, cached_len = job
        req.prefill.submit(req, req.prompt_len, cached_len)

    def _shipped_bytes(self, req: Request) -> float:
        reused = self.kv_mib(req.cached_pd) - self.kv_mib(0) if req.cached_pd else 0.0
        return (self.kv_mib(req.prompt_len) - reused) * BYTES_PER_MIB

    def _prefill_started(self, req: Request, service_s: float) -> None:
        req.kv_bytes = self._shipped_bytes(req)
        narrow = self.wire.choose() if self.wire is not None else None
        if narrow is not None:  # the link runs hot: this state crosses narrowed
            req.kv_bytes *= narrow.byte_ratio
            req.recall_loss = narrow.recall_loss
        link = self.config.link
        if link.layerwise and link.chunks > 1:
            self.link.send(req.kv_bytes * (link.chunks - 1) / link.chunks, self._body_sent, req)
        else:
            req.body_done = True

    def _body_sent(self, req: Request) -> None:
        req.body_done = True
        if req.prefill_done:
            self._send_tail(req)

    def _send_tail(self, req: Request) -> None:
        link = self.config.link
        chunks = link.chunks if link.layerwise else 1
        self.link.send(req.kv_bytes / chunks, self._delivered, req)

    def _delivered(self, req: Request) -> None:
        """The state's last byte left the link; decode has it `latency_s` + `handoff_s` later."""
        delay = self.config.link.one_way_s + self.config.link.handoff_s
        if delay > 0:
            self.loop.schedule(self.loop.now + delay, self._first_token, req)
        else:
            self._first_token(req)

    def _prefilled(self, req: Request) -> None:
        req.prefill.release(req.uncached_len)
        req.prefill_done, req.prefill_end = True, self.loop.now
        if self.caches is not None and req.hash_ids:
            kind = ClusterKind.PRFAAS if req.offloaded else ClusterKind.PD
            self.caches[kind].insert(req.hash_ids, req.prompt_len)
        if req.offloaded:
            if req.body_done:
                self._send_tail(req)
            return
        req.kv_bytes = self.kv_mib(req.prompt_len) * BYTES_PER_MIB
        link = self.config.link
        hop_s = req.kv_bytes / (link.rdma_gbps * 1e9 / 8) + link.handoff_s
        self.loop.schedule(self.loop.now + hop_s, self._first_token, req)

    def _first_token(self, req: Request) -> None:
        self.n_first += 1
        req.first_token = self.loop.now
        if req.offloaded and self.caches is not None and req.hash_ids:
            # The decode side's pool keeps the state it received.
            pool = self.caches[ClusterKind.PD] if self.decode_cache is None else self.decode_cache
            pool.insert(req.hash_ids, req.prompt_len)
        req.decode.submit(req.output_len, self._finished, req)

    def _finished(self, req: Request) -> None:
        self.n_finished += 1
        req.decode.assigned -= 1
        self.result.completed(req, self.loop.now)

    # --- accounting and ticks ------------------------------------------------------------

    def backlog(self) -> int:
        """Requests waiting anywhere: for a prefill, on a link, for a decode slot."""
        in_prefill = sum(i.server.current is not None for i in (*self.prfaas, *self.pd_prefill))
        waiting_decode = sum(d.num_waiting for d in self.decoders)
        return self.n_arrived - self.n_first - in_prefill + waiting_decode

    def _sample(self, now: float, prfaas_queue: int) -> Sample:
        return Sample(
            time_s=now,
            sent_bytes=self.link.sent_bytes,
            offered_bytes=self.link.offered_bytes,
            capacity_gbps=self.link.capacity_bytes_per_s * 8 / 1e9,
            threshold=self.threshold,
            prfaas_queue=prfaas_queue,
            pd_prefill_queue=sum(i.outstanding for i in self.pd_prefill),
            decode_waiting=sum(d.num_waiting for d in self.decoders),
            num_pd_prefill=len(self.pd_prefill),
            num_pd_decode=len(self.decoders),
        )

    def _tick(self, _: object = None) -> None:
        now = self.loop.now
        prfaas_queue = sum(i.outstanding for i in self.prfaas)
        self.control.tick(now, prfaas_queue)
        if self.wire is not None:
            self.wire.observe(self.link_observation(now, prfaas_queue))
        if now >= self._next_bin:
            self._next_bin = now + self.config.bin_s
            self.result.sample(self._sample(now, prfaas_queue))
        if not (self._arrivals_done and self.n_finished == self.n_arrived):
            # The wire policy observes the link every control period, as the controller does.
            tick_s = self.control.tick_s
            if self.wire is not None:
                tick_s = min(tick_s, self.config.router.control_period_s)
            self.loop.schedule(now + tick_s, self._tick)
