"""Admission control: `predict_ttft(...) -> TtftPrediction` and `admit(...) -> Rejection | None`.

Also exposes what the router knows about the chosen instances when a request arrives
(`PrefillBacklog`, `LinkCost`, `DecodeBacklog`), `RejectionKind`, `Rejection` and
`AdmissionPolicy` (the two limits, validated, with `admit` as a method).

A request whose first token would come too late is better refused at the door, at once, than
queued until it times out: the client can go elsewhere or come back, and no queue grows past
what the cluster can serve within the SLO. The prediction for a request that prefills
`uncached_len` tokens on prefill instance P and leaves a state of `state_len` tokens for
decode instance D (n requests with w uncached tokens outstanding on P; a requests assigned to
D, which has s slots; each request holds a slot for R seconds on average; B the link's
bandwidth, S_kv(l) the state size):

    queue_s       = max(n · T_prefill(w / n),  n · S_kv(w / n) / B)       0 when n = 0
    prefill_s     = T_prefill(uncached_len)
    transfer_s    = S_kv(state_len) / B + latency                          0 within a cluster
    decode_wait_s = max(0, a − s + 1) · R / s
    total_s       = max(queue_s + prefill_s + transfer_s,  decode_wait_s)

Why each term has this form:

- A prefill instance runs one prefill at a time, so the work ahead costs the sum of its
  prefill times. The router knows only how many requests and how many uncached tokens are
  outstanding, so each is taken at the mean length: exact for a linear T_prefill (n·a + b·w),
  low by Jensen's inequality for a convex one. The prefill running now counts in full (its
  progress is unknown), which errs the other way by at most one prefill.
- Across the inter-cluster link, states leave the engine as it computes them and wait in the
  link's queue, so a slow link, not the engine, paces a PrfaaS instance: the backlog is the
  slower of the two stages (only the engine term without a link). Queued states are sized from
  uncached lengths, since that is what the router counts; a reused prefix travels too, so with
  cache hits this is low.
- The state streams while it is computed (codec v2), so adding the whole transfer after the
  prefill is conservative by at most min(prefill_s, transfer_s).
- The decode worker sends the first token when it puts the state into a slot, and slots free
  while the prefill runs: the slot wait overlaps the prefill path instead of adding to it.
  With a ≥ s this request is (a − s + 1)-th in line, and s slots free one every R / s seconds
  on average. `a` counts requests still prefilling, so this errs high.

`admit` refuses a request when `in_flight ≥ max_in_flight` (a hard bound, whatever the
prediction says, so the router's and the workers' memory stays bounded under any burst), or,
when `ttft_slo_s > 0`, when `total_s > ttft_slo_s`. Both are RESOURCE_EXHAUSTED on the wire;
the rejection's `reason` says which limit and, for the SLO, which component dominates.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from prfaas_jax.policy.profiles import Profile

BYTES_PER_MIB = 2**20


@dataclass(frozen=True)
class PrefillBacklog:
    """The chosen prefill instance: its T_prefill(l) in seconds and the work sent to it that has
    not finished (the router's outstanding prefills and their uncached tokens)."""

    prefill_s: Profile
    requests: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.requests < 0 or self.tokens < 0:
            raise ValueError(f"need requests, tokens ≥ 0, got {self.requests}, {self.tokens}")


@dataclass(frozen=True)
class LinkCost:
    """The inter-cluster link as one prefill instance sees it (its share of the egress)."""

    bandwidth_bytes_per_s: float
    latency_s: float
    kv_size_mib: Profile  # S_kv(l), MiB, as `serving.router.handles.kv_size_profile` builds it

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError(
                f"need bandwidth > 0 and latency ≥ 0, got {self.bandwidth_bytes_per_s}, "
                f"{self.latency_s}"
            )

    def seconds(self, length: float) -> float:
        """Time on the wire of one state of `length` tokens, latency not included."""
        return self.kv_size_mib(length) * BYTES_PER_MIB / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class DecodeBacklog:
    """The chosen decode instance: requests the router assigned to it (decoding, waiting for a
    slot or still prefilling), its slots, and how long a request holds a slot on average."""

    assigned: int = 0
    max_slots: int = 1
    request_s: float = 0.0  # e.g. mean output length × decode step time

    def __post_init__(self) -> None:
        if self.assigned < 0 or self.max_slots < 1 or self.request_s < 0:
            raise ValueError(
                f"need assigned ≥ 0, max_slots ≥ 1, request_s ≥ 0, got {self.assigned}, "
                f"{self.max_slots}, {self.request_s}"
            )


@dataclass(frozen=True)
class TtftPrediction:
    """Predicted time to first token and its parts, in seconds (module docstring)."""

    queue_s: float
    prefill_s: float
    transfer_s: float
    decode_wait_s: float

    @property
    def total_s(self) -> float:
        return max(self.queue_s + self.prefill_s + self.transfer_s, self.decode_wait_s)

    def describe(self) -> str:
        """'queue 2.9 s, prefill 0.2 s, transfer 0.1 s, decode slot wait 0 s'."""
        parts = (
            ("queue", self.queue_s),
            ("prefill", self.prefill_s),
            ("transfer", self.transfer_s),
            ("decode slot wait", self.decode_wait_s),
        )
        return ", ".join(f"{name} {_seconds(value)} s" for name, value in parts)


def _seconds(value: float) -> str:
    return f"{value:.3g}"


def predict_ttft(
    uncached_len: int,
    state_len: int,
    prefill: PrefillBacklog,
    decode: DecodeBacklog,
    *,
    link: LinkCost | None = None,
) -> TtftPrediction:
    """The predicted TTFT of a request routed to `prefill` and `decode`; `link` is None when the
    state stays within its cluster (module docstring)."""
    if uncached_len < 1 or state_len < uncached_len:
        raise ValueError(f"need 1 ≤ uncached_len ≤ state_len, got {uncached_len}, {state_len}")
    queue_s = 0.0
    if prefill.requests:
        mean_len = prefill.tokens / prefill.requests
        queue_s = prefill.requests * prefill.prefill_s(mean_len)
        if link is not None:
            queue_s = max(queue_s, prefill.requests * link.seconds(mean_len))
    transfer_s = 0.0 if link is None else link.seconds(state_len) + link.latency_s
    in_line = max(0, decode.assigned - decode.max_slots + 1)
    return TtftPrediction(
        queue_s=queue_s,
        prefill_s=prefill.prefill_s(uncached_len),
        transfer_s=transfer_s,
        decode_wait_s=in_line * decode.request_s / decode.max_slots,
    )


class RejectionKind(enum.Enum):
    IN_FLIGHT = "in_flight"  # the router's bound on requests in flight
    TTFT_SLO = "ttft_slo"  # the predicted TTFT exceeds the SLO


@dataclass(frozen=True)
class Rejection:
    kind: RejectionKind
    reason: str  # for the client: the RESOURCE_EXHAUSTED details
    prediction: TtftPrediction | None = None


def admit(
    prediction: TtftPrediction | None,
    in_flight: int,
    *,
    ttft_slo_s: float,
    max_in_flight: int,
) -> Rejection | None:
    """None to accept the request, else why not. `in_flight` counts the requests already
    admitted, not this one; `ttft_slo_s = 0` turns the SLO check off (and then `prediction`
    may be None, since nothing reads it)."""
    if in_flight >= max_in_flight:
        return Rejection(
            RejectionKind.IN_FLIGHT, f"{in_flight} requests in flight, the router's limit"
        )
    if ttft_slo_s > 0:
        if prediction is None:
            raise ValueError("an SLO check needs a prediction")
        if prediction.total_s > ttft_slo_s:
            return Rejection(
                RejectionKind.TTFT_SLO,
                f"predicted TTFT {_seconds(prediction.total_s)} s exceeds the "
                f"{_seconds(ttft_slo_s)} s SLO ({prediction.describe()})",
                prediction,
            )
    return None


@dataclass(frozen=True)
class AdmissionPolicy:
    """The router's two limits; `predicts` says whether `admit` needs a prediction."""

    max_in_flight: int = 256
    ttft_slo_s: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be ≥ 1, got {self.max_in_flight}")
        if not self.ttft_slo_s >= 0:
            raise ValueError(f"ttft_slo_s must be ≥ 0, got {self.ttft_slo_s}")

    @property
    def predicts(self) -> bool:
        return self.ttft_slo_s > 0

    def admit(self, prediction: TtftPrediction | None, in_flight: int) -> Rejection | None:
        return admit(
            prediction, in_flight, ttft_slo_s=self.ttft_slo_s, max_in_flight=self.max_in_flight
        )
