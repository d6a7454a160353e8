"""The decode side of state transfers: `PushIntake`, where a decode worker takes in pushes, and
`IncomingPush`, one push (`api.StateReceiver`).

`PushIntake.open` reads a `PushState` call's first message (request id, stripe, data ticket) and
claims the push's data connection if it names one (data_path.py); `IncomingPush.receive` then
reads the frames — from the call's messages or the data connection, where a data frame's payload
lands straight in the state — and decodes them as they arrive (push_decoder.py: each frame placed
into the state being built, so no push is held whole), validating everything before a request
can use it: every frame (`codec.StreamDecoder`: magic, version, model fingerprint, stream id,
checksums, shapes, completeness, the trailer's CRCs), the handoff (its first token must be in the
vocabulary) and the length (a push past the bytes of the longest state this node decodes is
refused as it comes). A state sent as an increment (its header's base: the KV rows this node said
it holds) is stitched onto the rows kept for it (increments.py); a striped one is gathered from
its streams first (stripes.py): a secondary stripe's frames wait for the primary, whose `receive`
returns the whole state.

Everything that ends a push early is a `TransferError` carrying its status (api.py's table): the
decode service answers with it, and fails a `Generate` already waiting for the state when the
error says so. A stream that stops short because its sender cancelled it — also where gRPC ends
it like a complete one before reporting the cancel — is a cut transfer, not a malformed one, as
is a data connection that closes before its `end` record.

The decode service then takes the state (`deliver`, which also keeps a PrfaaS state's KV for
the prompt's next turn) or refuses it (`refuse`: a second state for one request, a length that
differs from the prompt's, a full node).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.policy.link_capacity import FrameArrival, backlog_sample
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transfer.api import (
    InvalidPushError,
    ReceivedState,
    RejectedStateError,
    SenderCancelledError,
    StripeError,
    Transfer,
    TransferCutError,
    TransferError,
    TransferLedger,
    TransferPhase,
)
from prfaas_jax.serving.transfer.data_path import DataListener, DataReceiver
from prfaas_jax.serving.transfer.increments import DecodeKvCache, Reservation
from prfaas_jax.serving.transfer.push_decoder import PushDecoder
from prfaas_jax.serving.transfer.push_reader import PushReader, PushTooLongError
from prfaas_jax.serving.transfer.stripes import MAX_STRIPES, StripeSet

# How long a stream that stopped short waits for gRPC to report its sender's cancel: the server
# sees a cancelled request stream end before it learns of the cancel (milliseconds apart).
_CANCEL_SEEN_S = 1.0


class PushIntake:
    """A decode worker's receiving end, shared by its pushes (module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        *,
        timeout_s: float = 120.0,
        kv_cache: DecodeKvCache | None = None,
        data_path: DataListener | None = None,
        ledger: TransferLedger | None = None,
    ) -> None:
        """`timeout_s`: how long a striped transfer's primary waits for its other stripes;
        `kv_cache`: the received KV this node keeps, so PrfaaS states can ship increments
        (None: every state comes whole); `data_path`: where pushes may send their frames beside
        the stream (None: only on the stream); `ledger`: where pushes' final phases are
        counted."""
        self.cfg, self.max_len = cfg, max_len
        self.kv_cache, self.data_path = kv_cache, data_path
        self.ledger = ledger if ledger is not None else TransferLedger()
        self.stripes = StripeSet(timeout_s)  # striped pushes in progress
        # Frames of the longest state this node decodes, with generous room for headers.
        self.max_push_bytes = 2 * state_nbytes(cfg, max_len) + 2**20
        self.reader = PushReader(self.max_push_bytes)

    def open(
        self, request_iterator: Iterator[pb.StateChunk], context: grpc.ServicerContext
    ) -> IncomingPush:
        """The push whose call brings ``request_iterator``: its first message read and checked,
        its data connection claimed (a cancelled call closes it)."""
        first = next(request_iterator, None)
        if first is None or not first.request_id:
            raise InvalidPushError("the first message must name the request")
        stripes = first.stripes or 1
        if not (stripes <= MAX_STRIPES and first.stripe < stripes):
            raise InvalidPushError(
                f"stripe {first.stripe} of {stripes}: at most {MAX_STRIPES}, numbered from 0"
            )
        push = IncomingPush(self, first, request_iterator, context)
        if first.data_ticket:
            try:
                push.claim_data_connection()
            except (InvalidPushError, TransferCutError) as err:
                push.transfer.end(err.ends_in)
                raise
        return push


