"""Engines whose outputs are computable by hand: `FakePrefillEngine`, `FakeDecodeEngine`.

Also exposes `fake_tokens`, the expected output of a request. They serve the serving-plane
tests (and `engine = "fake"` clusters) without a model, JetStream-style, but keep the real
interfaces of engine/prefill.py and engine/decode.py and a real `ModelState`, so the real codec
carries it. For a prompt of L tokens with sum S, over a vocabulary of V:

    token i of the request = (S + L + 7·i) mod V          (i = 0 is prefill's first token)

Prefill writes the prompt into the state (token p at position p of the first growing cache,
every other value zero); decode reads S and L back *from the state it received*, so a state
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
from prfaas_jax.engine.codec_layout import canonical_arrays, canonical_tensors, state_from_arrays
from prfaas_jax.engine.prefill import GREEDY, EngineError
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.model import ModelState

STRIDE = 7


def fake_tokens(prompt: Sequence[int], num_tokens: int, vocab_size: int) -> list[int]:
    """The `num_tokens` tokens the fake engines produce for `prompt`."""
    base = sum(prompt) + len(prompt)
    return [(base + STRIDE * i) % vocab_size for i in range(num_tokens)]


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
        first = fake_tokens(ids, 1, self.cfg.vocab_size)[0]
        return FakePrefillResult(state, first, len(new), len(head))


@dataclasses.dataclass
class _Slot:
    base: int  # S + L, read back from the state
    index: int  # token index of the next token
    remaining: int
    finished: bool = False


class FakeDecodeEngine:
    """`DecodeEngine`'s interface: insert / step / is_finished / free over `max_slots` slots."""

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
        self._slots[slot] = _Slot(sum(prompt) + length, 1, max_new_tokens)
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
            out.append((i, (slot.base + STRIDE * slot.index) % self.cfg.vocab_size))
            slot.index += 1
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
