"""OpenAI request bodies in, OpenAI response objects out (no I/O).

`parse_completion` reads a `/v1/completions` or `/v1/chat/completions` body into a
`Completion`: the prompt as token ids, the budget, the sampling settings and the stream options.
Every refusal is an `ApiError` carrying the HTTP status and the OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``) the client gets: 400, or 404 with code
``model_not_found`` for a model other than the served one.

Accepted fields: ``model`` (required; the served model), ``prompt`` (a string, a list of token
ids, or a list of either: several prompts, their choices in order) or ``messages`` (roles
``system`` / ``user`` / ``assistant``, text content), ``max_tokens`` / ``max_completion_tokens``
(default: what still fits in the cluster's ``max_len``), ``temperature``, ``top_p``, ``top_k``,
``seed``, ``stop`` (a string or up to 4), ``stream``, ``stream_options.include_usage``,
``ignore_eos`` (generation otherwise ends at the tokenizer's end-of-sequence token, which the byte
tokenizer does not have), ``repetition_penalty`` 1 (what ``vllm bench serve`` sends), and:

- ``logprobs`` (completions: the alternatives per token, 0–20; chat: true, with
  ``top_logprobs`` 0–20): each token's log-probability under the model (the log-softmax of its
  raw logits, before temperature and top-p), computed in the cluster only when asked;
- ``echo`` (completions): the prompt before the reply, and with ``logprobs`` the prompt tokens'
  log-probabilities too (the first has none) — what log-likelihood evaluation reads;
- ``n`` choices per prompt, and ``best_of`` (≥ n) of which the n with the highest mean token
  log-probability are returned; choice k samples with seed + k.

Several prompts, ``n`` > 1, ``best_of`` > 1 and ``echo`` are answered whole (not streamed); a
streamed reply's chunks carry the log-probabilities of their tokens. Other fields are ignored.

Sampling is seeded: the same ``seed`` and settings give the same tokens whatever route, retries
or workers the request takes. A request without one gets a fresh seed (63 random bits from
`secrets`), and every response object names the seed it sampled with (``seed``, beside
``id``), so a sampled reply can be replayed.

Text becomes ids through the served model's tokenizer (engine/tokenizer.py): a prompt string
with `encode`, a chat's messages through its chat template (`chat_ids`; for the byte tokenizer
`chat_prompt`: each message as ``<|role|>\\n`` then its content and ``\\n``, and
``<|assistant|>\\n`` to open the reply).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Sequence

from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.engine.token_logprobs import MAX_TOP_LOGPROBS
from prfaas_jax.engine.tokenizer import ByteTokenizer, Tokenizer, byte_chat_text
from prfaas_jax.errors import UserError

MAX_STOP = 4
CHAT_ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """A refused request: `status` and the OpenAI error object `body`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


MAX_CHOICES = 16  # n and best_of, per prompt


@dataclasses.dataclass(frozen=True)
class Completion:
    chat: bool
    prompts: tuple[tuple[int, ...], ...]  # one or more prompts, as token ids
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    stop_ids: frozenset[int] = frozenset()  # end-of-sequence ids that end the reply
    logprobs: int | None = None  # alternatives per token when log-probabilities are asked
    echo: bool = False
    n: int = 1
    best_of: int = 1

    @property
    def prompt_ids(self) -> list[int]:
        """The first (for a streamed reply, the only) prompt."""
        return list(self.prompts[0])

    @property
    def several(self) -> bool:
        """Several prompts or choices: answered whole, never streamed."""
        return len(self.prompts) > 1 or self.best_of > 1

    @property
    def whole_only(self) -> bool:
        """Whether a reply that is not streamed takes the whole-reply path (`reply.whole_choices`):
        several choices, ``echo`` or log-probabilities."""
        return self.several or self.logprobs is not None or self.echo

    def seeds(self) -> list[int]:
        """The seed of each of the ``best_of`` choices of a prompt: seed, seed + 1, …"""
        return [(self.sampling.seed + k) % 2**64 for k in range(self.best_of)]


def chat_messages(messages: object) -> list[dict[str, str]]:
    """The ``messages`` of a chat body as ``{"role", "content"}`` dicts of text."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    parts = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object", param)
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise bad_request(f"{param}.role must be one of {', '.join(CHAT_ROLES)}", param)
        if isinstance(content, list):  # content parts: text only
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or not all(
                p.get("type") == "text" and isinstance(t, str)
                for p, t in zip(content, texts, strict=True)
            ):
                raise bad_request(f"{param}.content: only text parts are supported", param)
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad_request(f"{param}.content must be a string", param)
        parts.append({"role": role, "content": content})
    return parts


def chat_prompt(messages: object) -> str:
    """The prompt text of a chat for the byte tokenizer (the template of the module docstring)."""
    return byte_chat_text(chat_messages(messages))


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false", name)
    return value


def _is_ids(prompt: object) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def _one_prompt(prompt: object, vocab_size: int, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif _is_ids(prompt):
        ids = list(prompt)  # type: ignore[arg-type]
    else:
        raise bad_request("prompt must be a string or a list of token ids (or a list of those)")
    if not ids:
        raise bad_request("prompt is empty", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(
            f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})", "prompt"
        )
    return ids


def _prompts(body: dict, chat: bool, vocab_size: int, tokenizer: Tokenizer) -> list[list[int]]:
    if chat:
        try:
            return [tokenizer.chat_ids(chat_messages(body.get("messages")))]
        except UserError as err:  # the template refuses the conversation
            raise bad_request(str(err), "messages") from None
    prompt = body.get("prompt")
    try:
        if isinstance(prompt, list) and prompt and not _is_ids(prompt):  # several prompts
            return [_one_prompt(p, vocab_size, tokenizer) for p in prompt]
        return [_one_prompt(prompt, vocab_size, tokenizer)]
    except ApiError as err:
        err.body["error"]["param"] = "prompt"
        raise


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise bad_request(f"stop must be a non-empty string or a list of up to {MAX_STOP}", "stop")
    return tuple(stops)


def _choices(body: dict) -> tuple[int, int]:
    """``(n, best_of)``: choices returned and made per prompt."""
    n = _integer(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be in [1, {MAX_CHOICES}]", "n")
    best_of = _integer(body, "best_of")
    best_of = n if best_of is None else best_of
    if not n <= best_of <= MAX_CHOICES:
        raise bad_request(f"best_of must be in [n, {MAX_CHOICES}]", "best_of")
    return n, best_of


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives per token when log-probabilities are asked, else None."""
    if chat:
        if not _flag(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        name, top = "top_logprobs", _integer(body, "top_logprobs") or 0
    else:
        name, top = "logprobs", _integer(body, "logprobs")
        if top is None:
            return None
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]", name)
    return top


