"""The router's record of one instance (`WorkerHandle`) and what it predicts from those records:
`kv_size_profile` (S_kv(l) from the model's byte formula) and `TtftPredictor` (a request's time
to first token on chosen instances, for admission control: `policy.admission`); and the calls
an attempt makes besides its two streams: `lookup_prefixes` (every prefill instance's prefix
cache), `reserve_kv` (the KV a decode worker holds, for an increment) and `prefill_reply`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import grpc

from prfaas_jax.config import ModelConfig
from prfaas_jax.policy.admission import (
    DecodeBacklog,
    LinkCost,
    PrefillBacklog,
    TtftPrediction,
    predict_ttft,
)
from prfaas_jax.policy.live_model import TrafficWindow
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.routing import ClusterKind, Decision, Role
from prfaas_jax.serving.cluster_config import ClusterConfig
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport import security as transport
from prfaas_jax.serving.transport.server import CHANNEL_OPTIONS
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision

log = logging.getLogger("prfaas.router")
LOOKUP_TIMEOUT_S = 1.0


def one_way_delay_s(link: pb.LinkState) -> float:
    """A PrfaaS worker's one-way delay to decode: what its sender adds to each frame (the
    in-process shaper's latency) plus half the round trip TCP measured on its transfers (the
    packet path's, under `--netns`); each is 0 where the other holds the delay."""
    return link.latency_s + link.measured_rtt_s / 2


def kv_size_profile(
    cfg: ModelConfig, max_len: int, precision: WirePrecision = WIRE_NATIVE
) -> Profile:
    """S_kv(l) in MiB from the model's byte formula, as encoded for the link (``precision``);
    exact, since it is piecewise linear in l with a knee only where a sliding window fills up."""
    knees = {1, max_len}
    if cfg.swa is not None and cfg.swa.window < max_len:
        knees.add(cfg.swa.window)
    lengths = sorted(knees) if len(knees) > 1 else [1, 2]
    return Profile.table(lengths, [state_nbytes(cfg, l, precision) / 2**20 for l in lengths])


@dataclasses.dataclass(eq=False)
class WorkerHandle:
    name: str
    address: str
    role: Role
    control: pb_grpc.WorkerControlStub
    prefill: pb_grpc.PrefillWorkerStub
    decode: pb_grpc.DecodeWorkerStub
    prefix: pb_grpc.PrefixCacheStub
    outstanding_prefills: int = 0
    outstanding_tokens: int = 0
    assigned_decodes: int = 0
    draining_to: Role | None = None
    down: bool = False  # failed a probe or a poll: no new requests until it answers again
    stats: pb.WorkerStats | None = None
    # When (time.monotonic) the control loop's poll last got an answer; None: not yet.
    answered_at: float | None = None

    @classmethod
    def connect(
        cls, name: str, address: str, role: Role, security: SecuritySection | None = None
    ) -> WorkerHandle:
        """Stubs on one channel to the worker: mutual TLS when `security` has certificates."""
        channel = transport.channel(address, security, CHANNEL_OPTIONS)
        return cls(
            name,
            address,
            role,
            pb_grpc.WorkerControlStub(channel),
            pb_grpc.PrefillWorkerStub(channel),
            pb_grpc.DecodeWorkerStub(channel),
            pb_grpc.PrefixCacheStub(channel),
        )

    @property
    def idle(self) -> bool:
        return not (self.outstanding_prefills or self.assigned_decodes)


def prefill_profiles(config: ClusterConfig) -> dict[ClusterKind, Profile]:
    """T_prefill(l) of each cluster, from `[profile]`."""
    return {
        ClusterKind.PRFAAS: Profile.polynomial(config.profile.prfaas_prefill_s),
        ClusterKind.PD: Profile.polynomial(config.profile.pd_prefill_s),
    }


class TtftPredictor:
    """`policy.admission.predict_ttft` fed from the router's counters and the cluster config's
    profiles (built once)."""

    def __init__(self, config: ClusterConfig, cfg: ModelConfig) -> None:
        self.config = config
        self._prefill_profiles = prefill_profiles(config)
        self._kv_profile = kv_size_profile(cfg, config.engine.max_len, config.link.wire_precision)

    def predict(
        self,
        decision: Decision,
        prefill: WorkerHandle,
        decode: WorkerHandle,
        state_len: int,
        traffic: TrafficWindow,
    ) -> TtftPrediction:
        """The request's TTFT on `prefill` and `decode` (read under the router's lock)."""
        config, link = self.config, None
        if decision.cluster is ClusterKind.PRFAAS:
            polled = prefill.stats.link if prefill.stats is not None else None
            if polled is not None and polled.bandwidth_bytes_per_s > 0:
                bandwidth, latency = polled.bandwidth_bytes_per_s, one_way_delay_s(polled)
            else:  # one PrfaaS worker's share of the configured link
                share = max(config.instances.prfaas_prefill, 1)
                bandwidth = config.link.bandwidth_bytes_per_s / share
                latency = config.link.one_way_delay_s
            link = LinkCost(bandwidth, latency, self._kv_profile)
        outputs = traffic.mean_output_len() if len(traffic) else 1.0
        return predict_ttft(
            decision.uncached_len,
            state_len,
            PrefillBacklog(
                self._prefill_profiles[decision.cluster],
                prefill.outstanding_prefills,
                prefill.outstanding_tokens,
            ),
            DecodeBacklog(
                decode.assigned_decodes,
                config.engine.max_slots,
                outputs * config.profile.decode_step_s,
            ),
            link=link,
        )


def lookup_prefixes(
    stubs: Mapping[str, pb_grpc.PrefixCacheStub],
    prompt: Sequence[int],
    timeout_s: float = LOOKUP_TIMEOUT_S,
) -> dict[str, int]:
    """Each instance's cached prefix of `prompt` (0 for one that does not answer in time)."""
    request = pb.PrefixLookupRequest(prompt_token_ids=prompt)
    futures = {name: stub.Lookup.future(request, timeout=timeout_s) for name, stub in stubs.items()}
    cached = {}
    for name, future in futures.items():
        try:
            cached[name] = future.result().cached_len
        except grpc.RpcError as err:
            log.warning("prefix lookup on %s: %s", name, err.code().name)
            cached[name] = 0
    return cached


def reserve_kv(
    stub: pb_grpc.DecodeWorkerStub,
    request_id: str,
    prompt: Sequence[int],
    timeout_s: float = LOOKUP_TIMEOUT_S,
) -> int:
    """Leading prompt positions whose KV the decode worker holds and keeps for this request's
    state (serving/transfer/increments.py); 0 when it holds none or does not answer in time —
    the state then comes whole."""
    request = pb.KvReserveRequest(request_id=request_id, prompt_token_ids=prompt)
    try:
        return stub.ReserveKv(request, timeout=timeout_s).cached_len
    except grpc.RpcError as err:
        log.info("no KV reservation for %s: %s", request_id, err.code().name)
        return 0


def prefill_reply(prefill_call: grpc.Future, timeout: float) -> pb.PrefillReply | None:
    """A prefill call's reply (None if it is lost)."""
    try:
        return prefill_call.result(timeout=timeout)
    except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
        return None
