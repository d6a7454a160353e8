"""``MixedStep``: one process that prefills and decodes, each step one compiled call carrying the
decode rows and a chunk of the prompt at the head of the queue (chunked prefill, as vLLM and
SGLang schedule a node that does both); ``PromptFill``: a prompt being absorbed chunk by chunk;
``MixedRequest``: one request as it goes, its tokens and when each came.

A step runs the decode engine's step and one prefill block of the head prompt's working state
in the same compiled program (``DecodeEngine.step_with``): one dispatch, one wait for the
device, where running the two engines back to back paid both twice — on a small model a step's
cost is mostly that overhead, so a chunk of 16 tokens beside 8 decode rows cost more than the
decode step itself. How many prompt tokens a step carries is ``ChunkBudget``'s choice
(engine/chunk_budget.py): by default the largest block whose measured step cost stays within
twice the decode step alone, at least one token, so a decoding request waits at most about one
more decode step between two tokens however long the arriving prompt, and the prompt still
advances every step; the prefill engine's ``chunk_len`` caps it. With no decode row a step is
a block of ``chunk_len`` alone; with no prompt waiting (or no free slot for it), a decode step
alone. A prompt starts when a slot is free for it (or it asks for one token); once absorbed,
its first token is sampled and it goes into that free slot, decoding from the next step.

Tokens are those of single-process generation: prefill split at any boundary is the model's
invariant (the working state has the decode engine's capacity, so the slot takes it as it is),
and each slot decodes as it would alone (the fused program computes each part as its own
engine does).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.chunk_budget import ChunkBudget
from prfaas_jax.engine.decode import DecodeEngine, _decode_and_sample
from prfaas_jax.engine.prefill import _PREFILL_BLOCK, PrefillEngine, _prefill_block
from prfaas_jax.engine.sampling import GREEDY, SamplingParams
from prfaas_jax.engine.state_resize import fresh_state
from prfaas_jax.errors import EngineError
from prfaas_jax.model import ModelState
from prfaas_jax.ops.dispatch import Impl


def _step_and_chunk(
    params: dict,
    state: ModelState,
    tokens_S: jax.Array,
    active_S: jax.Array,
    keys_S2: jax.Array,
    index_S: jax.Array,
    temperature_S: jax.Array,
    top_k_S: jax.Array,
    top_p_S: jax.Array,
    block_1C: jax.Array,
    valid_1: jax.Array,
    work: ModelState,
    *,
    cfg: ModelConfig,
    impl: Impl,
    top: int = 0,
    rows: int | None = None,
) -> tuple:
    """A decode step of the slots (as `DecodeEngine.step`) and a prefill block of ``work`` (as
    `PrefillEngine.prefill`'s calls), in one program: what the step returns, then the block's
    ``(logits, work)``."""
    controls = (tokens_S, active_S, keys_S2, index_S, temperature_S, top_k_S, top_p_S)
    out = _decode_and_sample(params, state, *controls, cfg=cfg, impl=impl, top=top, rows=rows)
    return (*out, _prefill_block(params, block_1C, valid_1, work, cfg=cfg, impl=impl))


# Both states are ours (the slots, the working state): donated.
_STEP_AND_CHUNK = jax.jit(
    _step_and_chunk, static_argnames=("cfg", "impl", "top", "rows"), donate_argnums=(1, 11)
)


@dataclasses.dataclass(eq=False)
class PromptFill:
    """A prompt being absorbed: its tokens, the working state (capacity of the decode engine's
    slots), how many tokens it holds, and once all are in, the first token."""

    tokens: np.ndarray
    sampling: SamplingParams
    state: ModelState
    done: int = 0
    first_token: int | None = None

    @property
    def remaining(self) -> int:
        return self.tokens.size - self.done


@dataclasses.dataclass(eq=False)
class MixedRequest:
    """A request: its prompt, what it asked for, and each token with the time it came."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    submitted: float = 0.0
    tokens: list[int] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)  # one per token
    done: bool = False


