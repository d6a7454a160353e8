"""The front door: `RouterCore` (dispatch and bookkeeping) and `RouterService` (`prfaas.v1.Router`).

Also exposes `WorkerHandle` (the router's record of one instance) and `kv_size_profile`.

`Generate` checks the request (INVALID_ARGUMENT on a bad one, ALREADY_EXISTS on a request id
already in flight), asks every prefill instance how much of the prompt its prefix cache holds
(`lookup_prefixes`, serving/prefix_service.py; skipped when `[prefix_cache]` is off), asks the
policy where to prefill (`policy.routing.route` on the uncached length — both bandwidth cases,
cache affinity against load, the PrfaaS queue guard) and where to decode (`pick_decode`), then
opens the decode worker's token stream and calls the prefill worker, which pushes the state to
that decode worker; when the reused prefix sits on another instance, the call names it and the
prefill worker fetches it first. The report's `cached_len` is what the prefill worker actually
reused. Tokens are forwarded as they come; the final message carries the `RequestReport`. If
the prefill fails, its status is the request's status; if the client goes away, both calls are
cancelled. The router's own counts of outstanding prefills (and their tokens) per instance are
the queue depths the routing rule and the controllers see — exact at decision time, unlike
polled worker stats. Draining instances (`RouterControl`, serving/router_control.py) take no new
requests. The router holds no policy of its own: routing, t and role changes come from
`prfaas_jax.policy`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.policy.live_model import TrafficWindow
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.routing import (
    ClusterView,
    Decision,
    DecodeLoad,
    InstanceLoad,
    Role,
    pick_decode,
    route,
)
from prfaas_jax.serving.cluster_config import ClusterConfig
from prfaas_jax.serving.grpc_server import CHANNEL_OPTIONS
from prfaas_jax.serving.messages import check_prompt, sampling_from_proto, sampling_to_proto
from prfaas_jax.serving.metrics import Histogram
from prfaas_jax.serving.prefix_service import lookup_prefixes
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

MAX_REQUEST_ID_LEN = 256


class _InFlightError(Exception):
    """A request with this id is already in flight."""


class _NoInstanceError(Exception):
    """No prefill or no decode instance takes requests now."""


def kv_size_profile(cfg: ModelConfig, max_len: int) -> Profile:
    """S_kv(l) in MiB from the model's byte formula; exact, since it is piecewise linear in l
    with a knee only where a sliding window fills up."""
    knees = {1, max_len}
    if cfg.swa is not None and cfg.swa.window < max_len:
        knees.add(cfg.swa.window)
    lengths = sorted(knees) if len(knees) > 1 else [1, 2]
    return Profile.table(lengths, [state_nbytes(cfg, l) / 2**20 for l in lengths])


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
    stats: pb.WorkerStats | None = None

    @classmethod
    def connect(cls, name: str, address: str, role: Role) -> WorkerHandle:
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
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


class RouterCore:
    """Request dispatch and the counters every other part of the router reads."""

    def __init__(
        self, config: ClusterConfig, cfg: ModelConfig, workers: dict[str, tuple[str, Role]]
    ) -> None:
        self.config, self.cfg = config, cfg
        self.lock = threading.Lock()
        self.workers = {n: WorkerHandle.connect(n, a, r) for n, (a, r) in workers.items()}
        self.threshold = config.router.threshold
        self.traffic = TrafficWindow(config.controller.window)
        self.in_flight: set[str] = set()
        self.finished: dict[tuple[str, str], int] = {}
        self.ttft = Histogram()
        self.prefix_moves = self.prompt_tokens = self.cached_tokens = 0

    # --- bookkeeping ----------------------------------------------------------------------

    def serving(self, role: Role) -> list[WorkerHandle]:
        """Instances in `role` that take new requests (not draining)."""
        return [w for w in self.workers.values() if w.role is role and w.draining_to is None]

    def _count(self, route_name: str, outcome: str) -> None:
        key = (route_name, outcome)
        self.finished[key] = self.finished.get(key, 0) + 1

    def _lookup(self, prompt: list[int]) -> dict[str, int]:
        """Each prefill instance's cached prefix of `prompt` (none without a cache); `_decide`
        reads only the instances that take requests."""
        if not self.config.prefix_cache.enabled:
            return {}
        with self.lock:
            stubs = {w.name: w.prefix for w in self.workers.values() if w.role.is_prefill}
        return lookup_prefixes(stubs, prompt)

    def _decide(
        self, request_id: str, prompt_len: int, max_new_tokens: int, cached: dict[str, int]
    ) -> tuple[Decision, WorkerHandle, WorkerHandle, float]:
        now = time.monotonic()
        with self.lock:
            if request_id in self.in_flight:
                raise _InFlightError(request_id)

            def loads(role: Role) -> tuple[InstanceLoad, ...]:
                return tuple(
                    InstanceLoad(
                        w.name, w.outstanding_prefills, w.outstanding_tokens, cached.get(w.name, 0)
                    )
                    for w in self.serving(role)
                )

            prfaas, pd_prefill = loads(Role.PRFAAS_PREFILL), loads(Role.PD_PREFILL)
            decoders = self.serving(Role.PD_DECODE)
            if not (prfaas or pd_prefill) or not decoders:
                raise _NoInstanceError("no prefill or no decode instance is serving")
            threshold = self.threshold
            view = ClusterView(
                threshold,
                prfaas,
                pd_prefill,
                prfaas_max_queue=self.config.router.prfaas_max_queue,
                bandwidth_abundant=self.config.router.bandwidth_abundant,
            )
            decision = route(prompt_len, view, now)
            slots = self.config.engine.max_slots
            decode_name = pick_decode(
                [DecodeLoad(w.name, w.assigned_decodes, slots) for w in decoders]
            )
            prefill, decode = self.workers[decision.instance], self.workers[decode_name]
            prefill.outstanding_prefills += 1
            prefill.outstanding_tokens += decision.uncached_len
            decode.assigned_decodes += 1
            self.prefix_moves += decision.moves_prefix
            self.in_flight.add(request_id)
            self.traffic.record(now, decision.uncached_len, max_new_tokens)
        return decision, prefill, decode, threshold

    def _prefill_done(self, worker: WorkerHandle, tokens: int) -> None:
        with self.lock:
            worker.outstanding_prefills -= 1
            worker.outstanding_tokens -= tokens

    # --- Generate -------------------------------------------------------------------------

    def generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        received = time.perf_counter()
        prompt = list(request.prompt_token_ids)
        try:
            check_prompt(
                prompt,
                self.cfg,
                max_len=self.config.engine.max_len,
                max_new_tokens=request.max_new_tokens,
            )
            sampling = sampling_from_proto(
                request.temperature, request.top_p, request.top_k, request.seed
            )
            if len(request.request_id) > MAX_REQUEST_ID_LEN:
                raise UserError(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
        except UserError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        request_id = request.request_id or uuid.uuid4().hex
        try:
            decision, prefill, decode, threshold = self._decide(
                request_id, len(prompt), request.max_new_tokens, self._lookup(prompt)
            )
        except _InFlightError:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is in flight")
        except _NoInstanceError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        route_name, outcome = decision.cluster.value, "error"
        timeout = self.config.router.request_timeout_s
        # Workers see a fresh id per attempt, so a client reusing an id after a cancel can
        # never meet the leftovers of the earlier attempt.
        wire_id = f"{request_id}.{uuid.uuid4().hex[:12]}"
        decode_call = decode.decode.Generate(
            pb.DecodeRequest(
                request_id=wire_id,
                prompt_len=len(prompt),
                max_new_tokens=request.max_new_tokens,
            ),
            timeout=timeout,
        )
        source = self.workers[decision.prefix_source] if decision.moves_prefix else None
        prefill_call = prefill.prefill.Prefill.future(
            pb.PrefillRequest(
                request_id=wire_id,
                prompt_token_ids=prompt,
                sampling=sampling_to_proto(sampling),
                decode_address=decode.address,
                prefix_source=source.address if source else "",
                prefix_cross_cluster=bool(source and source.role.cluster != prefill.role.cluster),
            ),
            timeout=timeout,
        )

        def prefill_finished(call: grpc.Future) -> None:
            self._prefill_done(prefill, decision.uncached_len)
            if not call.cancelled() and call.exception() is not None:
                decode_call.cancel()  # its state will never come

        prefill_call.add_done_callback(prefill_finished)
        context.add_callback(lambda: (decode_call.cancel(), prefill_call.cancel()))
        try:
            ttft, state_bytes = None, 0
            for message in decode_call:
                if ttft is None:
                    ttft, state_bytes = time.perf_counter() - received, message.state_bytes
                    with self.lock:
                        self.ttft.observe(ttft)
                if message.finished:
                    cached = self._reused(prefill_call, decision, timeout)
                    report = pb.RequestReport(
                        route=route_name,
                        prompt_len=len(prompt),
                        cached_len=cached,
                        uncached_len=len(prompt) - cached,
                        threshold=threshold,
                        ttft_s=ttft,
                        state_bytes=state_bytes,
                        prefill_instance=prefill.name,
                        decode_instance=decode.name,
                    )
                    outcome = "ok"
                    yield pb.GenerateResponse(
                        token_ids=message.token_ids, finished=True, report=report
                    )
                    return
                yield pb.GenerateResponse(token_ids=message.token_ids)
            context.abort(grpc.StatusCode.INTERNAL, "the decode stream ended without finishing")
        except grpc.RpcError as err:
            # A failed prefill cancels the decode stream: report the prefill's own error.
            cause = None
            if prefill_call.done() and not prefill_call.cancelled():
                cause = prefill_call.exception()
            failure = cause if isinstance(cause, grpc.RpcError) else err
            context.abort(failure.code(), f"{failure.code().name.lower()}: {failure.details()}")
        finally:
            decode_call.cancel()
            with self.lock:
                decode.assigned_decodes -= 1
                self.in_flight.discard(request_id)
                self._count(route_name, outcome)

    def _reused(self, prefill_call: grpc.Future, decision: Decision, timeout: float) -> int:
        """Prompt tokens the prefill worker actually reused (the decision's estimate if its
        reply is lost), counted for the hit-rate metrics."""
        try:
            cached = prefill_call.result(timeout=timeout).cached_len
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
            cached = decision.cached_len
        with self.lock:
            self.prompt_tokens += decision.cached_len + decision.uncached_len
            self.cached_tokens += cached
        return cached


class RouterService(pb_grpc.RouterServicer):
    """`prfaas.v1.Router`: the thin adapter over `RouterCore` and `RouterControl`."""

    def __init__(self, core: RouterCore, stats: Callable[[], pb.RouterStats]) -> None:
        self._core, self._stats = core, stats

    def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        return self._core.generate(request, context)

    def GetStats(  # noqa: N802
        self, request: pb.GetStatsRequest, context: grpc.ServicerContext
    ) -> pb.RouterStats:
        return self._stats()
