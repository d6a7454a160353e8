"""The state transfer's contract: the sender and the receiver of one request's state, the phases
a transfer walks through at either end, and the errors that end one early.

A transfer carries the `ModelState` a prefill worker made to the decode worker that decodes the
request, as codec frames (docs/wire-format.md): the header, the data frames as prefill finishes
them, the trailer and the handoff frame (first token and sampling). `StateSender`
(`sender.StatePush`) is the prefill side, `StateReceiver` (`receiver.IncomingPush`) the decode
side; the worker services only drive them and answer with the status an error carries.

Each end keeps a `Transfer` record whose phase moves only along `LEGAL_TRANSITIONS`::

    OPENED ─→ STREAMING ─→ SEALED ─→ DELIVERED
       └──────────┴───────────┴────→ CUT | REFUSED | ABANDONED

- OPENED — sender: set up for a request, its `PushState` calls open as prefill starts;
  receiver: a push's first message is read and valid.
- STREAMING — a frame was put (sender) or arrived (receiver).
- SEALED — sender: the last frames (tail, trailer, handoff) are queued; receiver: the stream
  ended whole and decoded.
- DELIVERED — sender: every push answered OK; receiver: the decode service took the state.
- CUT — the link, a stream or a data connection broke (at the receiver also: the sender
  cancelled).
- REFUSED — the decode worker answered with an error (sender); the state or the push is not
  acceptable (receiver).
- ABANDONED — sender: the prefill side gave up (the router cancelled, prefill failed);
  receiver: the service stopped without a verdict.

The last four are final. Every error that ends a transfer early is a `TransferError`, which
says where the transfer ends (`ends_in`), the gRPC status the service answers with (`status`),
and whether a `Generate` already waiting for the state fails at once (`fails_waiting`: the state
will never come, so the caller need not wait for its timeout):

| error | ends in | status | fails waiting |
|---|---|---|---|
| `InvalidPushError` | REFUSED | INVALID_ARGUMENT | no |
| `RejectedStateError` | REFUSED | INVALID_ARGUMENT | yes |
| `TransferCutError` | CUT | UNAVAILABLE | no |
| `SenderCancelledError` | CUT | CANCELLED | no |
| `StripeError` | REFUSED | ABORTED | no |
| `PushFailedError` | CUT or REFUSED | the decode worker's | — |

- `InvalidPushError`: a first message that names no request, bad stripe numbers, a data ticket
  where the node has no data path, a stripe that disagrees with its siblings.
- `RejectedStateError`: malformed frames, a push past the byte limit, a handoff outside the
  vocabulary.
- `TransferCutError`: a data connection closed before its `end`, or never came; at the sender,
  a push cancelled under its stream.
- `SenderCancelledError`: a stream that stopped short because its sender cancelled it.
- `StripeError`: a striped transfer cannot be put together (a stripe missing or cut).
- `PushFailedError`: the sender's view of a push the decode worker ended with an error.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import grpc

from prfaas_jax.engine.codec.format import FrameParts
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.model.state import ModelState


class TransferPhase(enum.Enum):
    OPENED = "opened"
    STREAMING = "streaming"
    SEALED = "sealed"
    DELIVERED = "delivered"
    CUT = "cut"
    REFUSED = "refused"
    ABANDONED = "abandoned"


_ENDS = frozenset({TransferPhase.CUT, TransferPhase.REFUSED, TransferPhase.ABANDONED})
FINAL_PHASES = frozenset({TransferPhase.DELIVERED, *_ENDS})
LEGAL_TRANSITIONS: dict[TransferPhase, frozenset[TransferPhase]] = {
    TransferPhase.OPENED: frozenset({TransferPhase.STREAMING, *_ENDS}),
    TransferPhase.STREAMING: frozenset({TransferPhase.SEALED, *_ENDS}),
    TransferPhase.SEALED: frozenset({TransferPhase.DELIVERED, *_ENDS}),
    **{phase: frozenset() for phase in FINAL_PHASES},
}


class TransferPhaseError(RuntimeError):
    """A move `LEGAL_TRANSITIONS` does not list: a bug at that end, never a peer's mistake."""


