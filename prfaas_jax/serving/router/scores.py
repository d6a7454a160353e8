"""A request's log-probabilities on their way to the client: `AttemptScores`, `scores_asked`.

A request asks with `GenerateRequest.logprobs` (each new token's, with that many likeliest
alternatives) and/or `prompt_logprobs`. The prefill worker of each attempt scores the attempt's
whole context and its first token (`PrefillReply.logprobs`: context tokens 1, 2, … and then the
first token, engine/logprobs.py); the decode worker scores each token it makes
(`DecodeResponse.logprobs`, the stream's first token excepted: prefill made it). `AttemptScores`
pairs them with the tokens an attempt streams: the prompt's go out once, on the request's first
message (an attempt resumed after a fault has sent them already), then one per token, cut with
the tokens to what is still owed.
"""

from __future__ import annotations

from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.router.record import RequestRecord


def scores_asked(record: RequestRecord) -> bool:
    """Whether the request's prefills must score their context."""
    return record.logprobs is not None or record.prompt_logprobs


class AttemptScores:
    """One attempt's log-probabilities, from its prefill reply on."""

    def __init__(self, record: RequestRecord, reply: pb.PrefillReply) -> None:
        self.record = record
        scored = list(reply.logprobs)
        self.prompt = scored[: len(record.prompt) - 1] if record.prompt_logprobs else []
        self.first: pb.TokenLogprob | None = scored[-1] if scored else None

    def fields(self, message: pb.DecodeResponse, taken: int) -> dict:
        """The `GenerateResponse` fields that go with the `taken` tokens of `message`."""
        out: dict = {}
        record = self.record
        if record.prompt_logprobs and not record.prompt_scored:
            out["prompt_logprobs"] = self.prompt
            record.prompt_scored = True
        if record.logprobs is not None:
            scored = list(message.logprobs)
            if self.first is not None:  # the attempt's first message: prefill's token leads
                scored, self.first = [self.first, *scored], None
            out["logprobs"] = scored[:taken]
        return out
