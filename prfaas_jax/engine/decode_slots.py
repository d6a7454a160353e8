"""`SlotControls`: the host side both decode engines keep per slot, and the checks of an insert.

Also exposes `NoFreeSlotError`. A slot's last token (the next input), its key-schedule index,
key and sampling knobs travel with every step as host arrays; ``_Request`` says how many tokens
it may still produce, how many alternatives its log-probabilities report, and whether it
finished; `logprobs` gives the last step's. The slot engine (engine/decode.py) and the paged
engine (engine/paged_decode.py) differ only in where a slot's state lives.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.logprobs import TokenLogprobs, as_token_logprobs, top_width
from prfaas_jax.engine.sampling import SamplingParams, request_key, sampling_knobs
from prfaas_jax.engine.state_resize import check_fits
from prfaas_jax.errors import EngineError, LengthLimitError
from prfaas_jax.model import ModelState


class NoFreeSlotError(EngineError):
    """Every slot holds a request: ``free`` one (or wait for one to finish) first."""


@dataclasses.dataclass
class _Request:
    remaining: int  # tokens this slot may still produce
    eos_id: int | None
    logprobs: int | None = None  # alternatives to report per token; None: no log-probabilities
    finished: bool = False


class SlotControls:
    """Per-slot tokens, keys, knobs and budgets of ``max_slots`` slots, and ``check_state``."""

    def __init__(self, cfg: ModelConfig, max_slots: int, max_len: int) -> None:
        if max_slots < 1 or max_len < 1:
            raise EngineError(f"max_slots and max_len must be ≥ 1, got {max_slots}, {max_len}")
        self.cfg, self.max_slots, self.max_len = cfg, max_slots, max_len
        self._tokens = np.zeros(max_slots, np.int32)  # last token of each slot: the next input
        self._index = np.zeros(max_slots, np.int32)  # key-schedule index of the next token
        self._keys = np.zeros((max_slots, 2), np.uint32)
        self._temperature = np.zeros(max_slots, np.float32)
        self._top_k = np.zeros(max_slots, np.int32)
        self._top_p = np.ones(max_slots, np.float32)
        self._requests: list[_Request | None] = [None] * max_slots
        self._logprobs: dict[int, TokenLogprobs] = {}  # the last step's, of slots that asked

    @property
    def free_slots(self) -> list[int]:
        return [slot for slot, req in enumerate(self._requests) if req is None]

    @property
    def active_slots(self) -> list[int]:
        """Slots that will produce a token on the next ``step``."""
        return [slot for slot, req in enumerate(self._requests) if req and not req.finished]

    def fits(self, requests: list[tuple[int, int]]) -> int:
        """How many of ``requests`` (``(state length, max_new_tokens)`` each), taken in order,
        ``insert`` would take now: as many as there are free slots."""
        return min(len(requests), len(self.free_slots))

    def is_finished(self, slot: int) -> bool:
        """True once ``slot``'s request hit its EOS or budget (it holds the slot until ``free``)."""
        return self._request(slot).finished

    def _request(self, slot: int) -> _Request:
        req = self._requests[slot] if 0 <= slot < self.max_slots else None
        if req is None:
            raise EngineError(f"slot {slot} holds no request")
        return req

    def check_state(self, state: ModelState) -> None:
        """What ``insert`` checks of a state alone, without a slot or a copy: one sequence of
        this model, at most ``max_len`` long. A real state has nothing else to be checked
        against; the codec has checked its bytes."""
        if state.batch_size != 1:
            raise EngineError(f"insert takes one sequence, got a batch of {state.batch_size}")
        check_fits(state, self.cfg, self.max_len)

    def _check_insert(self, state: ModelState, first_token: int, max_new_tokens: int) -> int:
        """The checks every insert makes; the state's length."""
        vocab = self.cfg.vocab_size
        if not 0 <= first_token < vocab:
            raise EngineError(f"first token {first_token} outside the vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if state.batch_size != 1:
            raise EngineError(f"insert takes one sequence, got a batch of {state.batch_size}")
        length = int(np.asarray(state.lengths)[0])
        # Each step absorbs the previous token, so n new tokens need L + n positions.
        if length + max_new_tokens > self.max_len:
            raise LengthLimitError(
                f"state ({length} tokens) + max_new_tokens ({max_new_tokens}) exceed the decode "
                f"engine's max_len {self.max_len}"
            )
        return length

    def _free_slot(self) -> int:
        free = self.free_slots
        if not free:
            raise NoFreeSlotError(f"all {self.max_slots} slots are busy")
        return free[0]

    def _admit(
        self,
        slot: int,
        first_token: int,
        sampling: SamplingParams,
        max_new_tokens: int,
        eos_id: int | None,
        logprobs: int | None = None,
    ) -> None:
        self._tokens[slot], self._keys[slot] = first_token, request_key(sampling.seed)
        self._index[slot] = sampling.first_index + 1
        knobs = sampling_knobs(sampling)
        self._temperature[slot], self._top_k[slot], self._top_p[slot] = (k[0] for k in knobs)
        self._requests[slot] = _Request(max_new_tokens, eos_id, logprobs)

    def _controls(self, active_slots: list[int]) -> tuple[np.ndarray, ...]:
        """The step's per-slot inputs: tokens, active mask, keys, indices, then the knobs."""
        active = np.zeros(self.max_slots, bool)
        active[active_slots] = True
        knobs = (self._temperature, self._top_k, self._top_p)
        return (self._tokens, active, self._keys, self._index, *knobs)

    def _advance(self, active_slots: list[int], tokens: np.ndarray) -> list[tuple[int, int]]:
        """Record each active slot's new token; ``(slot, token)`` pairs."""
        out = []
        for slot in active_slots:
            req, token = self._requests[slot], int(tokens[slot])
            assert req is not None
            self._tokens[slot] = token
            self._index[slot] += 1
            req.remaining -= 1
            req.finished = req.remaining == 0 or token == req.eos_id
            out.append((slot, token))
        return out

    def _top(self, active_slots: list[int]) -> tuple[list[int], int]:
        """The active slots that asked for log-probabilities, and the top-k width of the step's
        compiled variant (0: none asked, the variant without them)."""
        asked = [s for s in active_slots if self._request(s).logprobs is not None]
        return asked, top_width(self.cfg.vocab_size) if asked else 0

    def _keep_logprobs(
        self, asked: list[int], rows: dict[int, int], tokens: np.ndarray, scored: list
    ) -> None:
        """Keep the step's log-probabilities of the ``asked`` slots: ``scored`` is what the
        step returned after its tokens (`log_softmax_top`'s arrays; nothing when none asked),
        ``rows[slot]`` the slot's row of ``tokens`` and of those arrays."""
        self._logprobs = {}
        if not asked:
            return
        chosen, top_ids, top_logprobs = jax.device_get(scored[0])
        for slot in asked:
            top, row = self._request(slot).logprobs, slice(rows[slot], rows[slot] + 1)
            assert top is not None
            (self._logprobs[slot],) = as_token_logprobs(
                tokens[row], chosen[row], top_ids[row], top_logprobs[row], top
            )

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """The log-probabilities of the token the last ``step`` made for ``slot``; None when its
        request did not ask for them."""
        return self._logprobs.get(slot)

    def _release(self, slot: int) -> None:
        self._request(slot)
        self._requests[slot] = None
