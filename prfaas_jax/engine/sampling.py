"""Token sampling from logits: greedy, temperature, top-k and top-p (nucleus), per row.

``SamplingParams`` is per request; ``sample`` takes per-row arrays so one compiled function
serves a batch of slots with different settings. Temperature 0 means greedy (argmax).

``greedy_tokens`` is the argmax as XLA:CPU runs it fast.

Sampling keys. Token ``i`` of a request (``i = 0`` is prefill's first token, ``i ≥ 1`` the decode
steps) is drawn with ``fold_in(request_key(seed), i)`` (``draw_tokens``): a request's tokens
depend on its own seed and logits only, never on the batch it shares or the step it was
inserted at.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.engine.sampling_params import GREEDY as GREEDY  # re-exported
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.errors import EngineError


def greedy_tokens(logits_BV: jax.Array) -> jax.Array:
    """``argmax`` over the last axis ``[B]`` int32, the first of equal maxima (and of NaNs, as
    ``jnp.argmax``), as two reductions XLA vectorises: a max, then the least index holding it.
    XLA:CPU runs ``argmax``'s (value, index) reduction element by element: over 32K logits it
    took 160 / 610 / 2,300 µs at B = 1 / 8 / 32 where this takes 21 / 105 / 251 (2 cores)."""
    top = jnp.max(logits_BV, axis=-1, keepdims=True)
    hit = (logits_BV == top) | (jnp.isnan(top) & jnp.isnan(logits_BV))
    index = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, logits_BV.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits_BV.shape[-1]), axis=-1)


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
    greedy = greedy_tokens(logits)

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


def request_key(seed: int) -> np.ndarray:
    """uint32[2] threefry key of a request's seed: ``PRNGKey(seed)`` for seeds < 2**32, and
    distinct keys for the 64-bit seeds that ``PRNGKey`` would truncate without x64."""
    if not 0 <= seed < 2**64:
        raise EngineError(f"sampling seed must be in [0, 2**64), got {seed}")
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def draw_tokens(
    logits_BV: jax.Array,
    keys_B2: jax.Array,
    index_B: jax.Array,
    temperature_B: jax.Array,
    top_k_B: jax.Array,
    top_p_B: jax.Array,
) -> jax.Array:
    """Token ``index_B`` of each row's request ``[B]`` int32, with the module's key schedule.

    An all-greedy batch skips the sampler (same tokens): its sort over the vocabulary costs far
    more than the argmax (~280 ms for 32 rows of 32K logits on 2 CPU cores, bench/engine.py).
    """

    def draw(logits):
        keys = jax.vmap(jax.random.fold_in)(keys_B2, index_B)
        return sample(logits, keys, temperature_B, top_k_B, top_p_B)

    def greedy(logits):
        return greedy_tokens(logits.astype(jnp.float32))

    return jax.lax.cond(jnp.any(temperature_B > 0), draw, greedy, logits_BV)


def sampling_knobs(sampling: SamplingParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(temperature, top_k, top_p)`` of one request as the length-1 arrays ``sample`` takes."""
    return (
        np.array([sampling.temperature], np.float32),
        np.array([sampling.top_k], np.int32),
        np.array([sampling.top_p], np.float32),
    )
