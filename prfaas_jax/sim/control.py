"""The router's control loop inside the simulator: `SimControl`.

The simulated counterpart of `serving/router/control.py`, driving the same policy objects:

- every control period the `ThresholdController` gets a `LinkObservation` (cumulative bytes the
  link has sent, its capacity now, requests outstanding at PrfaaS); a `ThresholdUpdate` sets the
  threshold the next arrivals are routed with;
- every rebalancer period the `Rebalancer` gets a `StageObservation` (shape, t, link capacity,
  PD-prefill requests outstanding, requests decode nodes hold, decode slots); a `RoleChange` is
  carried out as drain → switch → resume: the least loaded node of the source role stops taking
  requests, switches `switch_s` after it is idle (or keeps its role after `drain_timeout_s`), the
  rebalancer is told (`finish`) and the controller re-solves t for the new shape (`resolve`).

Both read the `TrafficWindow` the simulator records every routed request in, as the router does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prfaas_jax.policy.live_model import TrafficWindow
from prfaas_jax.policy.rebalancer import Rebalancer, RoleChange, StageObservation
from prfaas_jax.policy.routing import Role
from prfaas_jax.policy.threshold_controller import LinkObservation, ThresholdController
from prfaas_jax.sim.cluster import DecodeInstance, PrefillInstance

if TYPE_CHECKING:
    from prfaas_jax.sim.simulator import Simulator

Node = PrefillInstance | DecodeInstance


class SimControl:
    """Threshold controller, rebalancer and role switches of one simulation (module docstring)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        config, deployment = sim.config, sim.deployment
        controller, rebalancer = config.controller, config.rebalancer
        self.traffic = TrafficWindow(
            controller.window if controller else 256,
            controller.rate_memory_s if controller else 60.0,
        )
        self.controller: ThresholdController | None = None
        if controller and deployment.use_controller and sim.prfaas and sim.pd_prefill:
            self.controller = ThresholdController(
                controller.config, config.profiles, sim.shape(), self.traffic, sim.threshold
            )
        self.rebalancer: Rebalancer | None = None
        if rebalancer and deployment.use_rebalancer:
            self.rebalancer = Rebalancer(rebalancer.config, config.profiles, self.traffic)
        self._next_rebalance = rebalancer.period_s if rebalancer else 0.0
        self._draining: list[tuple[Node, RoleChange, float]] = []
        active = self.controller is not None or self.rebalancer is not None
        # The window feeds the controller and the rebalancer only; without them, ticks only
        # sample the time series.
        self.records_traffic = active
        self.tick_s = config.router.control_period_s if active else config.bin_s

    def tick(self, now: float, prfaas_queue: int) -> None:
        sim = self.sim
        if self.controller is not None:
            link = sim.link
            observation = LinkObservation(
                now, int(link.sent_bytes), link.capacity_bytes_per_s, prfaas_queue
            )
            update = self.controller.observe(observation)
            if update is not None:
                sim.threshold = update.threshold
        rebalancer = sim.config.rebalancer
        if self.rebalancer is not None and rebalancer is not None and now >= self._next_rebalance:
            self._next_rebalance = now + rebalancer.period_s
            change = self.rebalancer.observe(self._stage_observation(now))
            if change is not None:
                self._drain(now, change)
        if self._draining:
            self._check_drains(now)

    def _stage_observation(self, now: float) -> StageObservation:
        sim = self.sim
        return StageObservation(
            now=now,
            shape=sim.shape(),
            threshold=sim.threshold,
            egress_bytes_per_s=sim.link.capacity_bytes_per_s,
            pd_prefill_queue=sum(i.outstanding for i in sim.pd_prefill),
            # What decode nodes hold (running or waiting for a slot), as the router reports it.
            decode_assigned=sum(d.held for d in sim.decoders),
            decode_slots=len(sim.decoders) * sim.config.profiles.decode_max_batch_size,
        )

    def _drain(self, now: float, change: RoleChange) -> None:
        assert self.rebalancer is not None and self.sim.config.rebalancer is not None
        sim = self.sim
        nodes: list[Node] = (
            [*sim.pd_prefill] if change.from_role is Role.PD_PREFILL else [*sim.decoders]
        )
        pool = [n for n in nodes if not n.draining]
        if not pool:
            self.rebalancer.finish(now)
            return
        node = min(pool, key=lambda n: n.outstanding if isinstance(n, PrefillInstance) else n.held)
        node.draining = True
        self._draining.append((node, change, now + sim.config.rebalancer.drain_timeout_s))
        sim.refresh_serving()

    def _check_drains(self, now: float) -> None:
        assert self.rebalancer is not None and self.sim.config.rebalancer is not None
        sim, switch_s = self.sim, self.sim.config.rebalancer.switch_s
        still = []
        for node, change, deadline in self._draining:
            if node.idle:
                sim.loop.schedule(now + switch_s, self._switch, (node, change))
            elif now >= deadline:
                node.draining = False
                self.rebalancer.finish(now)
                sim.result.role_change(now, change, applied=False)
            else:
                still.append((node, change, deadline))
        self._draining = still
        sim.refresh_serving()

    def _switch(self, job: tuple[Node, RoleChange]) -> None:
        assert self.rebalancer is not None
        node, change = job
        sim = self.sim
        now = sim.loop.now
        if isinstance(node, PrefillInstance):
            sim.pd_prefill.remove(node)
            sim.decoders.append(sim.decode_node(node.name))
        else:
            sim.decoders.remove(node)
            sim.pd_prefill.append(sim.pd_prefill_node(node.name))
        sim.refresh_serving()
        self.rebalancer.finish(now)
        sim.result.role_change(now, change, applied=True)
        if self.controller is not None:
            update = self.controller.resolve(now, sim.shape())
            if update is not None:
                sim.threshold = update.threshold
