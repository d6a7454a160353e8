"""A conversation with a running cluster, turn by turn: `Conversation` and its `Turn` reports
(what `prfaas chat` prints).

Each turn sends the whole conversation so far — every earlier message and reply — plus the new
message, as one prompt, the way a chat client talks to a stateless completion server. The
cluster sees a prompt that extends the previous one: its prefix cache finds the earlier turns
(the report's ``cached_len``), threshold routing sends the turn by its *uncached* length, and an
offloaded turn ships only the state's increment when the decode worker still holds the rest
(``saved_bytes``). A turn's report makes all of that visible.

Messages are text, encoded with the served model's tokenizer (engine/tokenizer.py: a
checkpoint's own, else the byte-level one, which needs a vocabulary of at least 256), or token
ids. A reply streams: ``on_tokens`` sees each message's new token ids as the router sends them,
before the turn's report (which comes with the last). A turn the cluster refuses leaves the
conversation as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import grpc

from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.engine.tokenizer import ByteTokenizer, Tokenizer
from prfaas_jax.errors import UserError
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

SEPARATOR = "\n"  # ends each message and each reply in the conversation's text
OnTokens = Callable[[list[int]], None]  # a reply's new token ids, as they arrive


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn as the router reported it."""

    turn: int  # 1-based
    prompt_len: int  # the whole conversation so far, in tokens
    cached_len: int  # of it, found in a prefix cache
    route: str  # "prfaas" or "pd"
    threshold: float  # the router's t when it routed the turn
    ttft_s: float
    state_bytes: int  # shipped over the inter-cluster link (prfaas) or within PD
    saved_bytes: int  # not shipped: the decode worker still held those KV rows
    prefill_instance: str
    tokens: list[int]  # the reply
    text: str | None  # the reply decoded (text conversations)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line: where the turn went and what the cache and the link did for it."""
        share = f" ({self.cached_len / self.prompt_len:.0%})" if self.cached_len else ""
        shipped = f"state {self.state_bytes:,} B shipped"
        if self.saved_bytes:
            shipped += f", {self.saved_bytes:,} B already there"
        return (
            f"turn {self.turn}: {self.route} on {self.prefill_instance} (t = "
            f"{self.threshold:.0f}) · prompt {self.prompt_len:,} tokens, {self.cached_len:,} "
            f"cached{share} · TTFT {self.ttft_s * 1e3:.0f} ms · {shipped}"
        )


class Conversation:
    """A growing context sent to a router one turn at a time."""

    def __init__(
        self,
        stub: pb_grpc.RouterStub,
        *,
        max_new_tokens: int = 32,
        sampling: SamplingParams = GREEDY,
        timeout_s: float = 300.0,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise UserError("a reply needs at least 1 new token")
        self.stub, self.max_new_tokens = stub, max_new_tokens
        self.sampling, self.timeout_s = sampling, timeout_s
        self.context: list[int] = []
        self.turns = 0
        self._tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()

    def reset(self) -> None:
        self.context, self.turns = [], 0

    def say(self, message: str, on_tokens: OnTokens | None = None) -> Turn:
        """Send a text message (the separator appended) and return the turn; the reply and
        its separator join the context."""
        turn = self._send(self._tokenizer.encode(message + SEPARATOR), on_tokens)
        text = self._tokenizer.decode(turn.tokens)
        self.context += self._tokenizer.encode(SEPARATOR)
        return dataclasses.replace(turn, text=text)

    def say_ids(self, ids: Sequence[int], on_tokens: OnTokens | None = None) -> Turn:
        """Send token ids as the next message; the reply's tokens join the context."""
        return self._send(list(ids), on_tokens)

    def _send(self, message: list[int], on_tokens: OnTokens | None) -> Turn:
        if not message:
            raise UserError("an empty message")
        prompt = self.context + message
        request = pb.GenerateRequest(
            prompt_token_ids=prompt,
            max_new_tokens=self.max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            seed=self.sampling.seed,
        )
        tokens: list[int] = []
        report = None
        try:
            for reply in self.stub.Generate(request, timeout=self.timeout_s):
                tokens.extend(reply.token_ids)
                if on_tokens is not None and reply.token_ids:
                    on_tokens(list(reply.token_ids))
                if reply.finished:
                    report = reply.report
        except grpc.RpcError as err:
            raise UserError(
                f"the cluster refused the turn: {err.code().name}: {err.details()}"
            ) from None
        if report is None:
            raise UserError("the router's stream ended without a report")
        self.context = prompt + tokens
        self.turns += 1
        return Turn(
            turn=self.turns,
            prompt_len=report.prompt_len,
            cached_len=report.cached_len,
            route=report.route,
            threshold=report.threshold,
            ttft_s=report.ttft_s,
            state_bytes=report.state_bytes,
            saved_bytes=report.saved_bytes,
            prefill_instance=report.prefill_instance,
            tokens=tokens,
            text=None,
        )
