"""The router's per-request wire precision: `WireRule` (`[wire]`, policy/wire_choice.py).

With a `[wire]` section the control loop hands each period's `LinkObservation` — the PrfaaS
workers' egress counter and the capacity they learned, as the threshold controller gets them —
to an `AdaptiveWire`, and every request routed to PrfaaS asks it how its state crosses the link:
the cluster's `[link] precision` (the policy says native) or the narrowest option within the
recall budget while the egress runs hot. The choice travels in `PrefillRequest.wire_precision`
and comes back in the `RequestReport`; `narrowed` counts the prefills sent narrowed, by
precision (`prfaas_wire_narrowed_total`). Without `[wire]` every request crosses in
`[link] precision` and nothing is counted.
"""

from __future__ import annotations

from prfaas_jax.config import ModelConfig
from prfaas_jax.policy.routing import ClusterKind
from prfaas_jax.policy.threshold_controller import LinkObservation
from prfaas_jax.policy.wire_choice import AdaptiveWire, AdaptiveWireConfig
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.wire_precision import WirePrecision


class WireRule:
    """The precision of each attempt's state (module docstring); the caller serialises calls."""

    def __init__(self, config: AdaptiveWireConfig | None, link_precision: WirePrecision) -> None:
        self.policy = AdaptiveWire(config) if config is not None else None
        self.link_precision = link_precision
        self.narrowed: dict[str, int] = {}

    @property
    def utilization(self) -> float:
        """The egress utilisation the policy last saw (0.0 without `[wire]`)."""
        return self.policy.utilization if self.policy is not None else 0.0

    def observe(self, obs: LinkObservation) -> None:
        """One control period's link counters; skipped before a capacity is known."""
        if self.policy is not None and obs.capacity_bytes_per_s > 0:
            self.policy.observe(obs)

    def choose(self, cluster: ClusterKind, asked: str = "") -> str:
        """How an attempt prefilled in ``cluster`` ships its state: the request's ``asked``
        precision (GenerateRequest.wire_precision, not counted), an option's precision when it
        crosses the link narrowed (counted), else "" (the worker's `[link] precision`)."""
        if cluster is not ClusterKind.PRFAAS:
            return ""
        if asked:
            return asked
        if self.policy is None:
            return ""
        option = self.policy.choose()
        if option is None:
            return ""
        self.narrowed[option.precision] = self.narrowed.get(option.precision, 0) + 1
        return option.precision

    def precision(self, chosen: str) -> WirePrecision:
        """The encoding a choice of `choose` stands for."""
        return WirePrecision.parse(chosen) if chosen else self.link_precision

    def state_nbytes(self, cfg: ModelConfig, length: int, chosen: str) -> int:
        """The state's payload bytes for ``length`` tokens as the choice encodes them."""
        return state_nbytes(cfg, length, self.precision(chosen))
