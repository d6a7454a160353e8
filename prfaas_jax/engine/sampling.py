"""Token sampling from logits: greedy, temperature, top-k and top-p (nucleus), per row.

``SamplingParams`` is per request; ``sample`` takes per-row arrays so one compiled function
serves a batch of slots with different settings. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from prfaas_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be ≥ 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(
    logits_BV: jax.Array,
    keys_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
) -> jax.Array:
    """One token per row ``[B]`` int32. Rows with temperature 0 take the argmax."""
    logits = logits_BV.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    temp = jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
    scaled = sorted_logits / temp
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k_B > 0, top_k_B, vocab)[:, None]
    scaled = jnp.where(rank < k, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    scaled = jnp.where(mass_before < top_p_B[:, None], scaled, -jnp.inf)
    picked = jax.vmap(jax.random.categorical)(keys_B, scaled)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature_B > 0, sampled, greedy)
