"""The dual-timescale scheduler (arXiv 2604.15039 §3.4.3): `Scheduler`, the short and the long
timescale over one traffic window.

- Short: every control period `observe_link` asks the caller to measure the PrfaaS link
  (`LinkObservation`) and hands it to the `ThresholdController` (policy/threshold_controller.py);
  a `ThresholdUpdate` is the t the next requests are routed with. A link with no capacity
  measured yet is not observed.
- Long: every `rebalance_period_s` `observe_stages` asks the caller to measure the stages
  (`StageObservation`, taken after this period's new t is applied) and hands it to the
  `Rebalancer` (policy/rebalancer.py); a `RoleChange` is one PD node to drain, switch and resume.
- Where they meet: when the change ends (`finished`: the node serves in its new role, or kept its
  old one, or no node could drain), the rebalancer's cooldown starts, and after a switch the
  controller re-solves t for the new cluster shape (`ThresholdController.resolve`).

Both policy objects read the same `TrafficWindow`, in which the caller records every routed
request. Measurements are callables, taken only when a timescale will use them (the simulator's
link integral, for one, is advanced by reading it). The caller carries the decisions out: the
router over gRPC (serving/router/control.py), the simulator on its simulated nodes
(sim/control.py). Pure: no clock of its own (`now` is passed in), no JAX, no gRPC.
"""

from __future__ import annotations

from collections.abc import Callable

from prfaas_jax.policy.live_model import ClusterShape, LiveProfiles, TrafficWindow
from prfaas_jax.policy.rebalancer import Rebalancer, RebalancerConfig, RoleChange, StageObservation
from prfaas_jax.policy.threshold_controller import (
    ControllerConfig,
    LinkObservation,
    ThresholdController,
    ThresholdUpdate,
)


class Scheduler:
    """t every control period, the PD split every `rebalance_period_s` (module docstring).

    Either timescale may be off (`controller` or `rebalancer` None); `now` is the clock reading
    at construction, from which the first rebalancer period counts.
    """

    def __init__(
        self,
        controller: ThresholdController | None,
        rebalancer: Rebalancer | None,
        *,
        rebalance_period_s: float,
        now: float,
    ) -> None:
        if rebalancer is not None and not rebalance_period_s > 0:
            raise ValueError(f"rebalance_period_s must be positive, got {rebalance_period_s}")
        self.controller, self.rebalancer = controller, rebalancer
        self.rebalance_period_s = rebalance_period_s
        self._next_rebalance = now + rebalance_period_s

    @classmethod
    def build(
        cls,
        profiles: LiveProfiles,
        traffic: TrafficWindow,
        shape: ClusterShape,
        threshold: float,
        *,
        controller: ControllerConfig | None,
        rebalancer: RebalancerConfig | None,
        rebalance_period_s: float,
        now: float,
    ) -> Scheduler:
        """Both timescales on one cluster's profiles and traffic window; a None config turns
        that timescale off. `shape` and `threshold` are the cluster's at the start."""
        return cls(
            None
            if controller is None
            else ThresholdController(controller, profiles, shape, traffic, threshold),
            None if rebalancer is None else Rebalancer(rebalancer, profiles, traffic),
            rebalance_period_s=rebalance_period_s,
            now=now,
        )

    @property
    def active(self) -> bool:
        """Whether either timescale runs (else the traffic window feeds nothing)."""
        return self.controller is not None or self.rebalancer is not None

    def observe_link(self, measure: Callable[[], LinkObservation]) -> ThresholdUpdate | None:
        """The short timescale, every control period: `measure()` the link (when t is
        controlled) and return the new t, if t changed."""
        if self.controller is None:
            return None
        obs = measure()
        if obs.capacity_bytes_per_s <= 0:
            return None
        return self.controller.observe(obs)

    def observe_stages(
        self, now: float, measure: Callable[[], StageObservation]
    ) -> RoleChange | None:
        """The long timescale: once a rebalancer period has passed, `measure()` the stages and
        return the role change to carry out, if any; None between periods (nothing measured)."""
        if self.rebalancer is None or now < self._next_rebalance:
            return None
        self._next_rebalance = now + self.rebalance_period_s
        return self.rebalancer.observe(measure())

    def finished(self, now: float, shape: ClusterShape | None) -> ThresholdUpdate | None:
        """The role change `observe_stages` returned has ended: applied, with the cluster now of
        `shape`, or not (`shape` None: no node drained in time, or none could). The cooldown
        starts; after a switch t is re-solved for the new shape, and the new t returned."""
        if self.rebalancer is None:
            raise RuntimeError("no role change can end without a rebalancer")
        self.rebalancer.finish(now)
        if shape is None or self.controller is None:
            return None
        return self.controller.resolve(now, shape)
