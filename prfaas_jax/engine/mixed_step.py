"""``MixedStep``: one process that prefills and decodes, each step one compiled call carrying the
decode rows and a chunk of the prompt at the head of the queue (chunked prefill, as vLLM and
SGLang schedule a node that does both), each prompt a ``PromptFill`` (engine/api.py);
``MixedRequest``: one request as it goes, its tokens and when each came.

A step runs the decode engine's step and one prefill block of the head prompt's working state
in the same compiled program (``DecodeEngine.step_with``): one dispatch and one wait for the
device, where running the two engines back to back paid both twice. That saves the overhead,
not the arithmetic: on `tiny` with 2 CPU cores a block of 32 prompt tokens alone costs more than
a decode step of 8 rows (it pushes 4× the tokens through the MLPs; the capacity it attends over
barely matters). So how many prompt tokens a step carries is chosen in time, by
``ChunkBudget`` (engine/chunk_budget.py): the largest block whose measured step cost stays
within ``1 + share`` decode steps alone (``share`` 0.5 by default, a margin under twice for a
noisy machine), at least the smallest block, so a decoding request waits about half a decode
step more between two tokens (as measured: a median) however long the arriving prompt, and the
prompt still advances every step but the few that measure a decode step alone (one when a batch
size is new, then one in about 64); the prefill engine's ``chunk_len`` caps it. With no decode
row a step is a block of ``chunk_len`` alone; with no prompt waiting (or no free slot for it), a
decode step alone. A prompt starts when a slot is free for it (or it asks for one token); once
absorbed, its first token is sampled and it goes into that free slot, decoding from the next
step.

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
from prfaas_jax.engine.api import PromptFill
from prfaas_jax.engine.chunk_budget import ChunkBudget
from prfaas_jax.engine.decode import DecodeEngine, _decode_and_sample
from prfaas_jax.engine.prefill import _PREFILL_BLOCK, PrefillEngine, _prefill_block
from prfaas_jax.engine.sampling import GREEDY, SamplingParams
from prfaas_jax.engine.state_resize import fresh_state
from prfaas_jax.errors import EngineError
from prfaas_jax.model import ModelState
from prfaas_jax.ops.dispatch import Impl


def _step_and_chunk(
    params: dict, state: ModelState, *args: jax.Array, cfg: ModelConfig, impl: Impl, **step: int
) -> tuple:
    """A decode step of the slots (as `DecodeEngine.step`) and a prefill block of the working
    state (as `PrefillEngine.prefill`'s calls), in one program. ``args``: the step's per-slot
    controls as `DecodeEngine.step` passes them, then the block ``[1, C]``, its valid length
    ``[1]`` and the working state; ``step``: its ``top`` and ``rows``. Returns what the step
    returns, then the block's ``(logits, working state)``."""
    *controls, block_1C, valid_1, work = args
    out = _decode_and_sample(params, state, *controls, cfg=cfg, impl=impl, **step)
    return (*out, _prefill_block(params, block_1C, valid_1, work, cfg=cfg, impl=impl))


# Both states are ours (the slots, the working state): donated.
_STEP_AND_CHUNK = jax.jit(
    _step_and_chunk, static_argnames=("cfg", "impl", "top", "rows"), donate_argnums=(1, 11)
)


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
    puts ``chunk_len`` tokens in every step whatever it costs. ``min_tokens``: the smallest
    block (the sizes are powers of two from it to ``chunk_len``, one compile each)."""

    def __init__(
        self,
        prefill: PrefillEngine,
        decode: DecodeEngine,
        *,
        share: float | None = 0.5,
        min_tokens: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if prefill.cfg != decode.cfg:
            raise EngineError("the prefill and decode engines must hold the same model")
        if decode.mesh is not None:
            raise EngineError("a mixed step runs on one device")
        self.prefill, self.decode, self.clock = prefill, decode, clock
        self.budget = ChunkBudget(prefill.chunk_len, share=share, min_tokens=min_tokens)
        self.waiting: collections.deque[MixedRequest] = collections.deque()
        self._filling: tuple[MixedRequest, PromptFill] | None = None
        self._slots: dict[int, MixedRequest] = {}
        self.steps = 0  # steps that decoded
        self.chunks = 0  # prefill blocks run

    def warm(self) -> None:
        """Compile every program a step can run: each block size beside each power-of-two batch
        of decode rows (as `DecodeEngine.step` runs them) and alone. The costs measured
        meanwhile (compiles, not steps) are not kept."""
        timed, max_slots = self.budget, self.decode.max_slots
        self.budget = ChunkBudget(self.prefill.chunk_len, share=None, min_tokens=timed.sizes[0])
        one = self.prefill.prefill([0], max_len=self.decode.max_len)
        batches = [0]
        while batches[-1] < max_slots:
            batches.append(min(2 * batches[-1] or 1, max_slots))
        for rows in batches:
            budget = len(self.budget.sizes) + 1
            slots = [self.decode.insert(one.state, 0, max_new_tokens=budget) for _ in range(rows)]
            for size in self.budget.sizes:
                self.advance(self.start_fill([0] * size))
            for slot in slots:
                self.decode.free(slot)
        self.budget = ChunkBudget(
            self.prefill.chunk_len, share=timed.share, min_tokens=timed.sizes[0]
        )
        self.steps = self.chunks = 0

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

    def insert(
        self,
        prompt: Sequence[int],
        state: ModelState,
        first_token: int,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
    ) -> MixedRequest:
        """A request whose prompt was prefilled elsewhere (``state``, ``first_token``: a
        pushed state): it takes a free slot now and decodes from the next step."""
        request = MixedRequest([int(t) for t in prompt], max_new_tokens, sampling, self.clock())
        self._prefilled(request, state, first_token)
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
            self._prefilled(request, fill.state, fill.first_token)

    def run(self) -> None:
        """Step until no prompt waits and no slot decodes."""
        while self.busy:
            self.step()

    def _prefilled(self, request: MixedRequest, state: ModelState, first_token: int) -> None:
        self._emit(request, first_token)
        if request.max_new_tokens == 1:
            request.done = True
            return
        slot = self.decode.insert(
            state,
            first_token,
            request.sampling,
            max_new_tokens=request.max_new_tokens - 1,
        )
        self._slots[slot] = request

    def _emit(self, request: MixedRequest, token: int) -> None:
        request.tokens.append(token)
        request.times.append(self.clock())