def _unsupported(body: dict) -> None:
    """Fields with values this server cannot honour (rather than silently ignoring them)."""
    if _number(body, "repetition_penalty", 1.0) != 1.0:
        raise bad_request("repetition_penalty must be 1", "repetition_penalty")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise bad_request(f"{name} must be 0", name)


def parse_completion(
    body: object,
    *,
    chat: bool,
    model: str,
    vocab_size: int,
    max_len: int,
    tokenizer: Tokenizer | None = None,
) -> Completion:
    """The request of a completions body (`chat`: a chat-completions body) for the served
    `model` and its `tokenizer` (default: the byte-level one); ApiError (400) for anything
    malformed, unknown or out of range."""
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if body.get("model") is None:
        raise bad_request("model is required", "model")
    if body.get("model") != model:  # 404, as OpenAI answers: clients catch NotFoundError
        raise ApiError(
            404, f"the model {body.get('model')!r} is not served here; this server serves "
            f"{model!r}", param="model", code="model_not_found",
        )  # fmt: skip
    _unsupported(body)
    prompts = _prompts(body, chat, vocab_size, tokenizer)
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = [(n, v) for n, v in ((n, _integer(body, n)) for n in names) if v is not None]
    name, budget = given[0] if given else (names[-1], None)
    longest = max(len(p) for p in prompts)
    room = max_len + 1 - longest  # n tokens absorb n − 1 into the state
    if budget is None:
        budget = room
    if budget < 1:
        raise bad_request(f"{name} must be ≥ 1, got {budget}", name)
    if budget > room:
        raise bad_request(
            f"the prompt ({longest} tokens) and {name} ({budget}) do not fit in "
            f"the context of {max_len} tokens",
            name,
            "context_length_exceeded",
        )
    top_k = _integer(body, "top_k")
    seed = _integer(body, "seed")
    try:
        sampling = SamplingParams(
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=0 if top_k is None or top_k < 0 else top_k,  # vLLM: -1 is off
            seed=secrets.randbits(63) if seed is None else seed,
        )
    except UserError as err:
        raise bad_request(str(err), str(err).split()[0]) from None
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    ignore_eos = _flag(body, "ignore_eos")
    n, best_of = _choices(body)
    completion = Completion(
        chat=chat,
        prompts=tuple(tuple(p) for p in prompts),
        max_tokens=budget,
        sampling=sampling,
        stop=_stop(body),
        stream=_flag(body, "stream"),
        include_usage=_flag(stream_options, "include_usage"),
        stop_ids=frozenset() if ignore_eos else tokenizer.eos_ids,
        logprobs=_logprobs(body, chat),
        echo=not chat and _flag(body, "echo"),
        n=n,
        best_of=best_of,
    )
    if completion.stream and (completion.several or completion.echo):
        raise bad_request(
            "several prompts or choices and echo are answered whole: stream must be false",
            "stream",
        )
    return completion


# --- response objects -------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: the prompt's tokens served from a prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice(
    chat: bool,
    text: str,
    finish: str | None,
    *,
    delta: bool = False,
    first: bool = True,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One choice: whole (``delta`` false) or a streamed piece."""
    out: dict = {"index": index}
    if not chat:
        out["text"] = text
    elif not delta:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    return out | {"logprobs": logprobs, "finish_reason": finish}


def response(
    completion: Completion, rid: str, model: str, choices: list[dict], counts: Sequence[int]
) -> dict:
    """The whole (non-streaming) reply with its `choice` objects; ``counts``: `usage`'s."""
    return {
        "id": rid,
        "object": "chat.completion" if completion.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "seed": completion.sampling.seed,
        "choices": choices,
        "usage": usage(*counts),
    }


def chunk(
    completion: Completion,
    rid: str,
    model: str,
    text: str | None,
    finish: str | None = None,
    *,
    first: bool = False,
    counts: Sequence[int] | None = None,
) -> dict:
    """One streamed chunk: a piece of text (and/or the finish reason), or with ``text`` None
    the usage chunk (no choices) that ``stream_options.include_usage`` asks for."""
    choices = (
        [] if text is None else [choice(completion.chat, text, finish, delta=True, first=first)]
    )
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if completion.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "seed": completion.sampling.seed,
        "choices": choices,
    }
    if counts is not None:
        body["usage"] = usage(*counts)
    return body


def models(model: str, created: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "prfaas"}],
    }
