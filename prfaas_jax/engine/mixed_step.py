"""``MixedStep``: one process that prefills and decodes, each step carrying the decode rows and at
most a budget of prompt tokens (chunked prefill, as vLLM and SGLang schedule a node that does
both); ``MixedRequest``: one request as it goes, its tokens and when each came.

A step is one call of the prefill engine and one decode step. The prefill engine's
``chunk_len`` is the budget: the prompt at the head of the queue is prefilled chunk by chunk,
and after each chunk (``on_chunk``) the decode engine steps every active slot once, so a
decoding request waits at most one chunk between two of its tokens however long the arriving
prompt. With no prompt waiting (or no free slot for it), a step is a decode step alone. A
prefilled request goes into a free slot of the decode engine and decodes from the next step.

The two engines are the disaggregated ones, unchanged, in one process: prefill chunks and
decode steps alternate, they do not share a compiled call, so a step costs a chunk plus a
decode step. Tokens are those of single-process generation: prefill split at chunk boundaries
is the model's "split at any boundary" invariant, and each slot decodes as it would alone.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError
from prfaas_jax.model import ModelState


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
    """Prefill and decode on one node, a chunk of prompt per decode step (module docstring)."""

    def __init__(
        self,
        prefill: PrefillEngine,
        decode: DecodeEngine,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if prefill.cfg != decode.cfg:
            raise EngineError("the prefill and decode engines must hold the same model")
        self.prefill, self.decode, self.clock = prefill, decode, clock
        self.budget = prefill.chunk_len  # prompt tokens per step
        self.waiting: collections.deque[MixedRequest] = collections.deque()
        self._slots: dict[int, MixedRequest] = {}
        self.steps = 0  # decode steps run
        self.chunks = 0  # prefill calls run

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
        """Whether a prompt waits or a slot decodes."""
        return bool(self.waiting or self.decode.active_slots)

    def step(self) -> None:
        """Prefill the next waiting prompt, a decode step after each of its chunks, when it can
        start (a free slot, or one token asked); else one decode step."""
        head = self.waiting[0] if self.waiting else None
        if head is not None and (head.max_new_tokens == 1 or self.decode.free_slots):
            self.waiting.popleft()
            self._prefill(head)
        else:
            self._decode_step()

    def run(self) -> None:
        """Step until no prompt waits and no slot decodes."""
        while self.busy:
            self.step()

    def _prefill(self, request: MixedRequest) -> None:
        def chunk_done(state: ModelState, done: int) -> None:
            self.chunks += 1
            self._decode_step()

        result = self.prefill.prefill(
            request.prompt,
            sampling=request.sampling,
            max_len=self.decode.max_len,
            on_chunk=chunk_done,
        )
        self._emit(request, result.first_token)
        if request.max_new_tokens == 1:
            request.done = True
            return
        slot = self.decode.insert(
            result.state,
            result.first_token,
            request.sampling,
            max_new_tokens=request.max_new_tokens - 1,
        )
        self._slots[slot] = request

    def _decode_step(self) -> None:
        made = self.decode.step()
        if not made:
            return
        self.steps += 1
        for slot, token in made:
            request = self._slots[slot]
            self._emit(request, token)
            if self.decode.is_finished(slot):
                self.decode.free(slot)
                del self._slots[slot]
                request.done = True

    def _emit(self, request: MixedRequest, token: int) -> None:
        request.tokens.append(token)
        request.times.append(self.clock())
