"""The engine interface the serving plane drives: `PrefillEngineLike` and `DecodeEngineLike`,
and `MixedStepLike` for a node that does both in one step, with `PromptFill`, the prompt such a
node absorbs chunk by chunk.

Also exposes `PrefillOutput` (what a prefill returns that its callers read), `OnChunk` (the
per-chunk callback), `OnLayers` (the per-layer-group one) and `split_layers` (the groups
both engines stream a state in). Two engines satisfy each
protocol: the JAX engines (engine/prefill.py: `PrefillEngine`, engine/decode.py:
`DecodeEngine`) and the hand-computable fakes (engine/fake.py), so a worker, the prefix
cache's `CachedPrefill` and the tests accept either. The protocols hold only what those
callers use, in the JetStream vocabulary:

    prefill(tokens, prefix=…) → state, first_token        one prompt, batch 1
    score(tokens, top) → [TokenLogprobs, …]                log-probabilities of tokens[1:]
    insert(state, first_token, sampling) → slot            a slot of the decode batch
    check_state(state)                                     insert's checks of a state, no slot
    step() → [(slot, token), …]                            one token per active slot
    logprobs(slot) → TokenLogprobs | None                  of that token, if insert asked
    is_finished(slot), free(slot)                          a slot's end

The protocols are `runtime_checkable`: `isinstance` sees whether the members exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from prfaas_jax.engine.logprobs import TokenLogprobs
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.model.state import ModelState

OnChunk = Callable[[ModelState, int], None]
"""`on_chunk(state, tokens_done)`: after each prefill call, with every position absorbed so far."""

OnLayers = Callable[[ModelState, int, range], None]
"""`on_layers(state, tokens_done, layers)`: in a prefill's last call, once `layers`' states in
`state` are final (and the later layers still compute): layer-wise streaming."""


@runtime_checkable
class PrefillOutput(Protocol):
    """The result of one prefill, as its callers read it."""

    @property
    def state(self) -> ModelState:
        """Batch 1, holding the prefix and the prompt."""
        ...

    @property
    def first_token(self) -> int:
        """Sampled from the prompt's last position: token 0 of the request."""
        ...

    @property
    def prefix_len(self) -> int:
        """Positions taken from the `prefix` state (not computed)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Prompt tokens computed."""
        ...


@runtime_checkable
class PrefillEngineLike(Protocol):
    """One prompt at a time: its state (for the codec) and its first token."""

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        prefix: ModelState | None = None,
        on_chunk: OnChunk | None = None,
        sampling: SamplingParams = GREEDY,
        max_len: int | None = None,
        on_layers: OnLayers | None = None,
    ) -> PrefillOutput:
        """Absorb `tokens` after `prefix`; `max_len` fixes the state's capacity. An engine
        that cannot stream by layers never calls `on_layers` (its `finish` ships them)."""
        ...

    def score(self, tokens: Sequence[int], top: int = 0) -> list[TokenLogprobs]:
        """Each of ``tokens[1:]``'s log-probability after the tokens before it, with the
        ``top`` likeliest tokens of its position (engine/logprobs.py)."""
        ...


@runtime_checkable
class DecodeEngineLike(Protocol):
    """`max_slots` requests decoded together, one token per active slot per `step`."""

    max_slots: int

    def insert(
        self,
        state: ModelState,
        first_token: int,
        sampling: SamplingParams = GREEDY,
        *,
        max_new_tokens: int,
        eos_id: int | None = None,
        logprobs: int | None = None,
    ) -> int:
        """Start decoding a prefilled request in a free slot; returns the slot. With
        ``logprobs`` (the likeliest tokens to report beside each), `logprobs` gives each
        token's log-probabilities after its step."""
        ...

    def fits(self, requests: list[tuple[int, int]]) -> int:
        """How many of ``requests`` (``(state length, max_new_tokens)`` each), taken in order,
        `insert` would take now (free slots; for the paged engine, free pages too)."""
        ...

    def check_state(self, state: ModelState) -> None:
        """Raise `EngineError` for a state `insert` would refuse whatever the token budget,
        without taking a slot: for a request whose only token prefill already sampled."""
        ...

    def step(self) -> list[tuple[int, int]]:
        """One `(slot, token)` for every active slot."""
        ...

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """Of the token the last `step` made for ``slot``; None if its insert did not ask."""
        ...

    def is_finished(self, slot: int) -> bool:
        """True once the slot's request produced its last token (it keeps the slot)."""
        ...

    def free(self, slot: int) -> None:
        """Release the slot, finished or not."""
        ...


@dataclasses.dataclass(eq=False)
class PromptFill:
    """A prompt being absorbed: its tokens, the working state (capacity of the decode engine's
    slots; None until the last token with an engine that keeps none, engine/fake_mixed.py), how
    many tokens it holds, and once all are in, the first token."""

    tokens: np.ndarray
    sampling: SamplingParams
    state: ModelState | None
    done: int = 0
    first_token: int | None = None

    @property
    def remaining(self) -> int:
        return self.tokens.size - self.done


@runtime_checkable
class MixedStepLike(Protocol):
    """One node that prefills and decodes, a prompt's chunk in each decode step
    (engine/mixed_step.py `MixedStep`; engine/fake_mixed.py `FakeMixedStep`)."""

    @property
    def decode(self) -> DecodeEngineLike:
        """The decode engine whose slots the steps run: requests go in by `insert`."""
        ...

    def start_fill(self, tokens: Sequence[int], sampling: SamplingParams = GREEDY) -> PromptFill:
        """A prompt to absorb through `advance`."""
        ...

    def advance(self, fill: PromptFill | None) -> list[tuple[int, int]]:
        """One step of the active slots, carrying a chunk of ``fill`` (None: none); ``fill``
        moves on in place, its ``first_token`` and ``state`` set once its last token is in."""
        ...


def split_layers(num_layers: int, groups: int) -> tuple[range, ...]:
    """``num_layers`` layers cut into ``groups`` consecutive ranges of near-equal size (the
    first ones one layer longer), at most one per layer."""
    groups = max(1, min(groups, num_layers))
    size, extra = divmod(num_layers, groups)
    bounds, start = [], 0
    for g in range(groups):
        stop = start + size + (g < extra)
        bounds.append(range(start, stop))
        start = stop
    return tuple(bounds)
