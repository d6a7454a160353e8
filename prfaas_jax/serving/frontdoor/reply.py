"""One request's token stream from the router as the front door answers it: `Reply` (text pieces
with their finish reason, the tokens and their log-probabilities), `whole_choices` (the choices of
a reply answered whole: several prompts, ``n``, ``best_of``, ``echo`` and ``logprobs``), and
`router_error` (a router's gRPC status as the HTTP error the client gets).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from prfaas_jax.engine.tokenizer import ByteTokenizer, Tokenizer
from prfaas_jax.serving.frontdoor.logprob_objects import chat_logprobs, completion_logprobs
from prfaas_jax.serving.frontdoor.openai_api import ApiError, Completion, choice, chunk, response
from prfaas_jax.serving.frontdoor.text import TextStream
from prfaas_jax.serving.proto import prfaas_pb2 as pb

log = logging.getLogger("prfaas.frontdoor")


def _sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),  # x-request-id in flight
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def router_error(err: grpc.aio.AioRpcError) -> ApiError:
    status, kind = HTTP_STATUS.get(err.code(), (500, "server_error"))
    return ApiError(status, err.details() or err.code().name, kind=kind, code=err.code().name)


ENDED_EARLY = ApiError(502, "the router's stream ended unfinished", kind="server_error")


class Reply:
    """One request's token stream from the router, as text pieces with their finish reason."""

    def __init__(
        self,
        completion: Completion,
        rid: str,
        model: str,
        call: grpc.aio.UnaryStreamCall,
        first: pb.GenerateResponse,
        messages: AsyncIterator[pb.GenerateResponse],
        tokenizer: Tokenizer | None = None,
        prompt: Sequence[int] | None = None,
    ) -> None:
        self.completion, self.rid, self.model, self.call = completion, rid, model, call
        self.first, self.messages = first, messages
        self.prompt = list(completion.prompt_ids if prompt is None else prompt)
        self.tokenizer = tokenizer or ByteTokenizer()
        self.text = TextStream(completion.stop, self.tokenizer.detokenizer())
        self.tokens = 0
        self.cached = 0  # prompt tokens the cluster reused, from the router's latest report
        self.ids: list[int] = []  # the tokens counted, and their log-probabilities when asked
        self.scored: list[pb.TokenLogprob] = []
        self.prompt_scored: list[pb.TokenLogprob] = []

    async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
        """(text, None) as tokens arrive; the last piece carries the finish reason: "length"
        with the router's final message (which holds the last tokens), "stop" with the text
        before a stop string or an end-of-sequence id. The router call is cancelled on a stop
        and on any early exit; a finished one is read to its end, so the router has counted the
        request by then."""
        finished = False
        try:
            message = self.first
            while True:
                if message.HasField("report"):
                    self.cached = message.report.cached_len
                ids = list(message.token_ids)
                eos = next((i for i, t in enumerate(ids) if t in self.completion.stop_ids), None)
                counted = len(ids) if eos is None else eos + 1
                self.tokens += counted
                self.ids += ids[:counted]
                self.scored += list(message.logprobs)[:counted]
                self.prompt_scored += message.prompt_logprobs
                text = self.text.push(ids if eos is None else ids[:eos])
                if eos is not None and not self.text.stopped:
                    text += self.text.finish()
                    yield text, "stop"
                    return
                if self.text.stopped:
                    yield text, "stop"
                    return
                if message.finished:
                    finished = True
                    with contextlib.suppress(grpc.aio.AioRpcError):  # the reply is whole
                        async for _ in self.messages:  # nothing follows the final message
                            pass
                    text += self.text.finish()
                    yield text, "stop" if self.text.stopped else "length"
                    return
                if text:
                    yield text, None
                try:
                    message = await anext(self.messages)
                except StopAsyncIteration:  # a router always sends a finished message
                    raise ENDED_EARLY from None
                except grpc.aio.AioRpcError as err:
                    raise router_error(err) from None
        finally:
            if not finished:
                self.call.cancel()

    def counts(self) -> tuple[int, int, int]:
        """Prompt tokens, completion tokens, cached prompt tokens: `usage`'s."""
        return len(self.prompt), self.tokens, self.cached

    async def collect(self) -> tuple[str, str]:
        """The whole text and its finish reason."""
        texts, finish = [], "length"
        async for text, reason in self.pieces():
            texts.append(text)
            finish = reason or finish
        return "".join(texts), finish

    async def whole(self) -> dict:
        text, finish = await self.collect()
        choices = [choice(self.completion.chat, text, finish)]
        return response(self.completion, self.rid, self.model, choices, self.counts())

    def mean_logprob(self) -> float:
        """The mean log-probability of its tokens: `best_of`'s ranking."""
        return sum(s.logprob for s in self.scored) / max(len(self.scored), 1)

    async def events(self) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed reply. With ``logprobs`` each chunk carries those
        of the tokens counted since the previous chunk (text held back for a stop string comes
        in a later chunk than its tokens' log-probabilities)."""
        first, sent, offset = True, 0, 0
        try:
            async for text, reason in self.pieces():
                logprobs = None
                if self.completion.logprobs is not None:
                    ids, scored = self.ids[sent:], self.scored[sent:]
                    sent = len(self.ids)
                    if self.completion.chat:
                        logprobs = chat_logprobs(self.tokenizer, ids, scored)
                    else:
                        logprobs = completion_logprobs(self.tokenizer, ids, scored, offset)
                        offset += sum(len(t) for t in logprobs["tokens"])
                body = chunk(self.completion, self.rid, self.model, text, reason, first=first)
                if logprobs is not None:
                    body["choices"][0]["logprobs"] = logprobs
                yield _sse(body)
                first = False
        except ApiError as err:  # the 200 is gone: an error event ends the stream
            log.warning("%s: %s", self.rid, err)
            yield _sse(err.body)
            return
        if self.completion.include_usage:
            yield _sse(chunk(self.completion, self.rid, self.model, None, counts=self.counts()))
        yield _sse("[DONE]")


def _choice_of(
    completion: Completion, tokenizer: Tokenizer, reply: Reply, text: str, finish: str, index: int
) -> dict:
    """One whole choice: with ``echo`` the prompt's text before the reply's (and its tokens
    first in the log-probabilities, the first prompt token scoring None)."""
    prompt_text = tokenizer.decode(reply.prompt) if completion.echo else ""
    logprobs = None
    if completion.logprobs is not None and completion.chat:
        logprobs = chat_logprobs(tokenizer, reply.ids, reply.scored)
    elif completion.logprobs is not None:
        tokens, scored = list(reply.ids), list(reply.scored)
        if completion.echo:
            tokens = reply.prompt + tokens
            scored = [None, *reply.prompt_scored, *scored]
        logprobs = completion_logprobs(tokenizer, tokens, scored)
    return choice(completion.chat, prompt_text + text, finish, index=index, logprobs=logprobs)


def whole_choices(
    completion: Completion, tokenizer: Tokenizer, finished: Sequence[tuple[Reply, str, str]]
) -> list[dict]:
    """The choices of `completion` from its ``best_of`` replies per prompt, prompt by prompt:
    the ``n`` with the highest mean token log-probability (all of them when best_of = n)."""
    out = []
    for start in range(0, len(finished), completion.best_of):
        replies = list(finished[start : start + completion.best_of])
        if completion.best_of > completion.n:
            replies.sort(key=lambda r: r[0].mean_logprob(), reverse=True)
        for reply, text, finish in replies[: completion.n]:
            out.append(_choice_of(completion, tokenizer, reply, text, finish, len(out)))
    return out