class TransferLedger:
    """How many transfers of one process ended in each final phase (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[TransferPhase] = collections.Counter()

    def record(self, phase: TransferPhase) -> None:
        with self._lock:
            self._counts[phase] += 1

    def counts(self) -> dict[TransferPhase, int]:
        with self._lock:
            return dict(self._counts)


class Transfer:
    """One transfer's phase at one end. `move` checks a change against `LEGAL_TRANSITIONS`;
    `end` gives the final verdict unless the transfer already has one (several threads may
    see a transfer end — the engine, gRPC's callbacks — and the first to say how wins)."""

    def __init__(self, request_id: str, ledger: TransferLedger | None = None) -> None:
        self.request_id, self._ledger = request_id, ledger
        self._lock = threading.Lock()
        self._phase = TransferPhase.OPENED

    @property
    def phase(self) -> TransferPhase:
        return self._phase

    @property
    def ended(self) -> bool:
        return self._phase in FINAL_PHASES

    def move(self, to: TransferPhase) -> None:
        with self._lock:
            self._set(to)

    def advance(self, to: TransferPhase) -> None:
        """`move`, unless the transfer is already there (every frame of a stream advances it
        to STREAMING) or already ended (a verdict another thread gave first)."""
        with self._lock:
            if self._phase is not to and self._phase not in FINAL_PHASES:
                self._set(to)

    def end(self, to: TransferPhase) -> bool:
        """The final verdict ``to``, unless there already is one; whether it was given."""
        if to not in FINAL_PHASES:
            raise TransferPhaseError(f"{to.value} is not a final phase")
        with self._lock:
            if self._phase in FINAL_PHASES:
                return False
            self._set(to)  # DELIVERED before SEALED is still refused
            return True

    def _set(self, to: TransferPhase) -> None:
        """The move to ``to``, checked (caller holds the lock)."""
        if to not in LEGAL_TRANSITIONS[self._phase]:
            raise TransferPhaseError(
                f"{self.request_id}: transfer {self._phase.value} → {to.value} is not a legal move"
            )
        self._phase = to
        if to in FINAL_PHASES and self._ledger is not None:
            self._ledger.record(to)


# --- errors -----------------------------------------------------------------------------------


class TransferError(Exception):
    """A transfer ended without delivering its state (module docstring's table)."""

    ends_in = TransferPhase.REFUSED
    status = grpc.StatusCode.INTERNAL
    fails_waiting = False


class InvalidPushError(TransferError):
    """A push that cannot be read as one: nothing of it is kept."""

    status = grpc.StatusCode.INVALID_ARGUMENT


class RejectedStateError(TransferError):
    """The state a push carried is malformed or too long: nothing of it is kept, and a
    `Generate` waiting for it fails now."""

    status = grpc.StatusCode.INVALID_ARGUMENT
    fails_waiting = True


class TransferCutError(TransferError):
    """The data connection closed (or never came) before the push's `end` record."""

    ends_in = TransferPhase.CUT
    status = grpc.StatusCode.UNAVAILABLE


class SenderCancelledError(TransferError):
    """A stream stopped short because its sender cancelled it: a cut transfer, not a malformed
    one (the sender reports the failure)."""

    ends_in = TransferPhase.CUT
    status = grpc.StatusCode.CANCELLED


class StripeError(TransferError):
    """A striped transfer cannot be put together (a stripe is missing, cut or inconsistent)."""

    status = grpc.StatusCode.ABORTED


class PushFailedError(TransferError):
    """The sender's view: the decode worker ended a push with ``status`` (its own verdict, or
    UNAVAILABLE / DEADLINE_EXCEEDED when it could not be reached in time)."""

    def __init__(self, message: str, status: grpc.StatusCode) -> None:
        super().__init__(message)
        self.status = status
        cut = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
        self.ends_in = TransferPhase.CUT if status in cut else TransferPhase.REFUSED


# --- the two ends -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Delivery:
    """What a delivered transfer tells its sender: the link's time for the frames that queued
    behind each other (``backlog_bytes`` in ``backlog_s``; policy/link_capacity.py) over all its
    stripes, the frames the decode worker counted, and what TCP measured on its data
    connections — the smoothed round trip (the largest over its stripes; 0.0: no data
    connection) and the segments it retransmitted."""

    backlog_bytes: int
    backlog_s: float
    frames: int
    rtt_s: float = 0.0
    retransmits: int = 0


@dataclasses.dataclass(frozen=True)
class ReceivedState:
    """A state received whole and checked, ready for the decode service to take."""

    request_id: str
    state: ModelState
    length: int  # tokens the state holds
    first_token: int
    sampling: SamplingParams
    payload_nbytes: int  # the state's tensor bytes the push carried (its header's count)
    frames: int  # over every stripe
    backlog_bytes: int
    backlog_s: float


@runtime_checkable
class StateSender(Protocol):
    """The prefill side of one transfer: frames go in as prefill makes them, the last ones
    seal it, `wait` says how it ended. Thread-safe between the engine thread that puts frames
    and the gRPC threads that send them and see the pushes end."""

    transfer: Transfer

    @property
    def stopped(self) -> bool:
        """Whether the transfer stopped taking frames (a failed push, a cancel): prefill stops
        computing a state no one will receive."""
        ...

    def put_all(self, frames: Iterable[bytes | FrameParts]) -> None: ...

    def seal(self, frames: Iterable[bytes | FrameParts]) -> None:
        """The last frames (the state's tail, trailer and handoff); no frame follows them."""
        ...

    def wait(self) -> Delivery:
        """Blocks until every push answered; the `Delivery`, or a `TransferError`."""
        ...

    def cancel(self) -> None:
        """Abandon the transfer (no-op once it ended): the receiver sees cancelled streams,
        never a short one."""
        ...


@runtime_checkable
class StateReceiver(Protocol):
    """The decode side of one push (one stripe of a transfer): `receive` reads and checks it,
    the service then takes the state (`deliver`) or refuses it (`refuse`)."""

    request_id: str
    transfer: Transfer

    def receive(self) -> ReceivedState | None:
        """The state, checked; None for a secondary stripe, whose frames went to its primary;
        a `TransferError` when the push cannot deliver."""
        ...

    def deliver(self, received: ReceivedState) -> None: ...

    def refuse(self) -> None: ...

    def close(self) -> None: ...
