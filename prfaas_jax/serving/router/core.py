"""The client port's service: `RouterCore` (dispatch, retries and bookkeeping) and `RouterService`
(`prfaas.v1.Router`). The router's record of each instance (`WorkerHandle`) lives in
serving/router/handles.py.

The module is over 500 lines long because one request's life — admission, attempts, the stream,
its bookkeeping — reads best in one place, and dispatch and retry are one loop over one
`RequestRecord` whose invariants (every token streamed once, one live attempt) would otherwise
span two modules; what is separable lives beside it (record.py, handles.py, cache_rule.py) and
in serving/transport/watchdog.py.

`Generate` checks the request (INVALID_ARGUMENT on a bad one, ALREADY_EXISTS on a request id
already in flight: ids are idempotency keys, so a client retrying one never runs it twice at
once), admits it (`policy.admission`: RESOURCE_EXHAUSTED beyond `max_in_flight` requests, or,
with `ttft_slo_s` set, when its predicted TTFT on the chosen instances misses the SLO), asks
every live prefill instance how much of the prompt its prefix cache holds — answered by the
router's index of their cache events where it is in step (serving/router/cache_feed.py), asked
with `lookup_prefixes` (serving/worker/prefix.py) where not; skipped when `[prefix_cache]` is
off — asks the policy where to
prefill (`policy.routing.route` on the uncached length — the bandwidth case chosen per request
by serving/router/cache_rule.py, cache affinity against load, the PrfaaS queue guard) and where
to decode (`pick_decode`), then opens the decode worker's token stream and calls the prefill
worker, which pushes the state to that decode worker (across the link in the precision `[wire]`
picks for the attempt, serving/router/wire_rule.py); when the reused prefix sits on another
instance, the call names it and the prefill worker fetches it first. Before a state crosses
the link the decode worker is asked which leading KV it holds (`reserve_kv`), and the state
ships as an increment. Tokens are forwarded as they come; the final message carries
the `RequestReport`, with the tier the reused prefix came from (the prefill worker's reply; a
fetched prefix named by its holder's role). If the client goes away, both calls are cancelled.

Faults. One prefill + decode is an *attempt*; the router keeps a `RequestRecord` (prompt, budget,
sampling, tokens already streamed) and retries a failed attempt — a prefill worker or link that
dies mid-transfer, a state the decode worker rejects, a decode worker that dies mid-stream, a
deadline — up to `max_attempts` in all, with backoff; an attempt a worker refused as final (the
request itself, e.g. a prompt past its engine's limit: `Failure.retryable`) is not retried, the
client gets that status at once. A retry prefills the prompt plus the tokens already streamed and
decodes only what is still owed, sampling from the same key-schedule index, so the client sees
every token exactly once and the same tokens as an uninterrupted run. A request that names no seed
gets a fresh one here (63 random bits, so a client can send it back as a JSON integer to replay the
request), reported in its `RequestReport.seed`. Log-probabilities, when a request asks, come from
the attempt's prefill reply and its decode stream (serving/router/scores.py). An attempt whose
decode stream stays silent for `stall_timeout_s` (a hung worker or link,
serving/transport/watchdog.py) is cancelled and retried like a failed one; the silence counts
from the last sign of progress — the prefill's reply, each token — and, while the prefill call
is outstanding (the prompt queued or prefilling), from the last time both workers answered the
control loop's poll, so a prefill longer than the limit is not cut. Each attempt uses a
fresh wire id, so nothing of a failed attempt (a late state, a half-sent stream) can reach a later
one. After a failure the router probes the two workers; one that does not answer is left out of
routing until the control loop hears from it again or its replacement registers
(serving/router/control.py). A new request that finds no live instance fails at once (UNAVAILABLE);
a request already in flight waits up to `retry_wait_s` for one.

The router's own counts of outstanding prefills (and their tokens) per instance are the queue
depths the routing rule and the controllers see — exact at decision time, unlike polled worker
stats. Draining instances (`RouterControl`) take no new requests. The router holds no policy of
its own: routing, t and role changes come from `prfaas_jax.policy`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator

import grpc

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.policy.admission import (
    admit,
)
from prfaas_jax.policy.live_model import TrafficWindow
from prfaas_jax.policy.routing import (
    ClusterKind,
    ClusterView,
    Decision,
    DecodeLoad,
    InstanceLoad,
    LinkView,
    Role,
    RouteReason,
    pick_decode,
    route,
)
from prfaas_jax.serving.cluster_config import ClusterConfig
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.router.cache_feed import CacheFeed
from prfaas_jax.serving.router.cache_rule import CacheRule
from prfaas_jax.serving.router.handles import (
    TtftPredictor,
    WorkerHandle,
    lookup_prefixes,
    prefill_reply,
    reserve_kv,
)
from prfaas_jax.serving.router.metrics import LOOKUP_BUCKETS, Histogram
from prfaas_jax.serving.router.record import Failure, Outcome, RequestRecord, Route, backoff_s
from prfaas_jax.serving.router.scores import AttemptScores, scores_asked
from prfaas_jax.serving.router.wire_rule import WireRule
from prfaas_jax.serving.transport.messages import (
    check_prompt,
    check_request_id,
    check_top_logprobs,
    check_wire_precision,
    sampling_from_proto,
    sampling_to_proto,
)
from prfaas_jax.serving.transport.watchdog import Watchdog

PROBE_TIMEOUT_S = 0.5
log = logging.getLogger("prfaas.router")


class _InFlightError(Exception):
    """A request with this id is already in flight."""


class _NoInstanceError(Exception):
    """No prefill or no decode instance takes requests now."""


class _RejectedError(Exception):
    """Admission control refused the request (`policy.admission`); the message says why."""


class _StoppingError(Exception):
    """The router is stopping: it takes no new request (`stop_admitting`)."""


class RouterCore:
    """Request dispatch and the counters every other part of the router reads."""

    def __init__(
        self, config: ClusterConfig, cfg: ModelConfig, workers: dict[str, tuple[str, Role]]
    ) -> None:
        self.config, self.cfg = config, cfg
        self.lock = threading.Lock()
        self.workers = {
            n: WorkerHandle.connect(n, a, r, config.security) for n, (a, r) in workers.items()
        }
        self.threshold = config.router.threshold
        self.traffic = TrafficWindow(config.controller.window)
        self.in_flight: set[str] = set()
        self.stopping = False  # `stop_admitting` was called: new requests are refused
        self.finished: dict[tuple[Route, Outcome], int] = {}
        self.ttft = Histogram()
        self.lookup_time = Histogram(LOOKUP_BUCKETS)
        # Prefill end → first token, per route ("prfaas", "pd"): the transfer compute did not hide.
        self.exposed_transfer = {route: Histogram() for route in ("prfaas", "pd")}
        self.prefix_moves = self.prompt_tokens = self.cached_tokens = 0
        # Requests a decode worker's cached prefix kept off the link (`RouteReason.DECODE_CACHE`).
        self.decode_cache_local = 0
        self.retries = self.resumed = self.rejected = 0
        self.saved_bytes = 0  # state bytes increments kept off the link
        # The link as the control loop last saw it (serving/router/control.py), for the
        # per-request cache rule; until then, as configured and idle.
        self.link = LinkView(config.link.bandwidth_bytes_per_s, 0.0, config.link.one_way_delay_s)
        self.cache_rule = CacheRule(config, cfg)
        # [wire]: the precision each PrfaaS attempt's state crosses in (router/wire_rule.py).
        self.wire = WireRule(config.wire, config.link.wire_precision)
        self.predictor = TtftPredictor(config, cfg)
        self.watchdog = Watchdog()
        # Prefills that reused less than the cached length routing used (an eviction raced).
        self.overestimates = 0
        self.cache_feed: CacheFeed | None = None
        if config.prefix_cache.enabled and config.router.cache_index:
            self.cache_feed = CacheFeed(config.prefix_cache.block_size, cfg.vocab_size)
            for worker in self.workers.values():
                self.cache_feed.follow(worker.name, worker.prefix)

    def stop_admitting(self) -> None:
        """Refuse every new request from now on (UNAVAILABLE, "the router is stopping"); the
        requests in flight go on. The first step of stopping: the client port closes at once, while
        the rest of the router winds down, not when its server stops."""
        with self.lock:
            self.stopping = True

    def close(self) -> None:
        """Stop following the instances' cache events."""
        if self.cache_feed is not None:
            self.cache_feed.close()

    # --- bookkeeping ----------------------------------------------------------------------

    def serving(self, role: Role) -> list[WorkerHandle]:
        """Instances in `role` that take new requests (not draining)."""
        return [
            w
            for w in self.workers.values()
            if w.role is role and w.draining_to is None and not w.down
        ]

    def _count(self, route: Route, outcome: Outcome) -> None:
        key = (route, outcome)
        self.finished[key] = self.finished.get(key, 0) + 1

    def _lookup(self, prompt: list[int]) -> dict[str, int]:
        """Each live prefill instance's cached prefix of `prompt` (none without a cache), from
        the cache index where it is in step (serving/router/cache_feed.py), else asked;
        `_decide` reads only the instances that take requests."""
        if not self.config.prefix_cache.enabled:
            return {}
        start = time.perf_counter()
        with self.lock:
            # Decode-aware: the decode workers' prefixes count too (policy/routing.py).
            decode_aware = self.config.router.decode_aware
            stubs = {
                w.name: w.prefix
                for w in self.workers.values()
                if (w.role.is_prefill or decode_aware) and not w.down
            }
        if self.cache_feed is not None:
            cached = self.cache_feed.lookup(prompt, stubs)
        else:
            cached = lookup_prefixes(stubs, prompt)
        with self.lock:
            self.lookup_time.observe(time.perf_counter() - start)
        return cached

    def _claim(self, request_id: str) -> None:
        """Admit a new request id into the in-flight set, or refuse it (the router stopping, a
        duplicate id, or the router's bound on requests in flight)."""
        with self.lock:
            if self.stopping:
                raise _StoppingError
            if request_id in self.in_flight:
                raise _InFlightError(request_id)
            limit = self.config.router.max_in_flight
            rejection = admit(None, len(self.in_flight), ttft_slo_s=0.0, max_in_flight=limit)
            if rejection is not None:
                self.rejected += 1
                raise _RejectedError(rejection.reason)
            self.in_flight.add(request_id)

    def _decide(
        self, request_len: int, max_new_tokens: int, cached: dict[str, int], *, first: bool
    ) -> tuple[Decision, WorkerHandle, WorkerHandle, float]:
        """Where the next attempt prefills and decodes. On a request's first attempt, with a
        TTFT SLO set, a request predicted to miss it is refused (`_RejectedError`); a retry is
        never refused, since the request was accepted already."""
        now = time.monotonic()
        with self.lock:

            def loads(role: Role) -> tuple[InstanceLoad, ...]:
                return tuple(
                    InstanceLoad(
                        w.name, w.outstanding_prefills, w.outstanding_tokens, cached.get(w.name, 0)
                    )
                    for w in self.serving(role)
                )

            # Mixed PD instances prefill the local prompts they decode (serving/worker/mixed.py).
            mixed = self.config.instances.mixed
            prfaas = loads(Role.PRFAAS_PREFILL)
            pd_prefill = loads(Role.PD_DECODE if mixed else Role.PD_PREFILL)
            decoders = self.serving(Role.PD_DECODE)
            if not (prfaas or pd_prefill) or not decoders:
                raise _NoInstanceError("no live prefill or no live decode instance is serving")
            threshold = self.threshold
            view = ClusterView(
                threshold,
                prfaas,
                pd_prefill,
                prfaas_max_queue=self.config.router.prfaas_max_queue,
                bandwidth_abundant=self.cache_rule.abundant(
                    request_len, prfaas, pd_prefill, self.link
                ),
                replicate_prefixes=self.config.router.replicate_prefixes,
                decode=loads(Role.PD_DECODE) if self.config.router.decode_aware else (),
            )
            decision = route(request_len, view, now)
            slots = self.config.engine.max_slots
            if mixed and decision.cluster is ClusterKind.PD:
                decode_name = decision.instance  # no state push: it decodes what it prefills
            else:
                decode_name = pick_decode(
                    [DecodeLoad(w.name, w.assigned_decodes, slots) for w in decoders]
                )
            prefill, decode = self.workers[decision.instance], self.workers[decode_name]
            slo = self.config.router.ttft_slo_s
            if first and slo > 0:
                prediction = self.predictor.predict(
                    decision, prefill, decode, request_len, self.traffic
                )
                # `in_flight` holds this request already; `admit` counts the others.
                rejection = admit(
                    prediction,
                    len(self.in_flight) - 1,
                    ttft_slo_s=slo,
                    max_in_flight=self.config.router.max_in_flight,
                )
                if rejection is not None:
                    self.rejected += 1
                    raise _RejectedError(rejection.reason)
            prefill.outstanding_prefills += 1
            prefill.outstanding_tokens += decision.uncached_len
            decode.assigned_decodes += 1
            self.prefix_moves += decision.moves_prefix
            self.decode_cache_local += decision.reason is RouteReason.DECODE_CACHE
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
            seed = request.seed if request.HasField("seed") else secrets.randbits(63)
            sampling = sampling_from_proto(request.temperature, request.top_p, request.top_k, seed)
            top = check_top_logprobs(request.logprobs) if request.HasField("logprobs") else None
            check_request_id(request.request_id)
            asked_wire = check_wire_precision(request.wire_precision)
        except UserError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        request_id = request.request_id or uuid.uuid4().hex
        try:
            self._claim(request_id)
        except _StoppingError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the router is stopping")
        except _InFlightError:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is in flight")
        except _RejectedError as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        record = RequestRecord(
            request_id,
            prompt,
            request.max_new_tokens,
            sampling,
            received,
            logprobs=top,
            wire_precision=asked_wire,
            prompt_logprobs=request.prompt_logprobs,
        )
        context.add_callback(record.cancel)
        outcome = Outcome.ERROR
        try:
            yield from self._serve(record, context)
            outcome = Outcome.OK if record.owed == 0 else Outcome.CANCELLED
        except _RejectedError as err:
            outcome = Outcome.REJECTED  # counted in `rejected`, not as a failure
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        finally:
            with self.lock:
                self.in_flight.discard(request_id)
                if outcome is not Outcome.REJECTED:
                    self._count(record.route, outcome)

    def _serve(
        self, record: RequestRecord, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        """Attempts until one finishes the request, the client leaves, or the retries run out.

        A new request that finds no live instance fails at once (UNAVAILABLE); a request that
        already failed an attempt waits up to `retry_wait_s` for one (a restarting worker)."""
        router = self.config.router
        failure: Failure | None = None
        waiting_since: float | None = None
        while not record.cancelled:
            try:
                plan = self._decide(
                    len(record.context),
                    record.owed,
                    self._lookup(record.context),
                    first=record.attempts == 0,
                )
            except _NoInstanceError as err:
                now = time.monotonic()
                waiting_since = waiting_since or now
                if failure is None or now - waiting_since > router.retry_wait_s:
                    why = str(err) if failure is None else f"{err}; last {failure.describe()}"
                    context.abort(grpc.StatusCode.UNAVAILABLE, why)
                time.sleep(backoff_s(record.attempts))
                continue
            waiting_since = None
            record.attempts += 1
            failure = yield from self._attempt(record, plan)
            if failure is None or record.cancelled:
                return
            log.warning(
                "%s: attempt %d failed (%s)", record.request_id, record.attempts, failure.describe()
            )
            if not failure.retryable:  # a worker refused the request itself: it fails now
                context.abort(failure.code, f"not retried: {failure.describe()}")
            self._probe(plan[1], plan[2])
            if record.attempts >= router.max_attempts:
                context.abort(
                    failure.code,
                    f"{record.attempts} attempts failed; the last: {failure.describe()}",
                )
            with self.lock:
                self.retries += 1
            time.sleep(backoff_s(record.attempts))

    def _attempt(
        self, record: RequestRecord, plan: tuple[Decision, WorkerHandle, WorkerHandle, float]
    ) -> Generator[pb.GenerateResponse, None, Failure | None]:
        """One prefill + decode of what the request still owes; its tokens go to the client as
        they come. Returns None once the request finished, else why this attempt failed."""
        decision, prefill, decode, threshold = plan
        record.route = Route(decision.cluster.value)
        context, owed, resumed_from = record.context, record.owed, len(record.streamed)
        timeout = self.config.router.request_timeout_s
        # Workers see a fresh id per attempt, so a retry never meets the leftovers of an
        # earlier attempt (a late state, a half-sent stream) nor a reused client id's.
        wire_id = f"{record.request_id}.{uuid.uuid4().hex[:12]}"
        decode_call = decode.decode.Generate(
            pb.DecodeRequest(
                request_id=wire_id,
                prompt_len=len(context),
                max_new_tokens=owed,
                logprobs=record.logprobs,
            ),
            timeout=timeout,
        )
        source = self.workers.get(decision.prefix_source or "") if decision.moves_prefix else None
        # Across the link, ship only what the decode worker does not hold (an increment).
        held = 0
        if decision.cluster is ClusterKind.PRFAAS and self.config.prefix_cache.enabled:
            held = reserve_kv(decode.decode, wire_id, context)
        with self.lock:
            narrowed = self.wire.choose(decision.cluster, record.wire_precision)
        prefill_call = prefill.prefill.Prefill.future(
            pb.PrefillRequest(
                request_id=wire_id,
                prompt_token_ids=context,
                sampling=sampling_to_proto(record.attempt_sampling()),
                decode_address=decode.address,
                prefix_source=source.address if source else "",
                prefix_cross_cluster=bool(source and source.role.cluster != prefill.role.cluster),
                decode_cached_len=held,
                logprobs=(record.logprobs or 0) if scores_asked(record) else None,
                wire_precision=narrowed,
            ),
            timeout=timeout,
        )

        replied: list[float] = []  # when the prefill's reply came: its push was done

        def working() -> float | None:
            """While the prefill call is outstanding the decode stream has nothing to say, for
            as long as the prompt waits and prefills: the attempt is alive while both workers
            answer the control loop's polls (a stopped process does not)."""
            if prefill_call.done():
                return None
            heard = (prefill.answered_at, decode.answered_at)
            return None if heard[0] is None or heard[1] is None else min(heard)

        stall_s = self.config.router.stall_timeout_s
        watch = self.watchdog.watch(decode_call, stall_s, alive=working)

        def prefill_finished(call: grpc.Future) -> None:
            watch.touch()  # progress: the state is with the decode worker (or the call failed)
            replied.append(time.perf_counter())
            self._prefill_done(prefill, decision.uncached_len)
            if not call.cancelled() and call.exception() is not None:
                decode_call.cancel()  # its state will never come
            elif not call.cancelled() and self.cache_feed is not None:
                self.cache_feed.saw_reply(prefill.name, call.result().cache_seq)

        prefill_call.add_done_callback(prefill_finished)
        record.track(decode_call, prefill_call)
        try:
            state_bytes, first, first_token_at, scores = 0, True, None, None
            for message in decode_call:
                watch.touch()
                if first:
                    state_bytes, first = message.state_bytes, False
                    if scores_asked(record):  # its first token's are in the prefill's reply
                        reply = prefill_reply(prefill_call, timeout)
                        if reply is None:
                            return Failure(grpc.StatusCode.UNAVAILABLE, "the prefill reply is lost")
                        scores = AttemptScores(record, reply)
                tokens = record.take(list(message.token_ids))
                scored = scores.fields(message, len(tokens)) if scores is not None else {}
                routed = None
                if tokens and record.ttft_s is None:
                    first_token_at = time.perf_counter()
                    record.ttft_s = first_token_at - record.received
                    with self.lock:
                        self.ttft.observe(record.ttft_s)
                    # A client that stops early (a stop string) still learns the route and the
                    # cached prefix as routed; the final report has what the prefill reused.
                    routed = pb.RequestReport(
                        route=decision.cluster.value,
                        prompt_len=len(record.prompt),
                        cached_len=decision.cached_len,
                        uncached_len=decision.uncached_len,
                        threshold=threshold,
                        seed=record.sampling.seed,
                        wire_precision=narrowed,
                    )
                if message.finished or record.owed == 0:
                    reply = prefill_reply(prefill_call, timeout)
                    cached = self._reused(reply, decision)
                    tier = _reuse_tier(reply, decision, source)
                    exposed = 0.0
                    if reply is not None and replied and first_token_at is not None:
                        # Worker: prefill end → push acknowledged; router: reply → first token.
                        exposed = max(reply.transfer_s + first_token_at - replied[0], 0.0)
                        with self.lock:
                            self.exposed_transfer[decision.cluster.value].observe(exposed)
                    full = self.wire.state_nbytes(self.cfg, len(context), narrowed)
                    saved = max(full - state_bytes, 0) if held else 0
                    with self.lock:
                        self.saved_bytes += saved
                    report = pb.RequestReport(
                        route=decision.cluster.value,
                        prompt_len=len(record.prompt),
                        cached_len=cached,
                        uncached_len=len(context) - cached,
                        threshold=threshold,
                        ttft_s=record.ttft_s or 0.0,
                        state_bytes=state_bytes,
                        prefill_instance=prefill.name,
                        decode_instance=decode.name,
                        attempts=record.attempts,
                        resumed_from=resumed_from,
                        prefill_s=reply.prefill_s if reply is not None else 0.0,
                        exposed_transfer_s=exposed,
                        decode_cached_len=held,
                        saved_bytes=saved,
                        seed=record.sampling.seed,
                        cache_tier=tier,
                        wire_precision=narrowed,
                    )
                    if resumed_from:
                        with self.lock:
                            self.resumed += 1
                    yield pb.GenerateResponse(
                        token_ids=tokens, finished=True, report=report, **scored
                    )
                    return None
                if tokens:
                    yield pb.GenerateResponse(token_ids=tokens, report=routed, **scored)
            return Failure(grpc.StatusCode.INTERNAL, "the decode stream ended without finishing")
        except grpc.RpcError as err:
            if watch.fired:
                return Failure(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no progress for {stall_s:g} s (prefill on {prefill.name}, decode on "
                    f"{decode.name})",
                )
            # A failed prefill cancels the decode stream: report the prefill's own error.
            cause = None
            if prefill_call.done() and not prefill_call.cancelled():
                cause = prefill_call.exception()
            return Failure.of(cause if isinstance(cause, grpc.RpcError) else err)
        finally:
            self.watchdog.close(watch)
            decode_call.cancel()
            prefill_call.cancel()  # a failed decode must not leave its transfer running
            with self.lock:
                decode.assigned_decodes -= 1

    def _probe(self, *workers: WorkerHandle) -> None:
        """After a failed attempt: a worker that does not answer is taken out of routing until
        the control loop hears from it again (or its replacement registers)."""
        for worker in workers:
            try:
                worker.control.GetStats(pb.GetStatsRequest(), timeout=PROBE_TIMEOUT_S)
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    with self.lock:
                        was_down, worker.down = worker.down, True
                    if not was_down:
                        log.warning(
                            "%s does not answer (%s): not routing to it",
                            worker.name,
                            err.code().name,
                        )

    def _reused(self, reply: pb.PrefillReply | None, decision: Decision) -> int:
        """Prompt tokens the prefill worker actually reused (the decision's estimate if its
        reply is lost), counted for the hit-rate metrics."""
        cached = reply.cached_len if reply is not None else decision.cached_len
        with self.lock:
            self.prompt_tokens += decision.cached_len + decision.uncached_len
            self.cached_tokens += cached
            overestimated = cached < decision.cached_len
            self.overestimates += overestimated
        if overestimated and self.cache_feed is not None:
            # The holder's prefix was gone (an eviction raced the lookup, or the index is wrong).
            holder = decision.prefix_source if decision.moves_prefix else decision.instance
            self.cache_feed.resync(holder or decision.instance)
        return cached

    # --- workers coming and going ---------------------------------------------------------

    def update_workers(self, listing: dict[str, tuple[str, Role]]) -> list[str]:
        """Adopt a new listing of instances (a restarted worker has a new address); returns
        the names whose address changed or that are new. Requests still on a replaced handle
        finish their bookkeeping on it; new requests go to the replacement."""
        changed = []
        with self.lock:
            for name, (address, role) in listing.items():
                old = self.workers.get(name)
                if old is not None and old.address == address:
                    continue
                self.workers[name] = WorkerHandle.connect(name, address, role, self.config.security)
                changed.append(name)
        if self.cache_feed is not None:
            for name in changed:  # a restarted instance: a new cache, numbered from 1 again
                self.cache_feed.follow(name, self.workers[name].prefix)
        return changed


def _reuse_tier(
    reply: pb.PrefillReply | None, decision: Decision, source: WorkerHandle | None
) -> pb.CacheTier:
    """`RequestReport.cache_tier`: the prefill's own (its reply's), a fetched prefix named by
    the holder's role; the decision's estimate if the reply is lost."""
    if reply is not None:
        tier = reply.cache_tier
    elif decision.cached_len == 0:
        tier = pb.CACHE_TIER_NONE
    else:
        tier = pb.CACHE_TIER_PEER if source is not None else pb.CACHE_TIER_HOST
    if tier == pb.CACHE_TIER_PEER and source is not None and source.role is Role.PD_DECODE:
        return pb.CACHE_TIER_DECODE
    return tier


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