class MixedStep:
    """Prefill and decode on one node, a chunk of prompt in each decode step (module docstring).

    ``share``: a step may cost up to ``1 + share`` decode steps alone (``ChunkBudget``); None
    puts ``chunk_len`` tokens in every step whatever it costs."""

    def __init__(
        self,
        prefill: PrefillEngine,
        decode: DecodeEngine,
        *,
        share: float | None = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if prefill.cfg != decode.cfg:
            raise EngineError("the prefill and decode engines must hold the same model")
        if decode.mesh is not None:
            raise EngineError("a mixed step runs on one device")
        self.prefill, self.decode, self.clock = prefill, decode, clock
        self.budget = ChunkBudget(prefill.chunk_len, share=share)
        self.waiting: collections.deque[MixedRequest] = collections.deque()
        self._filling: tuple[MixedRequest, PromptFill] | None = None
        self._slots: dict[int, MixedRequest] = {}
        self.steps = 0  # steps that decoded
        self.chunks = 0  # prefill blocks run

    # --- one step, for any caller that keeps its own requests -------------------------------

    def start_fill(self, tokens: Sequence[int], sampling: SamplingParams = GREEDY) -> PromptFill:
        """A prompt to absorb through ``advance``, in a fresh working state."""
        ids = np.asarray(tokens, np.int64).reshape(-1)
        if ids.size < 1:
            raise EngineError("the prompt is empty")
        vocab = self.decode.cfg.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise EngineError(f"a token id outside the vocabulary [0, {vocab})")
        if ids.size > self.decode.max_len:
            raise EngineError(f"{ids.size} prompt tokens exceed max_len {self.decode.max_len}")
        state = fresh_state(self.decode.cfg, self.decode.max_len, None)
        return PromptFill(ids.astype(np.int32), sampling, state)

    def advance(self, fill: PromptFill | None) -> list[tuple[int, int]]:
        """One step: the decode engine's active slots, and a chunk of ``fill`` (None: none).
        Returns the step's ``(slot, token)`` pairs; ``fill`` moves on in place, its
        ``first_token`` set once its last token is in."""
        rows = self.decode.rows()
        if fill is None or self.budget.needs_decode_cost(rows):
            return self._decode_step(rows)
        block = self.budget.block(rows, fill.remaining)
        take = min(block, fill.remaining)
        block_1C = np.zeros((1, block), np.int32)
        block_1C[0, :take] = fill.tokens[fill.done : fill.done + take]
        valid_1 = np.array([take], np.int32)
        start = self.clock()
        if rows:
            made, (logits, fill.state) = self.decode.step_with(
                _STEP_AND_CHUNK, block_1C, valid_1, fill.state
            )
            self.budget.observe_mixed(rows, block, self.clock() - start)
            self.steps += 1
        else:
            made = []
            args = (self.decode.params, block_1C, valid_1, fill.state)
            logits, fill.state = _PREFILL_BLOCK(*args, cfg=self.decode.cfg, impl=self.decode.impl)
        fill.done += take
        self.chunks += 1
        if not fill.remaining:
            fill.first_token, _ = self.prefill.sample_first(logits, fill.sampling)
        return made

    def _decode_step(self, rows: int) -> list[tuple[int, int]]:
        start = self.clock()
        made = self.decode.step()
        if made:
            self.budget.observe_decode(rows, self.clock() - start)
            self.steps += 1
        return made

    # --- requests, for a caller that lets this object keep them -----------------------------

    def submit(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams = GREEDY
    ) -> MixedRequest:
        """Queue a prompt; its tokens come as the steps run."""
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens - 1 > self.decode.max_len:
            raise EngineError(
                f"prompt ({len(prompt)}) + new tokens ({max_new_tokens}) exceed the decode "
                f"engine's max_len {self.decode.max_len}"
            )
        request = MixedRequest([int(t) for t in prompt], max_new_tokens, sampling, self.clock())
        self.waiting.append(request)
        return request

    @property
    def busy(self) -> bool:
        """Whether a prompt waits or is absorbed, or a slot decodes."""
        return bool(self.waiting or self._filling or self.decode.active_slots)

    def step(self) -> None:
        """One step: the decode rows and a chunk of the head prompt, which starts when it can
        (a free slot, or one token asked)."""
        if self._filling is None and self.waiting:
            head = self.waiting[0]
            if head.max_new_tokens == 1 or self.decode.free_slots:
                self.waiting.popleft()
                self._filling = (head, self.start_fill(head.prompt, head.sampling))
        fill = self._filling[1] if self._filling else None
        made = self.advance(fill)
        for slot, token in made:
            request = self._slots[slot]
            self._emit(request, token)
            if self.decode.is_finished(slot):
                self.decode.free(slot)
                del self._slots[slot]
                request.done = True
        if self._filling is not None and self._filling[1].first_token is not None:
            request, fill = self._filling
            self._filling = None
            self._prefilled(request, fill)

    def run(self) -> None:
        """Step until no prompt waits and no slot decodes."""
        while self.busy:
            self.step()

    def _prefilled(self, request: MixedRequest, fill: PromptFill) -> None:
        assert fill.first_token is not None
        self._emit(request, fill.first_token)
        if request.max_new_tokens == 1:
            request.done = True
            return
        slot = self.decode.insert(
            fill.state,
            fill.first_token,
            request.sampling,
            max_new_tokens=request.max_new_tokens - 1,
        )
        self._slots[slot] = request

    def _emit(self, request: MixedRequest, token: int) -> None:
        request.tokens.append(token)
        request.times.append(self.clock())
