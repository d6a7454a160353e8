"""Adaptive wire precision: `AdaptiveWire` picks, per offloaded request, the precision its state
crosses the inter-cluster link in; `narrowest_within(options, budget)` and `narrowing(...)`
are its two rules. Also `WireOption` and `AdaptiveWireConfig`.

The state crosses in ``native`` while the link has room. When the PrfaaS egress nears the
link's capacity — utilisation u (egress rate over the last ``window_s`` / capacity, measured as
the threshold controller measures it: policy/threshold_controller.py) reaches
``high_utilization`` — new requests cross in the narrowest option whose recall loss (measured
by ``prfaas codesign``'s ``wire`` axis: the trained toy with its context shipped in that
precision) is within ``recall_budget``; they go back to native once u falls to
``low_utilization`` (hysteresis: the precision does not flap around one level). A request
keeps the precision it was given; the recall cost is bounded by the budget per narrowed
request, and on average by the budget times the share narrowed.

Pure: the caller passes the observations (`LinkObservation`, with its clock) in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prfaas_jax.policy.egress_window import EgressWindow
from prfaas_jax.policy.threshold_controller import LinkObservation
from prfaas_jax.wire_precision import WirePrecision


@dataclass(frozen=True)
class WireOption:
    """A narrower precision: its name (wire_precision.py), its bytes over native's, and the
    recall it costs (a fraction: 0.01 is one point)."""

    precision: str
    byte_ratio: float
    recall_loss: float

    def __post_init__(self) -> None:
        WirePrecision.parse(self.precision)  # a name the codec knows: the serving plane sends it
        if not 0 < self.byte_ratio <= 1:
            raise ValueError(f"{self.precision}: byte_ratio must be in (0, 1]")
        if self.recall_loss < 0:
            raise ValueError(f"{self.precision}: recall_loss must be ≥ 0")


@dataclass(frozen=True)
class AdaptiveWireConfig:
    options: tuple[WireOption, ...]
    recall_budget: float = 0.01  # the recall a narrowed request may lose
    high_utilization: float = 0.85
    low_utilization: float = 0.6
    window_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.low_utilization < self.high_utilization:
            raise ValueError("need 0 < low_utilization < high_utilization")
        if self.recall_budget < 0 or not self.window_s > 0:
            raise ValueError("need recall_budget ≥ 0 and window_s > 0")


def narrowest_within(options: Sequence[WireOption], budget: float) -> WireOption | None:
    """The option with the fewest bytes whose recall loss is within ``budget`` (ties: the
    smaller loss, then the first listed); None when none is."""
    allowed = [o for o in options if o.recall_loss <= budget]
    if not allowed:
        return None
    return min(allowed, key=lambda o: (o.byte_ratio, o.recall_loss))


def narrowing(utilization: float, narrowed: bool, high: float, low: float) -> bool:
    """Whether requests cross narrowed after this observation: from native at u ≥ ``high``,
    back to native at u ≤ ``low``, else as before."""
    if utilization >= high:
        return True
    if utilization <= low:
        return False
    return narrowed


class AdaptiveWire:
    """The precision of each new offloaded request (module docstring)."""

    def __init__(self, config: AdaptiveWireConfig) -> None:
        self.config = config
        self.option = narrowest_within(config.options, config.recall_budget)
        self.narrowed = False
        self.utilization = 0.0
        self._egress = EgressWindow(config.window_s)

    def observe(self, obs: LinkObservation) -> None:
        """Fold in one period's egress counter and capacity."""
        if obs.capacity_bytes_per_s <= 0:
            raise ValueError(f"link capacity must be positive, got {obs.capacity_bytes_per_s}")
        self._egress.add(obs.now, obs.egress_bytes)
        self.utilization = self._egress.rate() / obs.capacity_bytes_per_s
        cfg = self.config
        self.narrowed = narrowing(
            self.utilization, self.narrowed, cfg.high_utilization, cfg.low_utilization
        )

    def choose(self) -> WireOption | None:
        """The option a request offloaded now crosses in; None: native."""
        return self.option if self.narrowed else None
