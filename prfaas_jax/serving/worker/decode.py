"""The `DecodeWorker` service: take in states, batch their requests, stream their tokens.

The module is over 450 lines, long because one service meets a request from both sides — the
state's push and the router's `Generate`, in either order — and one engine thread serves them
all; the transfer itself is serving/transfer/, a request's record serving/worker/
decode_request.py.

A request meets the decode worker twice, in either order: the prefill worker's `PushState` (its
state, as codec frames) and the router's `Generate` (request id, prompt length, token budget).
`PushState` hands the push to the node's `PushIntake` (serving/transfer/receiver.py), which reads,
decodes and validates it as it arrives — every frame, the handoff, increments stitched onto the
KV kept for them, striped pushes gathered — and raises a `TransferError` carrying the status to
answer with (serving/transfer/api.py): INVALID_ARGUMENT for malformed input, which keeps nothing
and fails a `Generate` already waiting for that state; UNAVAILABLE or CANCELLED for a cut
transfer, which fails nothing here (the sender's status tells the router what happened). The
service then keeps the state for its request, or refuses it: a second state for one request is
ALREADY_EXISTS, one whose length differs from the prompt length the router announced is
INVALID_ARGUMENT. A `Generate` or `ReserveKv` whose request fails this node's checks (a prompt
and budget past `max_len` among them), or that the engine refuses as past its limit, ends
INVALID_ARGUMENT marked final (serving/transport/messages.py `abort_final`): the router does not
retry it. A refused state is not final: it may have been damaged on the way.

Each request's record moves only along the `LEGAL_TRANSITIONS` of its `Phase`
(serving/worker/decode_request.py): parked or waiting, ready, taken, decoding, then finished,
failed or cancelled.

One engine thread owns the decode engine (continuous batching): it inserts ready requests into
free slots as they arrive — in order, as many as the engine `fits` (with `[engine] allocator =
"paged"` a request also waits until the block pool can promise every page it may need) — runs one
`step` for all active slots, sends each request its token,
and frees a slot when its request finishes or its client goes away. A request whose `Generate`
asks for `logprobs` gets each decoded token's beside it (`DecodeResponse.logprobs`; the first
token's come from its prefill). The first token (sampled by
prefill) is sent on insertion, so time-to-first-token includes the state transfer. A request
for one token has nothing to decode and takes no slot; the engine still checks its state
(`check_state`: what `insert` checks, and with the fake engines every value), so a state that
does not match its tokens fails a 1-token request as it fails a longer one. A state that
no `Generate` claims within `state_timeout_s` is dropped, as is a `Generate` whose state never
comes (DEADLINE_EXCEEDED).

Both queues are bounded, so a burst costs refusals, not memory: at most `max_pending_states`
states are held outside a slot (received or being received, waiting for their `Generate` or for
a slot), and at most `max_waiting` `Generate` calls wait for a state or a slot. Beyond that, a
push is refused before any of its frames is read, a call at once; both RESOURCE_EXHAUSTED.

The module is over 450 lines: keeping a received state, `ReserveKv`, `Generate` and the engine
thread share one lock and one request table, and are read together.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.api import DecodeEngineLike
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.errors import LengthLimitError, UserError
from prfaas_jax.model.state import ModelState
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer.api import ReceivedState, TransferError
from prfaas_jax.serving.transfer.data_path import DataListener
from prfaas_jax.serving.transfer.increments import DecodeKvCache
from prfaas_jax.serving.transfer.receiver import IncomingPush, PushIntake
from prfaas_jax.serving.transport.messages import (
    abort_final,
    check_prompt,
    check_top_logprobs,
    logprobs_to_proto,
)
from prfaas_jax.serving.worker.decode_request import DecodeRequest, Phase

_DONE = object()
log = logging.getLogger("prfaas.decode")


class DecodeService(pb_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        *,
        engine: Callable[[], DecodeEngineLike],
        cfg: ModelConfig,
        max_len: int,
        admit: Callable[[grpc.ServicerContext], None],
        state_timeout_s: float = 120.0,
        max_pending_states: int = 256,
        max_waiting: int = 512,
        kv_cache: DecodeKvCache | None = None,
        data_path: DataListener | None = None,
    ) -> None:
        """`kv_cache`: the received KV this node keeps, so PrfaaS states can ship increments
        (serving/transfer/increments.py; None: every state comes whole); `data_path`: where
        pushes may send their frames beside the stream (serving/transfer/data_path.py; None:
        only on the stream)."""
        self._engine, self.cfg, self.max_len, self._admit = engine, cfg, max_len, admit
        self.intake = PushIntake(
            cfg, max_len, timeout_s=state_timeout_s, kv_cache=kv_cache, data_path=data_path
        )
        self.data_path = data_path
        self.state_timeout_s = state_timeout_s
        self.max_pending_states, self.max_waiting = max_pending_states, max_waiting
        # Pushes accepted and still streaming, one token each until their state is kept.
        self._receiving: set[object] = set()
        self._cv = threading.Condition()
        self._requests: dict[str, DecodeRequest] = {}
        self._ready: collections.deque[DecodeRequest] = collections.deque()
        self._slots: dict[int, DecodeRequest] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self.completed = self.tokens_generated = self.state_bytes_received = 0

    # --- stats ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._cv:
            pending = sum(1 for r in self._requests.values() if r.phase is Phase.WAITING)
            return {
                "queue_depth": len(self._ready),
                "active_slots": len(self._slots),
                "pending_states": pending,
                "completed": self.completed,
                "tokens_generated": self.tokens_generated,
                "state_bytes_received": self.state_bytes_received,
                "data_path_pushes": 0 if self.data_path is None else self.data_path.claimed,
            }

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self._requests or self._slots)

    def _held_states(self) -> int:
        """States outside a slot, received or being received (caller holds `_cv`)."""
        held = (Phase.PARKED, Phase.READY)
        return sum(1 for r in self._requests.values() if r.phase in held) + len(self._receiving)

    def _waiting(self) -> int:
        """`Generate` calls waiting for a state or a slot (caller holds `_cv`)."""
        waiting = (Phase.WAITING, Phase.READY)
        return sum(1 for r in self._requests.values() if r.phase in waiting)

    # --- PushState ------------------------------------------------------------------------

    def PushState(  # noqa: N802
        self, request_iterator: Iterator[pb.StateChunk], context: grpc.ServicerContext
    ) -> pb.PushStateReply:
        """Take in a push (serving/transfer/receiver.py), then keep its state for its request:
        parked until its `Generate` comes, or ready for a slot if it is waiting."""
        self._admit(context)
        try:
            push = self.intake.open(request_iterator, context)
        except TransferError as err:
            context.abort(err.status, str(err))
        stream = object()
        try:
            with self._cv:
                full = self._held_states() >= self.max_pending_states
                if not full:
                    self._receiving.add(stream)
            if full:  # refused before reading a frame: nothing of this stream is buffered
                push.refuse()
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{push.request_id}: {self.max_pending_states} states already wait here "
                    "for a Generate or a slot, this node's limit",
                )
            try:
                received = push.receive()
            except TransferError as err:
                if err.fails_waiting:  # its state will not come: a waiting Generate fails now
                    self._fail_waiting(push.request_id, f"its state was rejected: {err}")
                context.abort(err.status, str(err))
            if received is None:  # a secondary stripe: its frames went to the primary
                return pb.PushStateReply(frames=push.frames)
            self._start_engine_thread()
            self._keep(received, push, context, stream)
            push.deliver(received)
            return pb.PushStateReply(
                state_bytes=received.payload_nbytes,
                frames=received.frames,
                backlog_bytes=received.backlog_bytes,
                backlog_s=received.backlog_s,
            )
        finally:
            with self._cv:
                self._receiving.discard(stream)
            push.close()

    def _keep(
        self,
        received: ReceivedState,
        push: IncomingPush,
        context: grpc.ServicerContext,
        stream: object,
    ) -> None:
        """Park ``received`` for its request, or make the waiting request ready; a second
        state, or one whose length differs from the prompt's, is refused."""
        with self._cv:
            refusal = self._hold(
                received.request_id,
                received.length,
                received.state,
                received.first_token,
                received.sampling,
                received.payload_nbytes,
            )
            if refusal is None:
                # Counted as held from here on, by its phase: a push that arrives before this
                # call returns must not see the one state twice.
                self._receiving.discard(stream)
        if refusal is not None:
            push.refuse()
            context.abort(*refusal)

    def _hold(
        self,
        request_id: str,
        length: int,
        state: ModelState,
        first_token: int,
        sampling: SamplingParams | None,
        state_bytes: int,
    ) -> tuple[grpc.StatusCode, str] | None:
        """Keep ``state`` (``length`` tokens) for its request: parked until its `Generate`
        comes, or ready if it waits (caller holds `_cv`). A second state, or one whose length
        differs from the prompt's, keeps nothing: the status and message to refuse it with."""
        req = self._requests.setdefault(request_id, DecodeRequest(request_id, time.monotonic()))
        if req.phase not in (Phase.NEW, Phase.WAITING):  # parked, or on its way by now
            return grpc.StatusCode.ALREADY_EXISTS, f"{request_id}: state already received"
        if req.phase is Phase.WAITING and length != req.prompt_len:
            self._fail(req, f"the state holds {length} tokens, the prompt has {req.prompt_len}")
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request_id}: state length {length} ≠ prompt length {req.prompt_len}",
            )
        req.state, req.first_token = state, first_token
        req.sampling, req.state_bytes = sampling, state_bytes
        self.state_bytes_received += state_bytes
        if req.phase is Phase.WAITING:
            self._make_ready(req)
        else:
            req.move(Phase.PARKED)
        return None

    def DataPath(  # noqa: N802
        self, request: pb.DataPathRequest, context: grpc.ServicerContext
    ) -> pb.DataPathReply:
        return pb.DataPathReply(port=0 if self.data_path is None else self.data_path.port)

    def ReserveKv(  # noqa: N802
        self, request: pb.KvReserveRequest, context: grpc.ServicerContext
    ) -> pb.KvReserveReply:
        """How many leading positions of the prompt's KV this node holds, kept for the
        request's coming state (0 without a cache)."""
        self._admit(context)
        tokens = list(request.prompt_token_ids)
        try:
            if not request.request_id:
                raise UserError("request_id is empty")
            check_prompt(tokens, self.cfg, max_len=self.max_len, max_new_tokens=1)
        except UserError as err:
            abort_final(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        kv_cache = self.intake.kv_cache
        if kv_cache is None:
            return pb.KvReserveReply(cached_len=0)
        return pb.KvReserveReply(cached_len=kv_cache.reserve(request.request_id, tokens))

    def _make_ready(self, req: DecodeRequest) -> None:
        """Both halves are here: queue it for a slot (caller holds `_cv`)."""
        req.move(Phase.READY)
        self._ready.append(req)
        self._cv.notify_all()

    def _fail(self, req: DecodeRequest, message: str, *, final: bool = False) -> None:
        """``req``'s stream ends INVALID_ARGUMENT; ``final``: marked so (`abort_final`)."""
        req.out.put((grpc.StatusCode.INVALID_ARGUMENT, message, final))

    def _fail_waiting(self, request_id: str, message: str) -> None:
        """A `Generate` already waiting for ``request_id``'s state fails now rather than at its
        timeout: its sender's push failed, so no state comes."""
        with self._cv:
            req = self._requests.get(request_id)
            if req is not None and req.phase is Phase.WAITING:
                self._fail(req, f"{request_id}: {message}")

    # --- Generate -------------------------------------------------------------------------

    def Generate(  # noqa: N802
        self, request: pb.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.DecodeResponse]:
        self._admit(context)
        n = request.max_new_tokens
        # The request itself: final, another attempt would meet the same refusal.
        if not request.request_id or request.prompt_len < 1 or n < 1:
            abort_final(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "need a request_id, prompt_len ≥ 1 and max_new_tokens ≥ 1",
            )
        if request.prompt_len + n - 1 > self.max_len:
            abort_final(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_len + max_new_tokens − 1 exceed max_len {self.max_len}",
            )
        top = None
        if request.HasField("logprobs"):
            try:
                top = check_top_logprobs(request.logprobs)
            except UserError as err:
                abort_final(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        self._start_engine_thread()
        with self._cv:
            if self._waiting() >= self.max_waiting:
                early = self._requests.get(request.request_id)
                if early is not None and early.phase is Phase.PARKED:
                    del self._requests[request.request_id]  # no Generate will claim its state
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{request.request_id}: {self.max_waiting} requests already wait here "
                    "for a state or a slot, this node's limit",
                )
            req = self._requests.setdefault(
                request.request_id, DecodeRequest(request.request_id, time.monotonic())
            )
            if req.claimed:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"{req.request_id} is already decoding"
                )
            req.prompt_len, req.max_new_tokens, req.logprobs = request.prompt_len, n, top
            if req.phase is Phase.PARKED:
                assert req.state is not None
                length = int(np.asarray(req.state.lengths)[0])
                if length != req.prompt_len:
                    del self._requests[req.request_id]
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"state length {length} ≠ prompt length {req.prompt_len}",
                    )
                self._make_ready(req)
            else:
                req.move(Phase.WAITING)
        context.add_callback(lambda: self._cancel(req))
        try:
            yield from self._stream(req, context)
        finally:
            self._cancel(req)  # as the handler ends: the record leaves the table in a final phase

    def _stream(
        self, req: DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.DecodeResponse]:
        first = True
        deadline = time.monotonic() + self.state_timeout_s
        while True:
            try:
                item = req.out.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{req.request_id}: no state or token within {self.state_timeout_s:.0f} s",
                )
            tokens, scored, done = [], [], False
            while True:  # everything already queued goes into one message
                if item is _DONE:
                    done = True
                elif isinstance(item, pb.TokenLogprob):  # a token with its log-probabilities
                    tokens.append(item.token_id)
                    scored.append(item)
                elif isinstance(item, tuple):
                    code, details, final = item
                    if final:
                        abort_final(context, code, details)
                    context.abort(code, details)
                else:
                    tokens.append(item)
                try:
                    item = req.out.get_nowait()
                except queue.Empty:
                    break
            yield pb.DecodeResponse(
                token_ids=tokens,
                finished=done,
                state_bytes=req.state_bytes if first else 0,
                logprobs=scored,
            )
            first = False
            if done:
                return
            deadline = time.monotonic() + self.state_timeout_s

    def _cancel(self, req: DecodeRequest) -> None:
        """The RPC ended (finished, or its client went away): release what the request holds."""
        with self._cv:
            if not req.ended:
                req.move(Phase.CANCELLED)
            if self._requests.get(req.request_id) is req:
                del self._requests[req.request_id]
            self._cv.notify_all()
        req.out.put(_DONE)  # wakes a stream still waiting for its state or next token

    # --- the engine thread ----------------------------------------------------------------

    def _start_engine_thread(self) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def _take_ready(self, engine: DecodeEngineLike) -> list[DecodeRequest]:
        """The ready requests, in order, that the engine can take now (`fits`: free slots, and
        with the paged engine every page each may need). One the engine cannot take even with
        nothing live is taken all the same: its insert says why, and it fails."""
        with self._cv:
            self._reap()
            while not (self._ready or self._slots or self._prompts() or self._stop):
                self._cv.wait(timeout=1.0)
                self._reap()
            wanted = [(req.prompt_len, max(1, req.max_new_tokens - 1)) for req in self._ready]
            count = engine.fits(wanted)
            if not count and self._ready and not self._slots:
                count = 1
            taken = [self._ready.popleft() for _ in range(count)]
            for req in taken:
                self._advance(req, Phase.TAKEN)
            return taken

    def _prompts(self) -> int:
        """Prompts this node prefills itself, waiting or under way (none here: a mixed node's,
        serving/worker/mixed.py; caller holds `_cv`)."""
        return 0

    def _step(self, engine: DecodeEngineLike) -> list[tuple[int, int]]:
        """One step of the engine's active slots (a mixed node's carries a prompt's chunk)."""
        return engine.step()

    def _reap(self) -> None:
        """Drop states that no Generate claimed in time (the router gave up on them)."""
        limit = time.monotonic() - self.state_timeout_s
        for rid, req in list(self._requests.items()):
            if req.phase is Phase.PARKED and req.created < limit:
                del self._requests[rid]

    def _advance(self, req: DecodeRequest, to: Phase) -> None:
        """The engine thread moves `req` on, unless its call was cancelled meanwhile: a cancel
        may land between any two steps of this thread, and CANCELLED is final (caller holds
        `_cv`)."""
        if req.phase is not Phase.CANCELLED:
            req.move(to)

    def _finish(self, req: DecodeRequest) -> None:
        with self._cv:
            self._advance(req, Phase.FINISHED)
            self.completed += 1
        req.out.put(_DONE)

    def _run(self) -> None:
        engine = self._engine()
        while not self._stop:
            try:
                self._iterate(engine)
            except Exception as err:  # a bug in a step must not hang every stream until timeout
                log.exception("decode step failed")
                with self._cv:
                    failed = list(self._slots.items())
                    self._slots.clear()
                    for _, req in failed:
                        if req.phase is Phase.DECODING:  # a cancelled one stays cancelled
                            req.move(Phase.FAILED)
                for slot, req in failed:
                    req.out.put((grpc.StatusCode.INTERNAL, f"decode engine: {err}", False))
                    with contextlib.suppress(Exception):
                        engine.free(slot)

    def _iterate(self, engine: DecodeEngineLike) -> None:
        """Admit ready requests into free slots, then one step for every active slot."""
        for req in self._take_ready(engine):
            if req.phase is Phase.CANCELLED:
                continue
            req.out.put(req.first_token)
            with self._cv:
                self.tokens_generated += 1
            slot = None
            try:
                if req.max_new_tokens == 1:
                    # Prefill sampled the only token: nothing to decode, no slot to take, but
                    # the engine still checks the state as insert would.
                    engine.check_state(req.state)
                else:
                    slot = engine.insert(
                        req.state,
                        req.first_token,
                        req.sampling,
                        max_new_tokens=req.max_new_tokens - 1,
                        logprobs=req.logprobs,
                    )
            except Exception as err:  # the engine refused the state: fail this request only
                with self._cv:
                    self._advance(req, Phase.FAILED)
                # Past the engine's limit: final. A state that does not check may be damage.
                final = isinstance(err, LengthLimitError)
                self._fail(req, f"decode engine: {err}", final=final)
                continue
            req.state = None  # a slot holds it now, or no one needs it; let the host copy go
            if slot is None:
                self._finish(req)
                continue
            with self._cv:
                self._advance(req, Phase.DECODING)
                self._slots[slot] = req  # a cancelled one too: the sweep below frees its slot
        for slot, req in list(self._slots.items()):
            if req.phase is Phase.CANCELLED:
                engine.free(slot)
                with self._cv:
                    del self._slots[slot]
        if not (self._slots or self._prompts()):
            return
        produced = self._step(engine)
        with self._cv:
            self.tokens_generated += len(produced)
        for slot, token in produced:
            req = self._slots[slot]
            scored = engine.logprobs(slot)
            # A scored token is queued with its log-probabilities, as one item: the stream never
            # sends one without the other.
            req.out.put(token if scored is None else logprobs_to_proto(scored))
            if engine.is_finished(slot):
                engine.free(slot)
                with self._cv:
                    del self._slots[slot]
                self._finish(req)
