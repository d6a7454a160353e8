"""Long-timescale role rebalancing (arXiv 2604.15039 §3.4.3): `Rebalancer`.

Also exposes `RebalancerConfig`, `StageObservation` (what the router measures) and
`RoleChange` (a PD node to convert, and why).

Eq. 8 asks the prefill stages to produce what decode consumes: Θ_prfaas + Θ_pd-p = Θ_pd-d. At
each observation the rebalancer evaluates the throughput model on the recent traffic (lengths
and output lengths from the `TrafficWindow`, the current t and link capacity) for the current
split N_p / N_d and takes the ratio

    r = (Θ_prfaas + Θ_pd-p) / Θ_pd-d     r < 1/imbalance: prefill-bound, r > imbalance: decode-bound

The model proposes; queues confirm, since the paper identifies the bottleneck "by monitoring
queue depth and utilization at each stage": a decode node becomes a prefill node only while the
PD-prefill queue holds at least `prefill_queue_per_node` requests per prefill node and decode
slots are less than `decode_fill` full; a prefill node becomes a decode node only while decode
slots are at least `decode_fill` full and the prefill queue is below that bar. A move must also
bring r closer to 1 (|log r| shrinks), and the same verdict must hold for `consecutive`
observations. Guardrails, as in Dynamo's planner: one node at a time, never below `min_prefill`
/ `min_decode`, nothing while a switch is in flight (`begin`/`finish` bracket the drain, switch
and resume the router carries out, from `observe` returning it to `finish`) and for
`cooldown_s` after one. PrfaaS nodes never change role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prfaas_jax.policy.live_model import ClusterShape, LiveProfiles, TrafficWindow, live_model
from prfaas_jax.policy.routing import Role


@dataclass(frozen=True)
class RebalancerConfig:
    imbalance: float = 2.0
    prefill_queue_per_node: float = 2.0
    decode_fill: float = 0.75
    consecutive: int = 2
    cooldown_s: float = 30.0
    min_prefill: int = 1
    min_decode: int = 1
    min_samples: int = 8

    def __post_init__(self) -> None:
        if not self.imbalance > 1:
            raise ValueError(f"imbalance must be > 1, got {self.imbalance}")
        if not (self.prefill_queue_per_node > 0 and 0 < self.decode_fill <= 1):
            raise ValueError("need prefill_queue_per_node > 0 and 0 < decode_fill ≤ 1")
        if self.consecutive < 1 or self.cooldown_s < 0 or self.min_samples < 1:
            raise ValueError("need consecutive ≥ 1, cooldown_s ≥ 0 and min_samples ≥ 1")
        if self.min_prefill < 0 or self.min_decode < 1:
            raise ValueError("need min_prefill ≥ 0 and min_decode ≥ 1")


@dataclass(frozen=True)
class StageObservation:
    now: float
    shape: ClusterShape
    threshold: float
    egress_bytes_per_s: float  # the link's capacity (the model's B_out)
    pd_prefill_queue: int  # requests waiting or running on PD prefill nodes
    decode_assigned: int  # requests decode nodes hold: in a slot or waiting for one
    decode_slots: int  # slots of all decode nodes


@dataclass(frozen=True)
class RoleChange:
    from_role: Role
    to_role: Role
    ratio: float  # (Θ_prfaas + Θ_pd-p) / Θ_pd-d before the move
    ratio_after: float  # the same after it
    at: float
    shape_after: ClusterShape


def _stage_ratio(
    profiles: LiveProfiles, traffic: TrafficWindow, obs: StageObservation, shape: ClusterShape
) -> float:
    model = live_model(profiles, shape, traffic, max(obs.egress_bytes_per_s, 1.0))
    if shape.num_prfaas == 0 and shape.num_pd_prefill == 0:
        return 0.0
    if shape.num_prfaas == 0:
        threshold = math.inf
    elif shape.num_pd_prefill == 0:
        threshold = -math.inf
    else:
        threshold = obs.threshold
    stages = model.evaluate(threshold, shape.num_pd_prefill, shape.num_pd_decode).stages
    prefill = (stages.prfaas or 0.0) + (stages.pd_prefill or 0.0)
    return prefill / stages.pd_decode


class Rebalancer:
    """Proposes one PD role change at a time (module docstring)."""

    def __init__(self, config: RebalancerConfig, profiles: LiveProfiles, traffic: TrafficWindow):
        self.config, self.profiles, self.traffic = config, profiles, traffic
        self._streak: tuple[Role, int] | None = None
        self._in_flight = False
        self._last_change = -math.inf
        self.history: list[RoleChange] = []

    @property
    def switching(self) -> bool:
        return self._in_flight

    def observe(self, obs: StageObservation) -> RoleChange | None:
        """A role change to carry out now, or None; after one, nothing more until `finish`."""
        cfg = self.config
        if self._in_flight or obs.now - self._last_change < cfg.cooldown_s:
            return None
        if len(self.traffic) < cfg.min_samples:
            return None
        shape = obs.shape
        ratio = _stage_ratio(self.profiles, self.traffic, obs, shape)
        per_node = obs.pd_prefill_queue / max(shape.num_pd_prefill, 1)
        fill = obs.decode_assigned / max(obs.decode_slots, 1)
        prefill_pressed = per_node >= cfg.prefill_queue_per_node
        decode_pressed = fill >= cfg.decode_fill
        verdict: Role | None = None  # the role a node should move *to*
        prefill_bound = ratio < 1 / cfg.imbalance and prefill_pressed and not decode_pressed
        decode_bound = ratio > cfg.imbalance and decode_pressed and not prefill_pressed
        if prefill_bound and shape.num_pd_decode > cfg.min_decode:
            verdict = Role.PD_PREFILL
        elif decode_bound and shape.num_pd_prefill > cfg.min_prefill:
            verdict = Role.PD_DECODE
        if verdict is None:
            self._streak = None
            return None
        after = shape.moved(1 if verdict is Role.PD_PREFILL else -1)
        ratio_after = _stage_ratio(self.profiles, self.traffic, obs, after)
        if not abs(math.log(max(ratio_after, 1e-12))) < abs(math.log(max(ratio, 1e-12))):
            self._streak = None
            return None
        count = self._streak[1] + 1 if self._streak and self._streak[0] is verdict else 1
        self._streak = (verdict, count)
        if count < cfg.consecutive:
            return None
        self._streak = None
        source = Role.PD_DECODE if verdict is Role.PD_PREFILL else Role.PD_PREFILL
        change = RoleChange(source, verdict, ratio, ratio_after, obs.now, after)
        self.history.append(change)
        self._in_flight = True
        return change

    def finish(self, now: float) -> None:
        """The node serves in its new role (or the switch was abandoned); cooldown starts."""
        self._in_flight, self._last_change = False, now
