"""What a wire precision costs the model: `wire_check(cfg, params, prompts, settings, ...)`.

For each prompt the state is prefilled once (exact); for each setting it is sent through the
codec in that precision and decoded, and both states then absorb the same tokens — the exact
state's greedy continuation, ``new_tokens`` of them, fed to each (teacher forcing), so every
step compares the two next-token distributions on one context. Per setting:

- ``payload_bytes``: what the frames carry (the codec's count), and its ratio to native;
- ``agreement``: the share of steps whose argmax equals the exact state's (its greedy token);
- ``mean_kl``: the mean KL(exact ‖ shipped) of the next-token distributions, in nats;
- ``state_error``: ‖shipped − exact‖ / ‖exact‖ over every tensor of the state (and the largest
  per tensor);
- ``recall`` (prompts with an answer: a retrieval checkpoint's questions): the share whose answer
  — the second generated token, the first one computed from the shipped state — is right.

The first generated token comes from the prefill logits, before the state travels, so it is the
same for every setting and is not scored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.layout import canonical_arrays
from prfaas_jax.model import decode_step, init_state, prefill
from prfaas_jax.model.state import ModelState
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.wire_precision import WirePrecision

_prefill = jax.jit(prefill, static_argnames=("cfg", "impl"))
_decode = jax.jit(decode_step, static_argnames=("cfg", "impl"))


@dataclasses.dataclass(frozen=True)
class WireRow:
    """One setting over all prompts (module docstring)."""

    setting: str
    payload_bytes: int  # per prompt, the mean
    ratio: float  # payload ÷ the exact state's bytes, the mean over prompts
    agreement: float
    mean_kl: float
    state_error: float  # over the whole state, the mean over prompts
    max_tensor_error: float  # the largest relative error of one tensor, over all prompts
    recall: float | None  # None: the prompts have no answers

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Tally:
    payload: list[int] = dataclasses.field(default_factory=list)
    ratio: list[float] = dataclasses.field(default_factory=list)
    agree: list[float] = dataclasses.field(default_factory=list)
    kl: list[float] = dataclasses.field(default_factory=list)
    error: list[float] = dataclasses.field(default_factory=list)
    worst: float = 0.0
    right: list[bool] = dataclasses.field(default_factory=list)


def _continue(
    params: dict, cfg: ModelConfig, state: ModelState, tokens: Sequence[int]
) -> np.ndarray:
    """Log-probabilities ``[len(tokens), vocab]`` after absorbing each of ``tokens`` in turn."""
    out = []
    for token in tokens:
        logits, state = _decode(params, cfg, jnp.asarray([token], jnp.int32), state)
        out.append(jax.nn.log_softmax(logits[0].astype(jnp.float32)))
    return np.asarray(jnp.stack(out), np.float64)


def _relative_errors(cfg: ModelConfig, exact: ModelState, shipped: ModelState) -> list[float]:
    """Per tensor, then for the whole state, ‖shipped − exact‖ / ‖exact‖."""
    (_, xs), (_, ys) = canonical_arrays(exact, cfg, 0), canonical_arrays(shipped, cfg, 0)
    per_tensor, num, den = [], 0.0, 0.0
    for (_, x), (_, y) in zip(xs, ys, strict=True):
        a, b = np.asarray(x, np.float64), np.asarray(y, np.float64)
        diff, norm = float(np.sum((b - a) ** 2)), float(np.sum(a**2))
        per_tensor.append(np.sqrt(diff / norm) if norm else float(diff > 0))
        num, den = num + diff, den + norm
    return [*per_tensor, np.sqrt(num / den) if den else 0.0]


def wire_check(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]],
    settings: Sequence[WirePrecision],
    *,
    new_tokens: int = 16,
    answers: Sequence[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[WireRow]:
    """One `WireRow` per setting (module docstring); ``progress(i)`` after prompt ``i``.
    ``new_tokens`` ≥ 2: the first comes from prefill and is not scored."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be ≥ 2 (the first comes from prefill), got {new_tokens}")
    tallies = [_Tally() for _ in settings]
    for index, prompt in enumerate(prompts):
        capacity = len(prompt) + new_tokens
        tokens = jnp.asarray([list(prompt)], jnp.int32)
        logits, exact = _prefill(params, cfg, tokens, init_state(cfg, 1, capacity))
        first = int(jnp.argmax(logits[0, -1]))
        # The exact continuation: greedy tokens, and the distributions they came from.
        fed, reference, state = [first], [], exact
        for _ in range(new_tokens - 1):
            step, state = _decode(params, cfg, jnp.asarray([fed[-1]], jnp.int32), state)
            reference.append(np.asarray(jax.nn.log_softmax(step[0]), np.float64))
            fed.append(int(np.argmax(reference[-1])))
        p = np.stack(reference)
        for tally, setting in zip(tallies, settings, strict=True):
            frames = list(codec.encode(exact, cfg, precision=setting))
            shipped = codec.decode(frames, cfg, max_len=capacity)
            q = _continue(params, cfg, shipped, fed[:-1])
            tally.payload.append(codec.payload_nbytes(frames))
            tally.ratio.append(tally.payload[-1] / state_nbytes(cfg, len(prompt)))
            tally.agree.append(float(np.mean(np.argmax(q, axis=1) == np.array(fed[1:]))))
            tally.kl.append(float(np.mean(np.sum(np.exp(p) * (p - q), axis=1))))
            *per_tensor, whole = _relative_errors(cfg, exact, shipped)
            tally.error.append(whole)
            tally.worst = float(max(tally.worst, *per_tensor))
            if answers is not None:
                tally.right.append(int(np.argmax(q[0])) == answers[index])
        if progress is not None:
            progress(index)
    return [
        WireRow(
            setting=str(setting),
            payload_bytes=round(float(np.mean(t.payload))),
            ratio=float(np.mean(t.ratio)),
            agreement=float(np.mean(t.agree)),
            mean_kl=float(np.mean(t.kl)),
            state_error=float(np.mean(t.error)),
            max_tensor_error=t.worst,
            recall=float(np.mean(t.right)) if answers is not None else None,
        )
        for setting, t in zip(settings, tallies, strict=True)
    ]