class IncomingPush:
    """One push at the decode worker (`api.StateReceiver`; module docstring)."""

    def __init__(
        self,
        intake: PushIntake,
        first: pb.StateChunk,
        request_iterator: Iterator[pb.StateChunk],
        context: grpc.ServicerContext,
    ) -> None:
        self._intake, self._first, self._context = intake, first, context
        self._chunks: Iterator[pb.StateChunk] = request_iterator
        self.request_id, self.stripe = first.request_id, first.stripe
        self.transfer = Transfer(first.request_id, intake.ledger)
        self.frames = 0  # this stream's
        self._data: DataReceiver | None = None
        self._reserved: Reservation | None = None

    def claim_data_connection(self) -> None:
        listener = self._intake.data_path
        if listener is None:
            raise InvalidPushError(
                f"{self.request_id}: this worker has no data path (DataPath port 0)"
            )
        try:
            self._data = listener.claim(self._first.data_ticket)
        except TransferCutError as err:
            raise TransferCutError(f"{self.request_id}: {err}") from err
        self._context.add_callback(self._data.interrupt)

    def receive(self) -> ReceivedState | None:
        try:
            if self.stripe > 0:
                self._receive_stripe()
                return None
            return self._receive_whole()
        except TransferError as err:
            self.transfer.end(err.ends_in)
            raise

    def _receive_whole(self) -> ReceivedState:
        intake, first = self._intake, self._first
        ended = threading.Event()
        self._context.add_callback(ended.set)  # before the handler returns, only a cancel ends it
        push = PushDecoder(intake.cfg, intake.max_len)
        chunks = self._chunks if self._data is None else self._data.chunks(place=push.place)
        arrivals, _ = self._read(chunks, push.take)
        if not push.ends_with_handoff and ended.wait(_CANCEL_SEEN_S):
            raise SenderCancelledError(f"{self.request_id}: the sender cancelled")
        others: list[bytes] = []
        if first.stripes > 1:  # the other stripes' data frames (stripes.py)
            others, arrivals = intake.stripes.others(
                self.request_id, first.stripes, push.frames, arrivals
            )
        try:
            handoff = push.handoff(others)
            vocab = intake.cfg.vocab_size
            if not 0 <= handoff.first_token < vocab:
                raise UserError(
                    f"handoff first token {handoff.first_token} outside the vocabulary [0, {vocab})"
                )
            kv_cache = intake.kv_cache
            self._reserved = kv_cache.take(self.request_id) if kv_cache is not None else None
            reserved = self._reserved
            base = reserved.prefix if reserved is not None and reserved.prefix.length else None
            state = push.state(base)
        except UserError as err:
            raise RejectedStateError(str(err)) from err
        self.transfer.move(TransferPhase.SEALED)
        backlog_bytes, backlog_s = backlog_sample(arrivals)  # the sender learns its link from it
        return ReceivedState(
            request_id=self.request_id,
            state=state,
            length=int(np.asarray(state.lengths)[0]),
            first_token=handoff.first_token,
            sampling=handoff.sampling,
            payload_nbytes=push.payload_nbytes,
            frames=push.frames + len(others),
            backlog_bytes=backlog_bytes,
            backlog_s=backlog_s,
        )

    def _receive_stripe(self) -> None:
        """A secondary stripe: its data frames wait for the request's primary stream."""
        intake, rid = self._intake, self.request_id
        stripe, stripes = self.stripe, self._first.stripes
        chunks = self._chunks if self._data is None else self._data.chunks()
        frames: list[bytes] = []
        try:
            arrivals, last = self._read(chunks, frames.append)
        except Exception:  # refused (too long): the primary must not wait for it either
            intake.stripes.fail(rid, stripes, f"stripe {stripe} of {stripes} was refused")
            raise
        if not last:  # cut: the primary must not wait for it
            intake.stripes.fail(rid, stripes, f"stripe {stripe} of {stripes} was cut")
            raise SenderCancelledError(f"{rid}: stripe {stripe} was cut")
        try:
            intake.stripes.deposit(rid, stripe, stripes, frames, arrivals)
        except StripeError as err:
            raise InvalidPushError(str(err)) from err
        # Its part is with the primary, which times the link over all stripes together.
        self.transfer.move(TransferPhase.SEALED)
        self.transfer.move(TransferPhase.DELIVERED)

    def _read(
        self, chunks: Iterator[pb.StateChunk], take: Callable[[bytes], None]
    ) -> tuple[list[FrameArrival], bool]:
        """Read the push, handing its frames to ``take``; malformed frames or a push past the
        byte limit are refused as they come."""
        intake = self._intake

        def counted(frame: bytes) -> None:
            self.frames += 1
            self.transfer.advance(TransferPhase.STREAMING)
            take(frame)

        try:
            return intake.reader.read(self._first, chunks, self._context, counted)
        except PushTooLongError as err:
            too_long = f"state stream exceeds {intake.max_push_bytes} bytes, more than a "
            raise RejectedStateError(f"{too_long}{intake.max_len}-token state of it") from err
        except TransferCutError as err:  # a cut transfer: it fails nothing here
            raise TransferCutError(f"{self.request_id}: {err}") from err
        except grpc.RpcError as err:  # how a cancelled call's request stream ends
            raise SenderCancelledError(f"{self.request_id}: the sender cancelled") from err
        except UserError as err:
            raise RejectedStateError(str(err)) from err

    def deliver(self, received: ReceivedState) -> None:
        """The decode service took the state: a PrfaaS state's KV serves the prompt's next
        turn (increments.py)."""
        self.transfer.move(TransferPhase.DELIVERED)
        reserved = self._reserved
        if reserved is not None and received.length == len(reserved.tokens):
            self._intake.kv_cache.keep(reserved, received.state)  # type: ignore[union-attr]

    def refuse(self) -> None:
        self.transfer.end(TransferPhase.REFUSED)

    def close(self) -> None:
        """Release the data connection; a push the service left without a verdict (a bug, or
        the process stopping) is abandoned."""
        self.transfer.end(TransferPhase.ABANDONED)
        if self._data is not None:
            self._data.close()
