"""Conversions between prfaas.proto messages and the project's types.

`role_to_proto` / `role_from_proto` (policy `Role` ↔ `prfaas.v1.Role`), `sampling_from_proto` /
`sampling_to_proto` (`SamplingParams` ↔ the message; an unset top_p of 0 reads as 1.0, "off"),
`logprobs_to_proto` (an engine's `TokenLogprobs` as a `TokenLogprob`), and the request checks
every entry point shares: `check_prompt` (tokens and budget), `check_top_logprobs`,
`check_request_id` and `check_wire_precision`. `router_max_request_bytes` bounds a valid
`GenerateRequest`, so the router's port refuses anything larger (RESOURCE_EXHAUSTED) before
parsing it.

A refusal that no retry can change — a worker's own checks of the request, a prompt past its
engine's limit — is sent as final (`abort_final`): its status carries gRPC's server pushback
trailer with a negative delay (`NO_RETRY`, gRFC A6: "do not retry"), which the router reads
(`is_final`) to fail the request at once instead of trying it again. Anything else a worker
answers, a rejected state included, leaves the router free to retry (docs/serving.md, "Retries").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import grpc

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.engine.token_logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from prfaas_jax.errors import UserError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.wire_precision import WirePrecision

_ROLES = {
    Role.PRFAAS_PREFILL: pb.ROLE_PRFAAS_PREFILL,
    Role.PD_PREFILL: pb.ROLE_PD_PREFILL,
    Role.PD_DECODE: pb.ROLE_PD_DECODE,
}
_FROM_PROTO = {value: role for role, value in _ROLES.items()}
MAX_REQUEST_ID_LEN = 256
# gRPC's server pushback trailer; a negative delay asks the client not to retry (gRFC A6).
NO_RETRY = (("grpc-retry-pushback-ms", "-1"),)


def role_to_proto(role: Role) -> int:
    return _ROLES[role]


def role_from_proto(value: int) -> Role:
    if value not in _FROM_PROTO:
        raise UserError(f"unknown role {value}; expected one of {sorted(_FROM_PROTO)}")
    return _FROM_PROTO[value]


def sampling_from_proto(
    temperature: float, top_p: float, top_k: int, seed: int, first_index: int = 0
) -> SamplingParams:
    """Raises UserError for invalid settings (NaN or ±inf, negative temperature, top_p outside
    (0, 1]). A top_k at or above the vocabulary size is accepted: it keeps every token (off)."""
    # proto3 has no "unset": a zero top_p means the field was left out, i.e. nucleus off.
    return SamplingParams(
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=1.0 if top_p == 0 else float(top_p),
        seed=int(seed),
        first_index=int(first_index),
    )


def sampling_to_proto(sampling: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        first_index=sampling.first_index,
    )


def logprobs_to_proto(scored: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=scored.token,
        logprob=scored.logprob,
        top_ids=[t for t, _ in scored.top],
        top_logprobs=[v for _, v in scored.top],
    )


def check_top_logprobs(top: int) -> int:
    """``top`` if it is a count of alternatives the engines serve; UserError otherwise."""
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise UserError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return top


def check_prompt(
    tokens: Sequence[int], cfg: ModelConfig, *, max_len: int, max_new_tokens: int
) -> None:
    """Raises UserError unless the prompt and budget fit the model and a decode slot."""
    if not tokens:
        raise UserError("prompt_token_ids is empty")
    bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"token id(s) {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    # Decoding n tokens absorbs n − 1 of them into the state after the prompt.
    if len(tokens) + max_new_tokens - 1 > max_len:
        raise UserError(
            f"prompt ({len(tokens)}) + max_new_tokens ({max_new_tokens}) − 1 exceed the "
            f"cluster's max_len {max_len}"
        )


def check_wire_precision(text: str) -> str:
    """A request's wire precision as `WirePrecision` writes it ("" stays ""); UserError naming
    what is wrong."""
    if not text:
        return ""
    try:
        return str(WirePrecision.parse(text))
    except ValueError as err:
        raise UserError(f"wire_precision: {err}") from None


def check_request_id(request_id: str) -> None:
    """Raises UserError unless `request_id` is at most MAX_REQUEST_ID_LEN printable characters.

    Empty is fine (the router assigns an id). Ids end up in logs, metrics and error messages,
    so control characters (newlines, escapes) and other non-printable code points are refused.
    """
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise UserError(
            f"request_id has {len(request_id)} characters, more than {MAX_REQUEST_ID_LEN}"
        )
    bad = next((ch for ch in request_id if not ch.isprintable()), None)
    if bad is not None:
        raise UserError(
            f"request_id contains the non-printable character U+{ord(bad):04X}; "
            "use printable characters only"
        )


def abort_final(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """Abort the call with ``code``, marked final (`NO_RETRY`): whatever refused it would
    refuse it again, so the caller should not retry."""
    context.set_trailing_metadata(NO_RETRY)
    context.abort(code, details)
    raise AssertionError("context.abort returned")


def is_final(err: grpc.RpcError) -> bool:
    """Whether the server ended ``err``'s call with `abort_final` (a negative pushback)."""
    trailing = getattr(err, "trailing_metadata", None)
    for key, value in (trailing() if trailing is not None else None) or ():
        if key == NO_RETRY[0][0]:
            return value.lstrip().startswith("-")
    return False


def router_max_request_bytes(max_len: int) -> int:
    """An upper bound on the serialized size of any valid `GenerateRequest` for `max_len`.

    A valid prompt has at most `max_len` tokens of ≤ 6 bytes each (a 5-byte int32 varint, plus
    its tag when a client sends the repeated field unpacked); the request id at most
    MAX_REQUEST_ID_LEN characters of ≤ 4 UTF-8 bytes; the scalar fields, a wire precision
    (under 80 characters when written plainly) and the lengths fit in the rest. A larger
    message cannot be valid, so the router's port refuses it unparsed.
    """
    return 6 * max_len + 4 * MAX_REQUEST_ID_LEN + 1024
