"""Conversions between prfaas.proto messages and the project's types.

`role_to_proto` / `role_from_proto` (policy `Role` ↔ `prfaas.v1.Role`), `sampling_from_proto` /
`sampling_to_proto` (`SamplingParams` ↔ the message; an unset top_p of 0 reads as 1.0, "off"),
and `check_prompt`, the request checks every entry point shares.
"""

from __future__ import annotations

from collections.abc import Sequence

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.errors import UserError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.proto import prfaas_pb2 as pb

_ROLES = {
    Role.PRFAAS_PREFILL: pb.ROLE_PRFAAS_PREFILL,
    Role.PD_PREFILL: pb.ROLE_PD_PREFILL,
    Role.PD_DECODE: pb.ROLE_PD_DECODE,
}
_FROM_PROTO = {value: role for role, value in _ROLES.items()}


def role_to_proto(role: Role) -> int:
    return _ROLES[role]


def role_from_proto(value: int) -> Role:
    if value not in _FROM_PROTO:
        raise UserError(f"unknown role {value}; expected one of {sorted(_FROM_PROTO)}")
    return _FROM_PROTO[value]


def sampling_from_proto(temperature: float, top_p: float, top_k: int, seed: int) -> SamplingParams:
    """Raises UserError for invalid settings (negative temperature, top_p outside (0, 1])."""
    # proto3 has no "unset": a zero top_p means the field was left out, i.e. nucleus off.
    return SamplingParams(
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=1.0 if top_p == 0 else float(top_p),
        seed=int(seed),
    )


def sampling_to_proto(sampling: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
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
