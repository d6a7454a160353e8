"""A mixed PD instance (`[instances] pd_mode = "mixed"`): `MixedDecodeService`, a decode worker
that also prefills the PD cluster's own prompts in its decode steps, and `MixedPrefillService`,
the `PrefillWorker` calls that hand it those prompts.

The router sends a mixed instance a local request's `Prefill` and `Generate` both (its decode
instance is the instance that prefills it). `Prefill` queues the prompt on the node's decode
service and waits: the engine thread runs every step through the node's mixer
(engine/mixed_step.py `MixedStep`, or engine/fake_mixed.py), each step the decode rows and a chunk
of the prompt at the head of the queue, chosen so the time between tokens stays within about
1.5 decode steps. Once the prompt is in, its state is kept for its request exactly as a pushed
state would be — parked for its `Generate`, or ready for a slot — without crossing any wire, and
the `Prefill` call returns (no state bytes, no transfer). States from PrfaaS instances still
arrive by `PushState` as at any decode worker. Prompts are absorbed one at a time, in arrival
order; at most `max_prompts` wait (more are RESOURCE_EXHAUSTED). A mixed instance keeps no
prefix cache: a prefix another instance offers (`prefix_source`) is not fetched, the whole
prompt is computed. A prompt asking for its log-probabilities is refused (INVALID_ARGUMENT,
final): a mixed instance scores no prompt.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from prfaas_jax.engine.api import DecodeEngineLike, MixedStepLike
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.errors import UserError
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.messages import abort_final, check_prompt, sampling_from_proto
from prfaas_jax.serving.worker.decode import DecodeService

if TYPE_CHECKING:
    from prfaas_jax.engine.api import PromptFill


@dataclasses.dataclass(eq=False)
class LocalPrompt:
    """A prompt this node prefills: what its `Prefill` call waits for."""

    request_id: str
    tokens: list[int]
    sampling: SamplingParams
    queued: float = dataclasses.field(default_factory=time.perf_counter)
    started: float = 0.0
    prefilled: float = 0.0
    fill: PromptFill | None = None
    first_token: int | None = None
    refusal: tuple[grpc.StatusCode, str] | None = None  # the state was not kept
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class MixedDecodeService(DecodeService):
    """A decode worker whose steps also prefill the prompts queued by `prefill_here`."""

    def __init__(
        self, *, mixer: Callable[[], MixedStepLike], max_prompts: int = 64, **options
    ) -> None:
        """``mixer()``: the node's mixer, whose ``decode`` engine the service drives;
        ``options``: `DecodeService`'s."""
        super().__init__(engine=lambda: mixer().decode, **options)
        self._mixer, self.max_prompts = mixer, max_prompts
        self._local: collections.deque[LocalPrompt] = collections.deque()
        self.local_prefills = 0

    def prefill_here(self, prompt: LocalPrompt, timeout_s: float) -> None:
        """Queue ``prompt`` and wait until its state is kept, or refused (``prompt.refusal``:
        the queue is full, the prompt waited ``timeout_s`` without being absorbed, or its state
        could not be kept)."""
        self._start_engine_thread()
        with self._cv:
            if len(self._local) >= self.max_prompts:
                prompt.refusal = (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{prompt.request_id}: {self.max_prompts} prompts already wait here",
                )
                return
            self._local.append(prompt)
            self._cv.notify_all()
        if prompt.done.wait(timeout_s):
            return
        with self._cv:
            waiting = prompt in self._local and prompt.fill is None
            if waiting:  # one under way gets another timeout_s to finish
                self._local.remove(prompt)
        if waiting or not prompt.done.wait(timeout_s):
            prompt.refusal = (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{prompt.request_id}: not prefilled within {timeout_s:g} s",
            )

    def _prompts(self) -> int:
        return len(self._local)

    def _step(self, engine: DecodeEngineLike) -> list[tuple[int, int]]:
        mixer = self._mixer()
        with self._cv:
            head = self._local[0] if self._local else None
        if head is not None and head.fill is None:
            head.started = time.perf_counter()
            head.fill = mixer.start_fill(head.tokens, head.sampling)
        try:
            made = mixer.advance(head.fill if head is not None else None)
        except Exception:
            if head is not None:  # its Prefill fails now, not at its timeout
                self._end(head, (grpc.StatusCode.INTERNAL, "the mixed step failed"))
            raise
        if head is not None and head.fill is not None and head.fill.first_token is not None:
            head.prefilled = time.perf_counter()
            head.first_token = head.fill.first_token
            with self._cv:
                assert head.fill.state is not None
                refusal = self._hold(
                    head.request_id,
                    len(head.tokens),
                    head.fill.state,
                    head.first_token,
                    head.sampling,
                    0,  # no state crossed a wire
                )
                self.local_prefills += refusal is None
            self._end(head, refusal)
        return made

    def _end(self, prompt: LocalPrompt, refusal: tuple[grpc.StatusCode, str] | None) -> None:
        with self._cv:
            if self._local and self._local[0] is prompt:
                self._local.popleft()
        prompt.fill, prompt.refusal = None, refusal  # the slot or the parked request holds it
        prompt.done.set()


class MixedPrefillService(pb_grpc.PrefillWorkerServicer):
    """`Prefill` on a mixed instance: the prompt goes to the node's `MixedDecodeService`."""

    def __init__(
        self,
        decode: MixedDecodeService,
        *,
        max_len: int,
        admit: Callable[[grpc.ServicerContext], None],
        timeout_s: float = 120.0,
    ) -> None:
        self.decode, self.max_len, self._admit, self.timeout_s = decode, max_len, admit, timeout_s

    def _checked(self, request: pb.PrefillRequest) -> tuple[list[int], SamplingParams]:
        """The prompt and its sampling; `UserError` for a request this node refuses."""
        if request.HasField("logprobs"):
            raise UserError("a mixed instance scores no prompt")
        if not request.request_id:
            raise UserError("request_id is empty")
        tokens = list(request.prompt_token_ids)
        check_prompt(tokens, self.decode.cfg, max_len=self.max_len, max_new_tokens=1)
        s = request.sampling
        return tokens, sampling_from_proto(s.temperature, s.top_p, s.top_k, s.seed, s.first_index)

    def Prefill(  # noqa: N802
        self, request: pb.PrefillRequest, context: grpc.ServicerContext
    ) -> pb.PrefillReply:
        self._admit(context)
        try:
            tokens, sampling = self._checked(request)
        except UserError as err:  # the request itself: another attempt would meet the same
            abort_final(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        prompt = LocalPrompt(request.request_id, tokens, sampling)
        self.decode.prefill_here(prompt, self.timeout_s)
        if prompt.refusal is not None:
            context.abort(*prompt.refusal)
        assert prompt.first_token is not None
        return pb.PrefillReply(
            first_token=prompt.first_token,
            queue_s=prompt.started - prompt.queued,
            prefill_s=prompt.prefilled - prompt.started,
        )
