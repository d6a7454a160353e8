"""The router's control loop: `RouterControl` (the process entry is serving/router/main.py).

Every `control_period_s` the loop polls each worker's `GetStats`, sums the PrfaaS workers'
link counters (egress bytes, the capacity each learned from its own transfers, the kernel's TCP
segment counters under `--netns`) and hands the dual-timescale `Scheduler`
(policy/scheduler.py) what it watches: a `LinkObservation` each period for the threshold
controller (a new t takes effect for the next request) and, with `[wire]`, for the adaptive
wire precision (serving/router/wire_rule.py), a `StageObservation` every
`rebalancer.period_s` for the rebalancer. A role change is carried out on its own thread as
drain → switch → resume: the node stops receiving requests, the thread waits until the router
has no request on it (up to `drain_timeout_s`, else the change is abandoned and the node resumes
its old role), sends `SetRole` (retried while the worker still finishes its last stream), then
routes to the node in its new role and tells the scheduler, whose controller re-solves t for the
new shape. The loop keeps its counters
in a `ControlCounters`; `router_stats` and `snapshot` render them with the core's for `GetStats`
and the Prometheus endpoint (serving/router/report.py).

Liveness: a worker whose `GetStats` is refused (UNAVAILABLE) is taken out of routing, and put
back when it answers again. When each worker last answered is kept on its handle: the stall
watch of an attempt whose prefill is still running counts it as the attempt's sign of life
(serving/router/core.py). When the launcher restarts a dead worker it rewrites the workers
file (`--workers`); the loop notices the change and connects to the new address.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import statistics
import threading
import time

import grpc

from prfaas_jax.policy.live_model import ClusterShape, LiveProfiles
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.rebalancer import RoleChange, StageObservation
from prfaas_jax.policy.routing import Role
from prfaas_jax.policy.scheduler import Scheduler
from prfaas_jax.policy.threshold_controller import LinkObservation
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.router.core import RouterCore
from prfaas_jax.serving.router.handles import WorkerHandle, kv_size_profile, one_way_delay_s
from prfaas_jax.serving.router.metrics import RouterSnapshot
from prfaas_jax.serving.router.report import ControlCounters, router_snapshot, router_stats
from prfaas_jax.serving.transport.messages import role_to_proto

log = logging.getLogger("prfaas.router")
RATE_WINDOW_S = 2.0
SET_ROLE_TIMEOUT_S = 600.0


class RouterControl:
    def __init__(self, core: RouterCore, workers_file: str | None = None) -> None:
        self.core = core
        # The launcher rewrites this listing when it restarts a worker (new address).
        self._workers_file, self._workers_mtime = workers_file, 0.0
        config = core.config
        profiles = LiveProfiles(
            prfaas_prefill_s=Profile.polynomial(config.profile.prfaas_prefill_s),
            pd_prefill_s=Profile.polynomial(config.profile.pd_prefill_s),
            kv_size_mib=kv_size_profile(core.cfg, config.engine.max_len),
            decode_max_batch_size=config.engine.max_slots,
            decode_step_s=config.profile.decode_step_s,
        )
        self.scheduler = Scheduler.build(
            profiles,
            core.traffic,
            self.shape(),
            core.threshold,
            controller=config.controller_config() if config.controller.enabled else None,
            # Mixed PD instances have no prefill role to trade for a decode one.
            rebalancer=config.rebalancer.config
            if config.rebalancer.enabled and not config.instances.mixed
            else None,
            rebalance_period_s=config.rebalancer.period_s,
            now=time.monotonic(),
        )
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self.counters = ControlCounters()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-control", daemon=True)

    def shape(self) -> ClusterShape:
        roles = [w.role for w in self.core.workers.values()]
        # Mixed PD instances prefill too: the throughput model sees each as a PD prefill node.
        local = Role.PD_DECODE if self.core.config.instances.mixed else Role.PD_PREFILL
        return ClusterShape(
            roles.count(Role.PRFAAS_PREFILL),
            roles.count(local),
            roles.count(Role.PD_DECODE),
        )

    # --- the loop -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        period = self.core.config.router.control_period_s
        while not self._stop.wait(period):
            try:
                self.step(time.monotonic())
            except Exception:  # keep controlling; a bad period must not stop the router
                log.exception("control step failed")

    def _poll(self) -> None:
        """Every worker's stats; one that refuses connections is taken out of routing, one
        that answers (again) is put back."""
        for worker in list(self.core.workers.values()):
            try:
                stats = worker.control.GetStats(pb.GetStatsRequest(), timeout=1.0)
            except grpc.RpcError as err:
                log.warning("stats of %s: %s", worker.name, err.code().name)
                if err.code() is grpc.StatusCode.UNAVAILABLE:
                    with self.core.lock:
                        worker.down = True
                continue
            with self.core.lock:
                worker.stats, worker.answered_at = stats, time.monotonic()
                if worker.down:
                    log.info("%s answers again: routing to it", worker.name)
                worker.down = False

    def _reload_workers(self) -> None:
        """Adopt the launcher's new listing when it changed (a restarted worker)."""
        if self._workers_file is None:
            return
        try:
            mtime = os.stat(self._workers_file).st_mtime
            if mtime == self._workers_mtime:
                return
            listing = read_workers(self._workers_file)
        except (OSError, ValueError, KeyError) as err:
            log.warning("cannot read %s: %s", self._workers_file, err)
            return
        self._workers_mtime = mtime
        for name in self.core.update_workers(listing):
            log.info("%s is at %s now", name, listing[name][0])

    def step(self, now: float) -> None:
        self._reload_workers()
        self._poll()
        core = self.core
        with core.lock:
            prfaas = [w for w in core.workers.values() if w.role is Role.PRFAAS_PREFILL]
            egress = sum(w.stats.egress_bytes for w in prfaas if w.stats is not None)
            capacity, learned_from = self._link_capacity(prfaas)
            counted = [
                w.stats.link for w in prfaas if w.stats is not None and w.stats.link.tcp_counted
            ]
            out_segments = sum(link.tcp_out_segments for link in counted)
            retransmitted = sum(link.tcp_retransmitted_segments for link in counted)
            links = [w.stats.link for w in prfaas if w.stats is not None]
            rtts = [link.measured_rtt_s for link in links if link.measured_rtt_s > 0]
            self.counters.rtt_s = sum(rtts) / len(rtts) if rtts else 0.0
            self.counters.data_retransmitted = sum(
                link.data_retransmitted_segments for link in links
            )
            prfaas_queue = sum(w.outstanding_prefills for w in prfaas)
            self._samples.append((now, egress))
            while now - self._samples[0][0] > RATE_WINDOW_S:
                self._samples.popleft()
            (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
            self.counters.egress_bytes, self.counters.capacity = egress, capacity
            self.counters.capacity_samples, self.counters.retransmitted = (
                learned_from,
                retransmitted,
            )
            self.counters.egress_rate = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
            if capacity > 0:  # what the per-request cache rule weighs (router/cache_rule.py)
                utilization = self.counters.egress_rate / capacity
                core.link = dataclasses.replace(
                    core.link, capacity_bytes_per_s=capacity, utilization=utilization
                )
            if rtts:  # the delay as measured (else the configured one stays)
                delays = [one_way_delay_s(link) for link in links if link.measured_rtt_s > 0]
                core.link = dataclasses.replace(core.link, latency_s=statistics.fmean(delays))
        observation = LinkObservation(
            now, egress, capacity, prfaas_queue, out_segments, retransmitted
        )
        with core.lock:  # [wire]'s policy sees what the threshold controller sees
            core.wire.observe(observation)
        scheduler = self.scheduler
        update = scheduler.observe_link(lambda: observation)
        if update is not None:
            self._apply_threshold(update.threshold, update.reason)
        change = scheduler.observe_stages(now, lambda: self._stage_observation(now, capacity))
        if change is not None:
            threading.Thread(target=self._switch, args=(change,), daemon=True).start()

    def _link_capacity(self, prfaas: list[WorkerHandle]) -> tuple[float, int]:
        """``(bytes/s, transfers)``: the PrfaaS link's capacity, summed over its workers, each
        the rate its own transfers got (serving/worker/prefill.py) — the configured
        `[link] bandwidth_mbps` share for a worker that has timed none lately — and how many
        transfers it was learned from. The shaper's settings are never read."""
        config = self.core.config
        nominal = config.link.bandwidth_bytes_per_s / max(config.instances.prfaas_prefill, 1)
        capacity, samples = 0.0, 0
        for worker in prfaas:
            link = worker.stats.link if worker.stats is not None else None
            if link is not None and link.learned_bytes_per_s > 0:
                capacity += link.learned_bytes_per_s
                samples += link.learned_samples
            else:
                capacity += nominal
        return capacity, samples

    def _apply_threshold(self, threshold: float, reason: str) -> None:
        with self.core.lock:
            log.info("threshold %.0f → %.0f (%s)", self.core.threshold, threshold, reason)
            self.core.threshold = threshold
            changes = self.counters.threshold_changes
            changes[reason] = changes.get(reason, 0) + 1
            self.counters.last_reason = reason

    def _stage_observation(self, now: float, capacity: float) -> StageObservation:
        core = self.core
        with core.lock:
            workers = list(core.workers.values())
            decoders = [w for w in workers if w.role is Role.PD_DECODE]
            return StageObservation(
                now=now,
                shape=self.shape(),
                threshold=core.threshold,
                egress_bytes_per_s=capacity,
                pd_prefill_queue=sum(
                    w.outstanding_prefills for w in workers if w.role is Role.PD_PREFILL
                ),
                # What decode nodes hold (running or waiting for a slot), not what the router
                # has assigned to them: those requests may still wait for their prefill.
                decode_assigned=sum(
                    w.stats.active_slots + w.stats.queue_depth for w in decoders if w.stats
                ),
                decode_slots=len(decoders) * core.config.engine.max_slots,
            )

    # --- drain, switch, resume ------------------------------------------------------------

    def _switch(self, change: RoleChange) -> None:
        core, timeout = self.core, self.core.config.rebalancer.drain_timeout_s
        with core.lock:
            candidates = core.serving(change.from_role)
            if not candidates:
                self.scheduler.finished(time.monotonic(), None)
                return
            node = min(candidates, key=lambda w: w.outstanding_prefills + w.assigned_decodes)
            node.draining_to = change.to_role
        log.info("draining %s: %s → %s", node.name, change.from_role.value, change.to_role.value)
        deadline = time.monotonic() + timeout
        switched = False
        try:
            while time.monotonic() < deadline and not switched:
                with core.lock:
                    idle = node.idle
                if idle:
                    switched = self._set_role(node, change.to_role)
                else:
                    time.sleep(0.05)
        except grpc.RpcError as err:
            log.warning("SetRole on %s failed: %s", node.name, err.details())
        finally:
            with core.lock:
                if switched:
                    node.role = change.to_role
                    self.counters.role_changes += 1
                node.draining_to = None
            update = self.scheduler.finished(time.monotonic(), self.shape() if switched else None)
            log.info("%s %s", node.name, f"now {node.role.value}" if switched else "kept its role")
        if update is not None:
            self._apply_threshold(update.threshold, update.reason)

    def _set_role(self, node: WorkerHandle, role: Role) -> bool:
        """True once the node switched; False while it still closes its last stream."""
        request = pb.SetRoleRequest(role=role_to_proto(role))
        try:
            # Generous: a node that never had this role builds and warms its engine now.
            node.control.SetRole(request, timeout=SET_ROLE_TIMEOUT_S)
            return True
        except grpc.RpcError as err:
            if err.code() is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
            time.sleep(0.05)
            return False

    # --- reporting (serving/router/report.py) ---------------------------------------------

    def router_stats(self) -> pb.RouterStats:
        return router_stats(self.core, self.counters)

    def snapshot(self) -> RouterSnapshot:
        return router_snapshot(self.core, self.counters)


def read_workers(path: str) -> dict[str, tuple[str, Role]]:
    """The launcher's listing {name: {address, role, …}} as {name: (address, role)}."""
    with open(path) as fh:
        listing = json.load(fh)
    return {name: (w["address"], Role(w["role"])) for name, w in listing.items()}
