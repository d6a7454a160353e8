"""OpenAI's log-probability objects from the router's `TokenLogprob` messages:
`completion_logprobs` (``/v1/completions``: parallel lists of tokens, their log-probabilities,
their alternatives and text offsets) and `chat_logprobs` (``/v1/chat/completions``: one entry per
token with its bytes and alternatives). No I/O.

A token is shown as the served tokenizer decodes it alone. The byte tokenizer decodes a byte that
is not valid UTF-8 by itself as U+FFFD, so alternatives may share a string: the likeliest of them
keeps it (they come most likely first), which keeps ``max(top_logprobs.values())`` — the
greedy test of log-likelihood evaluation — what the model assigns.
"""

from __future__ import annotations

from collections.abc import Sequence

from prfaas_jax.engine.tokenizer import Tokenizer
from prfaas_jax.serving.proto import prfaas_pb2 as pb


def _alternatives(tokenizer: Tokenizer, scored: pb.TokenLogprob) -> list[tuple[str, float]]:
    pairs = zip(scored.top_ids, scored.top_logprobs, strict=True)
    return [(tokenizer.decode([token]), float(logprob)) for token, logprob in pairs]


def completion_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[int],
    scored: Sequence[pb.TokenLogprob | None],
    offset: int = 0,
) -> dict:
    """The ``logprobs`` of a completion choice; ``scored[i]`` is token i's (None: the first
    prompt token of an echo, which nothing precedes). ``offset``: where the tokens' text starts
    in the choice's text."""
    texts = [tokenizer.decode([token]) for token in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = []
    for s in scored:
        if s is None:
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for text, logprob in _alternatives(tokenizer, s):
            alternatives.setdefault(text, logprob)
        top.append(alternatives)
    return {
        "tokens": texts,
        "token_logprobs": [None if s is None else float(s.logprob) for s in scored],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    tokenizer: Tokenizer, tokens: Sequence[int], scored: Sequence[pb.TokenLogprob]
) -> dict:
    """The ``logprobs`` of a chat choice: each token with its ``top_logprobs``."""
    content = []
    for token, s in zip(tokens, scored, strict=True):
        entry = _chat_entry(tokenizer.decode([token]), float(s.logprob))
        entry["top_logprobs"] = [_chat_entry(*pair) for pair in _alternatives(tokenizer, s)]
        content.append(entry)
    return {"content": content, "refusal": None}
