"""The `DecodeWorker` service: receive states, batch their requests, stream their tokens.

A request meets the decode worker twice, in either order: the prefill worker's `PushState`
(the codec frames — header, data frames as prefill makes them, trailer — and the handoff frame)
and the router's `Generate` (request id, prompt length, token budget). `PushState` decodes the
stream as it arrives (push_decoder.py: each frame placed into the state being built, so no push
is held whole) and validates everything before a request can use it — the handoff (its first
token must be in the vocabulary) and every frame (`codec.StreamDecoder`: magic, version, model
fingerprint, stream id, checksums, shapes, completeness, the trailer's CRCs) — and refuses a
state longer than the node can decode, or one whose length differs from the prompt length the
router announced. A state sent as an increment (its header's base: the KV rows this node said
it holds, `ReserveKv`) is stitched onto the rows kept for it, and a PrfaaS state's KV is cached
for the prompt's next turn (serving/worker/decode_cache.py); a striped one is gathered from its
streams first. Malformed input is INVALID_ARGUMENT and keeps nothing (a `Generate` already
waiting for that state fails with it), a second state or stream for one request ALREADY_EXISTS.
A stream its sender cancelled is a cut transfer, not malformed input — also where gRPC ends it
like a complete one before reporting the cancel — so it fails nothing here: the sender's
status tells the router what happened. A push whose first message names a data ticket brings
its frames on the data connection with that ticket (`data_path`, serving/transport/
data_path.py), read exactly as messages would be; one that closes before its `end` record is
cut in the same way (UNAVAILABLE), and a cancelled call closes it.

Each request's record moves only along the `LEGAL_TRANSITIONS` of its `Phase`
(serving/worker/decode_request.py): parked or waiting, ready, taken, decoding, then finished,
failed or cancelled.

One engine thread owns the `DecodeEngine` (continuous batching): it inserts ready requests into
free slots as they arrive, runs one `step` for all active slots, sends each request its token,
and frees a slot when its request finishes or its client goes away. The first token (sampled by
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

The module is over 500 lines: `PushState` (whole or striped: serving/worker/stripes.py),
`ReserveKv`, `Generate` and the engine thread share one lock and one request table, and are
read together; reading a push (push_reader.py), decoding it (push_decoder.py), the data
connections pushes may bring their frames on (serving/transport/data_path.py) and the
received-KV cache (decode_cache.py) live beside it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.api import DecodeEngineLike
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.policy.link_capacity import FrameArrival, backlog_sample
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.data_path import DataListener, DataReceiver, TransferCutError
from prfaas_jax.serving.transport.messages import check_prompt
from prfaas_jax.serving.worker.decode_cache import DecodeKvCache
from prfaas_jax.serving.worker.decode_request import DecodeRequest, Phase
from prfaas_jax.serving.worker.push_decoder import PushDecoder
from prfaas_jax.serving.worker.push_reader import PushReader, PushTooLongError
from prfaas_jax.serving.worker.stripes import MAX_STRIPES, StripeError, StripeSet

_DONE = object()
# How long a stream that stopped short waits for gRPC to report its sender's cancel: the server
# sees a cancelled request stream end before it learns of the cancel (milliseconds apart).
_CANCEL_SEEN_S = 1.0
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
        (serving/worker/decode_cache.py; None: every state comes whole); `data_path`: where
        pushes may send their frames beside the stream (serving/transport/data_path.py; None:
        only on the stream)."""
        self._engine, self.cfg, self.max_len, self._admit = engine, cfg, max_len, admit
        self.kv_cache, self.data_path = kv_cache, data_path
        self.stripes = StripeSet(state_timeout_s)  # striped pushes in progress
        self.state_timeout_s = state_timeout_s
        self.max_pending_states, self.max_waiting = max_pending_states, max_waiting
        # Pushes accepted and still streaming, one token each until their state is kept.
        self._receiving: set[object] = set()
        # Frames of the longest state this node decodes, with generous room for headers.
        self.max_push_bytes = 2 * state_nbytes(cfg, max_len) + 2**20
        self._cv = threading.Condition()
        self._requests: dict[str, DecodeRequest] = {}
        self._ready: collections.deque[DecodeRequest] = collections.deque()
        self._slots: dict[int, DecodeRequest] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self.completed = self.tokens_generated = self.state_bytes_received = 0
        self._reader = PushReader(self.max_push_bytes)

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
        self._admit(context)
        first = next(request_iterator, None)
        if first is None or not first.request_id:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message must name the request"
            )
        stripes = first.stripes or 1
        if not (stripes <= MAX_STRIPES and first.stripe < stripes):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stripe {first.stripe} of {stripes}: at most {MAX_STRIPES}, numbered from 0",
            )
        receiver = self._claim(first, context) if first.data_ticket else None
        stream = object()
        try:
            with self._cv:
                full = self._held_states() >= self.max_pending_states
                if not full:
                    self._receiving.add(stream)
            if full:  # refused before reading a frame: nothing of this stream is buffered
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{first.request_id}: {self.max_pending_states} states already wait here "
                    "for a Generate or a slot, this node's limit",
                )
            if first.stripe > 0:
                chunks = request_iterator if receiver is None else receiver.chunks()
                return self._receive_stripe(first, chunks, context)
            return self._receive(first, request_iterator, context, stream, receiver)
        finally:
            with self._cv:
                self._receiving.discard(stream)
            if receiver is not None:
                receiver.close()

    def _claim(self, first: pb.StateChunk, context: grpc.ServicerContext) -> DataReceiver:
        """The data connection whose ticket ``first`` names; a cancelled call closes it."""
        if self.data_path is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{first.request_id}: this worker has no data path (DataPath port 0)",
            )
        try:
            receiver = self.data_path.claim(first.data_ticket)
        except TransferCutError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{first.request_id}: {err}")
        context.add_callback(receiver.interrupt)
        return receiver

    def DataPath(  # noqa: N802
        self, request: pb.DataPathRequest, context: grpc.ServicerContext
    ) -> pb.DataPathReply:
        return pb.DataPathReply(port=0 if self.data_path is None else self.data_path.port)

    def _receive(
        self,
        first: pb.StateChunk,
        request_iterator: Iterator[pb.StateChunk],
        context: grpc.ServicerContext,
        stream: object,
        receiver: DataReceiver | None = None,
    ) -> pb.PushStateReply:
        """Read, validate and keep the state that `first` announced; `stream` is this push's
        token in `_receiving`; `receiver`: the data connection that brings its frames, each
        data frame's payload received straight into the state (None: the stream brings them)."""
        ended = threading.Event()
        context.add_callback(ended.set)  # before the handler returns, only a cancel ends the call
        push = PushDecoder(self.cfg, self.max_len)
        if receiver is not None:
            request_iterator = receiver.chunks(place=push.place)
        arrivals, _ = self._read(first, request_iterator, context, push.take)
        if not push.ends_with_handoff and ended.wait(_CANCEL_SEEN_S):
            # A cut transfer, not a malformed one: its sender reports the failure.
            context.abort(grpc.StatusCode.CANCELLED, f"{first.request_id}: the sender cancelled")
        others: list[bytes] = []
        if first.stripes > 1:  # the other stripes' data frames (serving/worker/stripes.py)
            try:
                others, arrivals = self.stripes.others(
                    first.request_id, first.stripes, push.frames, arrivals
                )
            except StripeError as err:
                context.abort(grpc.StatusCode.ABORTED, str(err))
        try:
            handoff = push.handoff(others)
            vocab = self.cfg.vocab_size
            if not 0 <= handoff.first_token < vocab:
                raise UserError(
                    f"handoff first token {handoff.first_token} outside the vocabulary [0, {vocab})"
                )
            reserved = self.kv_cache.take(first.request_id) if self.kv_cache else None
            base = reserved.prefix if reserved is not None and reserved.prefix.length else None
            state = push.state(base)
            state_bytes = push.payload_nbytes
        except UserError as err:
            self._reject(context, first.request_id, str(err))
        self._start_engine_thread()
        length = int(np.asarray(state.lengths)[0])
        with self._cv:
            req = self._requests.setdefault(
                first.request_id, DecodeRequest(first.request_id, time.monotonic())
            )
            if req.phase not in (Phase.NEW, Phase.WAITING):  # parked, or on its way by now
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS, f"{req.request_id}: state already received"
                )
            if req.phase is Phase.WAITING and length != req.prompt_len:
                self._fail(req, f"the state holds {length} tokens, the prompt has {req.prompt_len}")
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{req.request_id}: state length {length} ≠ prompt length {req.prompt_len}",
                )
            # Counted as held from here on, by its phase: a push that arrives before this call
            # returns must not see the one state twice.
            self._receiving.discard(stream)
            req.state, req.first_token, req.sampling = state, handoff.first_token, handoff.sampling
            req.state_bytes = state_bytes
            self.state_bytes_received += state_bytes
            if req.phase is Phase.WAITING:
                self._make_ready(req)
            else:
                req.move(Phase.PARKED)
        if reserved is not None and length == len(reserved.tokens):
            # This state's KV serves the prompt's next turn (serving/worker/decode_cache.py).
            self.kv_cache.keep(reserved, state)  # type: ignore[union-attr]
        # The sender learns its link's capacity from this (policy/link_capacity.py).
        backlog_bytes, backlog_s = backlog_sample(arrivals)
        return pb.PushStateReply(
            state_bytes=state_bytes,
            frames=push.frames + len(others),
            backlog_bytes=backlog_bytes,
            backlog_s=backlog_s,
        )

    def _read(
        self,
        first: pb.StateChunk,
        chunks: Iterator[pb.StateChunk],
        context: grpc.ServicerContext,
        take: Callable[[bytes], None],
    ) -> tuple[list[FrameArrival], bool]:
        """Read a push, handing its frames to ``take``; malformed frames or a push past the
        byte limit are refused as they come."""
        try:
            return self._reader.read(first, chunks, context, take)
        except PushTooLongError:
            too_long = f"state stream exceeds {self.max_push_bytes} bytes, more than a "
            self._reject(context, first.request_id, f"{too_long}{self.max_len}-token state of it")
        except UserError as err:
            self._reject(context, first.request_id, str(err))
        except TransferCutError as err:  # a cut transfer: it fails nothing here
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{first.request_id}: {err}")

    def _receive_stripe(
        self,
        first: pb.StateChunk,
        request_iterator: Iterator[pb.StateChunk],
        context: grpc.ServicerContext,
    ) -> pb.PushStateReply:
        """A secondary stripe: its data frames wait for the request's primary stream."""
        rid, stripe, stripes = first.request_id, first.stripe, first.stripes
        try:
            frames: list[bytes] = []
            arrivals, last = self._read(first, request_iterator, context, frames.append)
        except Exception:  # refused (too long): the primary must not wait for it either
            self.stripes.fail(rid, stripes, f"stripe {stripe} of {stripes} was refused")
            raise
        if not last:  # cut: the primary must not wait for it
            self.stripes.fail(rid, stripes, f"stripe {stripe} of {stripes} was cut")
            context.abort(grpc.StatusCode.CANCELLED, f"{rid}: stripe {stripe} was cut")
        try:
            self.stripes.deposit(rid, stripe, stripes, frames, arrivals)
        except StripeError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        # The link is timed over all stripes together, in stripe 0's reply.
        return pb.PushStateReply(frames=len(frames))

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
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if self.kv_cache is None:
            return pb.KvReserveReply(cached_len=0)
        return pb.KvReserveReply(cached_len=self.kv_cache.reserve(request.request_id, tokens))

    def _make_ready(self, req: DecodeRequest) -> None:
        """Both halves are here: queue it for a slot (caller holds `_cv`)."""
        req.move(Phase.READY)
        self._ready.append(req)
        self._cv.notify_all()

    def _fail(self, req: DecodeRequest, message: str) -> None:
        req.out.put((grpc.StatusCode.INVALID_ARGUMENT, message))

    def _reject(self, context: grpc.ServicerContext, request_id: str, message: str) -> NoReturn:
        """Refuse a pushed state (nothing of it is kept). A `Generate` already waiting for it
        fails now rather than at its timeout: its sender's push failed, so no state comes."""
        with self._cv:
            req = self._requests.get(request_id)
            if req is not None and req.phase is Phase.WAITING:
                self._fail(req, f"{request_id}: its state was rejected: {message}")
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        raise AssertionError("context.abort returned")

    # --- Generate -------------------------------------------------------------------------

    def Generate(  # noqa: N802
        self, request: pb.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.DecodeResponse]:
        self._admit(context)
        n = request.max_new_tokens
        if not request.request_id or request.prompt_len < 1 or n < 1:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "need a request_id, prompt_len ≥ 1 and max_new_tokens ≥ 1",
            )
        if request.prompt_len + n - 1 > self.max_len:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt_len + max_new_tokens − 1 exceed max_len {self.max_len}",
            )
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
            req.prompt_len, req.max_new_tokens = request.prompt_len, n
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
            tokens, done = [], False
            while True:  # everything already queued goes into one message
                if item is _DONE:
                    done = True
                elif isinstance(item, tuple):
                    context.abort(*item)
                else:
                    tokens.append(item)
                try:
                    item = req.out.get_nowait()
                except queue.Empty:
                    break
            yield pb.DecodeResponse(
                token_ids=tokens, finished=done, state_bytes=req.state_bytes if first else 0
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

    def _take_ready(self, free: int) -> list[DecodeRequest]:
        with self._cv:
            self._reap()
            while not self._ready and not self._slots and not self._stop:
                self._cv.wait(timeout=1.0)
                self._reap()
            taken = []
            while self._ready and len(taken) < free:
                req = self._ready.popleft()
                self._advance(req, Phase.TAKEN)
                taken.append(req)
            return taken

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
                    req.out.put((grpc.StatusCode.INTERNAL, f"decode engine: {err}"))
                    with contextlib.suppress(Exception):
                        engine.free(slot)

    def _iterate(self, engine: DecodeEngineLike) -> None:
        """Admit ready requests into free slots, then one step for every active slot."""
        for req in self._take_ready(engine.max_slots - len(self._slots)):
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
                    )
            except Exception as err:  # the engine refused the state: fail this request only
                with self._cv:
                    self._advance(req, Phase.FAILED)
                req.out.put((grpc.StatusCode.INVALID_ARGUMENT, f"decode engine: {err}"))
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
        if not self._slots:
            return
        produced = engine.step()
        with self._cv:
            self.tokens_generated += len(produced)
        for slot, token in produced:
            req = self._slots[slot]
            req.out.put(token)
            if engine.is_finished(slot):
                engine.free(slot)
                with self._cv:
                    del self._slots[slot]
                self._finish(req)
