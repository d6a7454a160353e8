"""Conversions between prfaas.proto messages and the project's types.

`role_to_proto` / `role_from_proto` (policy `Role` ↔ `prfaas.v1.Role`), `sampling_from_proto` /
`sampling_to_proto` (`SamplingParams` ↔ the message; an unset top_p of 0 reads as 1.0, "off"),
and the request checks every entry point shares: `check_prompt` (tokens and budget) and
`check_request_id`. `router_max_request_bytes` bounds a valid `GenerateRequest`, so the router's
port refuses anything larger (RESOURCE_EXHAUSTED) before parsing it.
"""

from __future__ import annotations

from collections.abc import Sequence

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.errors import UserError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.proto import prfaas_pb2 as pb

_ROLES = {
    Role.PRFAAS_PREFILL: pb.ROLE_PRFAAS_PREFILL,
    Role.PD_PREFILL: pb.ROLE_PD_PREFILL,
    Role.PD_DECODE: pb.ROLE_PD_DECODE,
}
_FROM_PROTO = {value: role for role, value in _ROLES.items()}
MAX_REQUEST_ID_LEN = 256


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


def router_max_request_bytes(max_len: int) -> int:
    """An upper bound on the serialized size of any valid `GenerateRequest` for `max_len`.

    A valid prompt has at most `max_len` tokens of ≤ 6 bytes each (a 5-byte int32 varint, plus
    its tag when a client sends the repeated field unpacked); the request id at most
    MAX_REQUEST_ID_LEN characters of ≤ 4 UTF-8 bytes; the scalar fields and the lengths fit in
    the rest. A larger message cannot be valid, so the router's port refuses it unparsed.
    """
    return 6 * max_len + 4 * MAX_REQUEST_ID_LEN + 1024
