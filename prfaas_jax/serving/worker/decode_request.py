"""The decode worker's record of one request: `DecodeRequest`, its lifecycle `Phase` and the
`LEGAL_TRANSITIONS` between phases (serving/worker/decode.py drives them).

A request meets the decode worker twice, in either order: its state (`PushState`) and its
`Generate` call. Then the engine thread takes it off the ready queue, into a slot or straight to
its end::

    NEW ─┬─ state ────→ PARKED ─ Generate ─┐
         └─ Generate ─→ WAITING ─ state ───┴→ READY → TAKEN → DECODING → FINISHED | FAILED
                                                        └───────────────→ FINISHED | FAILED

Any phase with a `Generate` call can end in CANCELLED (the call ended first: the client went
away, a deadline, a rejected state), and DECODING can end in FAILED (a step failed). FINISHED,
FAILED and CANCELLED are final. Every change goes through `DecodeRequest.move`, which refuses one
the table does not list with `IllegalTransitionError`: that is a bug in the worker, never a
user's mistake. A PARKED request that no `Generate` claims is simply dropped.
"""

from __future__ import annotations

import dataclasses
import enum
import queue

from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.model.state import ModelState


class Phase(enum.Enum):
    NEW = "new"  # just created, under the lock; the call that created it fills it in
    PARKED = "parked"  # its state came first: it waits for its Generate
    WAITING = "waiting"  # its Generate came first: it waits for its state
    READY = "ready"  # both: on the ready queue, waiting for a slot
    TAKEN = "taken"  # the engine thread took it off the ready queue
    DECODING = "decoding"  # in a slot of the decode engine
    FINISHED = "finished"  # every token is sent
    FAILED = "failed"  # the engine refused its state, or a step failed
    CANCELLED = "cancelled"  # its Generate call ended before it finished


LEGAL_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.PARKED, Phase.WAITING}),
    Phase.PARKED: frozenset({Phase.READY}),
    Phase.WAITING: frozenset({Phase.READY, Phase.CANCELLED}),
    Phase.READY: frozenset({Phase.TAKEN, Phase.CANCELLED}),
    # A one-token request finishes on its first token, without a slot.
    Phase.TAKEN: frozenset({Phase.DECODING, Phase.FINISHED, Phase.FAILED, Phase.CANCELLED}),
    Phase.DECODING: frozenset({Phase.FINISHED, Phase.FAILED, Phase.CANCELLED}),
    Phase.FINISHED: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}

# Phases in which a Generate call has claimed the request.
_CLAIMED = frozenset(Phase) - {Phase.NEW, Phase.PARKED}


class IllegalTransitionError(RuntimeError):
    """A change of phase that `LEGAL_TRANSITIONS` does not allow: a bug in the decode worker."""


@dataclasses.dataclass(eq=False)
class DecodeRequest:
    """One request at the decode worker; fields are read and changed under the worker's lock."""

    request_id: str
    created: float  # time.monotonic() at creation, for dropping unclaimed states
    phase: Phase = Phase.NEW
    prompt_len: int = 0  # announced by Generate
    max_new_tokens: int = 0
    logprobs: int | None = None  # alternatives per decoded token, when its tokens are scored
    state: ModelState | None = None  # from PushState; released once a slot holds it
    first_token: int = 0  # sampled by prefill, from the handoff frame
    sampling: SamplingParams | None = None
    state_bytes: int = 0
    out: queue.Queue = dataclasses.field(default_factory=queue.Queue)  # to the Generate stream

    @property
    def claimed(self) -> bool:
        """A Generate call has arrived for it."""
        return self.phase in _CLAIMED

    @property
    def ended(self) -> bool:
        """In a final phase: nothing more happens to it."""
        return not LEGAL_TRANSITIONS[self.phase]

    def move(self, to: Phase) -> None:
        """Change phase to `to`; `IllegalTransitionError` unless the table allows it."""
        if to not in LEGAL_TRANSITIONS[self.phase]:
            raise IllegalTransitionError(
                f"decode request {self.request_id}: {self.phase.name} → {to.name} is not a "
                "legal transition"
            )
        self.phase = to
