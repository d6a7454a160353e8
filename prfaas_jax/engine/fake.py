"""Engines whose outputs are computable by hand: `FakePrefillEngine`, `FakeDecodeEngine`.

Also exposes `fake_tokens`, the expected output of a request. They serve the serving-plane
tests (and `engine = "fake"` clusters) without a model, JetStream-style, but implement the
engine interface of engine/api.py, as the JAX engines do, and hold a real `ModelState`, so the
real codec carries it. The fake model is autoregressive: over a vocabulary of V, the token that
follows a sequence (prompt, then the tokens generated so far) of length L and sum S is

    next(seq) = (2·S + L) mod V

so for a prompt with sum S and length L, token 0 = (2S + L) mod V (prefill's first token) and
token i+1 = (3·token_i + 1) mod V (appending t adds 2t + 1 to 2S + L). x ↦ 3x + 1 has no short
cycles mod a power of two (every orbit mod 256 is 128 long), so outputs stay well spread. As
every token depends on the whole sequence before it, a request resumed from prompt + its first
k tokens continues exactly where it stopped — and one resumed from the wrong tokens does not.

Prefill writes the sequence into the state (token p at position p of the first growing cache,
every other value zero); decode reads S and L back *from the state it received*, absorbs the
first token it is handed, and then tracks the running sum and length of each slot, so a state
that arrives damaged or belongs to another prompt shows up as wrong tokens. Prefill after a
`prefix` state (a cached prefix) reads the prefix's tokens back from that state the same way,
so a prefix cache that serves the wrong state shows up as wrong tokens too. Optional sleeps
(`seconds_per_token` of prefill, `step_s` per decode step) emulate compute time.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from prfaas_jax.config import LayerKind, ModelConfig
from prfaas_jax.engine.codec.layout import canonical_arrays, canonical_tensors, state_from_arrays
from prfaas_jax.engine.sampling import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError
from prfaas_jax.model import ModelState


def next_token(total: int, length: int, vocab_size: int) -> int:
    """The token after a sequence of `length` tokens that sum to `total`."""
    return (2 * total + length) % vocab_size


def fake_tokens(prompt: Sequence[int], num_tokens: int, vocab_size: int) -> list[int]:
    """The `num_tokens` tokens the fake engines produce for `prompt` (greedy or not)."""
    total, length, out = sum(prompt), len(prompt), []
    for _ in range(num_tokens):
        out.append(next_token(total, length, vocab_size))
        total, length = total + out[-1], length + 1
    return out


def _prompt_tensor(cfg: ModelConfig, length: int) -> int:
    for index, spec in enumerate(canonical_tensors(cfg, length)):
        if spec.token_axis and spec.kind is not LayerKind.SWA:
            return index
    raise EngineError(f"the fake engines need a growing KV cache; {cfg.name!r} has none")


def _prompt_of(cfg: ModelConfig, state: ModelState) -> list[int]:
    """The token ids a fake state holds (row 0)."""
    length, arrays = canonical_arrays(state, cfg, 0)
    holder = arrays[_prompt_tensor(cfg, length)][1]
    return [int(x) for x in np.asarray(holder).reshape(length, -1)[:, 0]]


@dataclasses.dataclass(frozen=True)
class FakePrefillResult:
    state: ModelState
    first_token: int
    num_tokens: int  # tokens computed (after the prefix)
    prefix_len: int = 0


class FakePrefillEngine:
    """`PrefillEngineLike`: the prompt (after the prefix's tokens) written into a real state."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seconds_per_token: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        _prompt_tensor(cfg, 1)
        self.cfg, self.seconds_per_token, self._sleep = cfg, seconds_per_token, sleep

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefix: ModelState | None = None,
        on_chunk: Callable[[ModelState, int], None] | None = None,
        sampling: SamplingParams = GREEDY,
        max_len: int | None = None,
    ) -> FakePrefillResult:
        new = [int(t) for t in tokens]
        if not new:
            raise EngineError("the prompt is empty")
        if any(not 0 <= t < self.cfg.vocab_size for t in new):
            raise EngineError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        head = [] if prefix is None else _prompt_of(self.cfg, prefix)
        ids = head + new
        capacity = max_len or len(ids)
        if len(ids) > capacity:
            raise EngineError(f"prompt ({len(ids)}) exceeds max_len {capacity}")
        if self.seconds_per_token:
            self._sleep(self.seconds_per_token * len(new))  # only the uncached part costs
        specs = canonical_tensors(self.cfg, len(ids))
        arrays = [np.zeros(spec.shape, spec.dtype) for spec in specs]
        holder = arrays[_prompt_tensor(self.cfg, len(ids))]
        holder.reshape(len(ids), -1)[:, 0] = ids  # exact: token ids < 2^24 fit any float dtype
        state = state_from_arrays(
            self.cfg, len(ids), list(zip(specs, arrays, strict=True)), capacity
        )
        if on_chunk is not None:
            on_chunk(state, len(ids))  # one chunk: the whole prompt
        first = next_token(sum(ids), len(ids), self.cfg.vocab_size)
        return FakePrefillResult(state, first, len(new), len(head))


@dataclasses.dataclass
class _Slot:
    total: int  # sum of the sequence so far: the state's tokens, then every token absorbed
    length: int  # its length
    remaining: int
    finished: bool = False


class FakeDecodeEngine:
    """`DecodeEngineLike`: insert / step / is_finished / free over `max_slots` slots."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_slots: int,
        max_len: int,
        step_s: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        _prompt_tensor(cfg, 1)
        self.cfg, self.max_slots, self.max_len = cfg, max_slots, max_len
        self.step_s, self._sleep = step_s, sleep
        self._slots: list[_Slot | None] = [None] * max_slots

    @property
    def free_slots(self) -> list[int]:
        return [i for i, slot in enumerate(self._slots) if slot is None]

    @property
    def active_slots(self) -> list[int]:
        return [i for i, slot in enumerate(self._slots) if slot and not slot.finished]

    def insert(
        self,
        state: ModelState,
        first_token: int,
        sampling: SamplingParams = GREEDY,
        *,
        max_new_tokens: int,
        eos_id: int | None = None,
    ) -> int:
        prompt = _prompt_of(self.cfg, state)
        length = len(prompt)
        if length + max_new_tokens > self.max_len:
            raise EngineError(f"state ({length}) + {max_new_tokens} exceed max_len {self.max_len}")
        if not self.free_slots:
            raise EngineError(f"all {self.max_slots} slots are busy")
        slot = self.free_slots[0]
        # The first token (sampled by prefill) is the next input, as in the real engine.
        self._slots[slot] = _Slot(sum(prompt) + int(first_token), length + 1, max_new_tokens)
        return slot

    def step(self) -> list[tuple[int, int]]:
        active = self.active_slots
        if not active:
            return []
        if self.step_s:
            self._sleep(self.step_s)
        out = []
        for i in active:
            slot = self._slots[i]
            assert slot is not None
            token = next_token(slot.total, slot.length, self.cfg.vocab_size)
            out.append((i, token))
            slot.total, slot.length = slot.total + token, slot.length + 1
            slot.remaining -= 1
            slot.finished = slot.remaining == 0
        return out

    def is_finished(self, slot: int) -> bool:
        entry = self._slots[slot]
        if entry is None:
            raise EngineError(f"slot {slot} holds no request")
        return entry.finished

    def free(self, slot: int) -> None:
        if self._slots[slot] is None:
            raise EngineError(f"slot {slot} holds no request")
        self._slots[slot] = None
