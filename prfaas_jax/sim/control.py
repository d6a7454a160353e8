"""The router's control loop inside the simulator: `SimControl`, and `ControlledCluster` (what
it may ask of the simulated cluster).

The simulated counterpart of `serving/router/control.py`, driving the same dual-timescale
`Scheduler` (policy/scheduler.py):

- every control period the threshold controller gets a `LinkObservation` (cumulative bytes the
  link has sent, its capacity now, requests outstanding at PrfaaS); a `ThresholdUpdate` sets the
  threshold the next arrivals are routed with;
- every rebalancer period the rebalancer gets a `StageObservation` (shape, t, link capacity,
  PD-prefill requests outstanding, requests decode nodes hold, decode slots); a `RoleChange` is
  carried out as drain → switch → resume: the least loaded node of the source role stops taking
  requests, switches `switch_s` after it is idle (or keeps its role after `drain_timeout_s`), and
  the scheduler is told (`finished`: the rebalancer's cooldown starts and the controller
  re-solves t for the new shape).

Both read the `TrafficWindow` the simulator records every routed request in, as the router does.
The control reaches the cluster only through `ControlledCluster` (sim/simulator.py implements
it): it measures, sets t, and drains, resumes or switches a node; it never edits the cluster's
lists itself.
"""

from __future__ import annotations

from typing import Protocol

from prfaas_jax.policy.live_model import ClusterShape, TrafficWindow
from prfaas_jax.policy.rebalancer import RoleChange, StageObservation
from prfaas_jax.policy.routing import Role
from prfaas_jax.policy.scheduler import Scheduler
from prfaas_jax.policy.threshold_controller import LinkObservation, ThresholdUpdate
from prfaas_jax.sim.cluster import DecodeInstance, PrefillInstance
from prfaas_jax.sim.config import DeploymentSpec, SimConfig
from prfaas_jax.sim.events import EventLoop
from prfaas_jax.sim.result import RoleChangeRecord

Node = PrefillInstance | DecodeInstance


class ControlledCluster(Protocol):
    """The simulated cluster as its control loop sees it."""

    def shape(self) -> ClusterShape: ...

    def link_observation(self, now: float, prfaas_queue: int) -> LinkObservation: ...

    def stage_observation(self, now: float) -> StageObservation: ...

    def set_threshold(self, threshold: float) -> None:
        """Route the next arrivals with `threshold`."""

    def drain(self, role: Role) -> Node | None:
        """Stop sending requests to the least loaded serving node of `role` and return it
        (None: every node of the role already drains)."""

    def resume(self, node: Node) -> None:
        """A draining node takes requests again, in its old role."""

    def switch(self, node: Node) -> None:
        """A drained node serves in the other PD role from now on."""


class SimControl:
    """Threshold controller, rebalancer and role switches of one simulation (module docstring)."""

    def __init__(
        self,
        cluster: ControlledCluster,
        loop: EventLoop,
        config: SimConfig,
        deployment: DeploymentSpec,
    ) -> None:
        self.cluster, self.loop = cluster, loop
        controller, rebalancer = config.controller, config.rebalancer
        self.rebalancer_spec = rebalancer
        self.traffic = TrafficWindow(
            controller.window if controller else 256,
            controller.rate_memory_s if controller else 60.0,
        )
        shape = cluster.shape()
        use_controller = deployment.use_controller and shape.num_prfaas and shape.num_pd_prefill
        self.scheduler = Scheduler.build(
            config.profiles,
            self.traffic,
            shape,
            deployment.threshold,
            controller=controller.config if controller and use_controller else None,
            rebalancer=rebalancer.config if rebalancer and deployment.use_rebalancer else None,
            rebalance_period_s=rebalancer.period_s if rebalancer else 0.0,
            now=0.0,
        )
        self.controller, self.rebalancer = self.scheduler.controller, self.scheduler.rebalancer
        self._draining: list[tuple[Node, RoleChange, float]] = []
        self.role_changes: list[RoleChangeRecord] = []
        # The window feeds the controller and the rebalancer only; without them, ticks only
        # sample the time series.
        self.records_traffic = self.scheduler.active
        self.tick_s = config.router.control_period_s if self.scheduler.active else config.bin_s

    def tick(self, now: float, prfaas_queue: int) -> None:
        cluster, scheduler = self.cluster, self.scheduler
        self._set(scheduler.observe_link(lambda: cluster.link_observation(now, prfaas_queue)))
        change = scheduler.observe_stages(now, lambda: cluster.stage_observation(now))
        if change is not None:
            self._drain(now, change)
        if self._draining:
            self._check_drains(now)

    def _set(self, update: ThresholdUpdate | None) -> None:
        if update is not None:
            self.cluster.set_threshold(update.threshold)

    def _drain(self, now: float, change: RoleChange) -> None:
        assert self.rebalancer_spec is not None
        node = self.cluster.drain(change.from_role)
        if node is None:
            self.scheduler.finished(now, None)
            return
        self._draining.append((node, change, now + self.rebalancer_spec.drain_timeout_s))

    def _check_drains(self, now: float) -> None:
        assert self.rebalancer_spec is not None
        switch_s = self.rebalancer_spec.switch_s
        still = []
        for node, change, deadline in self._draining:
            if node.idle:
                self.loop.schedule(now + switch_s, self._switch, (node, change))
            elif now >= deadline:
                self.cluster.resume(node)
                self.scheduler.finished(now, None)
                self.role_changes.append(RoleChangeRecord(now, change, applied=False))
            else:
                still.append((node, change, deadline))
        self._draining = still

    def _switch(self, job: tuple[Node, RoleChange]) -> None:
        node, change = job
        now = self.loop.now
        self.cluster.switch(node)
        update = self.scheduler.finished(now, self.cluster.shape())
        self.role_changes.append(RoleChangeRecord(now, change, applied=True))
        self._set(update)
