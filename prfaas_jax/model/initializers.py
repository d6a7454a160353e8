"""Random parameter initialisers for seeded toy models (real weights come from checkpoints).

Each returns an ``nnx.Param`` drawn from ``rngs.params()``. Projections are drawn with std
``1/sqrt(fan_in)`` so activations stay O(1) through the stack and random models give
well-separated logits (deterministic greedy decoding in tests).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


def dense(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, *, fan_in: int | None = None) -> nnx.Param:
    fan_in = shape[-2] if fan_in is None else fan_in
    draw = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(draw.astype(dtype))


def ones(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


def uniform(rngs: nnx.Rngs, shape: tuple[int, ...], low: float, high: float, dtype=jnp.float32):
    draw = jax.random.uniform(rngs.params(), shape, jnp.float32, low, high)
    return nnx.Param(draw.astype(dtype))


def log_uniform(rngs: nnx.Rngs, shape: tuple[int, ...], low: float, high: float) -> nnx.Param:
    """``log(u)``, ``u ~ U[low, high]``: a decay rate stored as its logarithm (``A_log``)."""
    return nnx.Param(jnp.log(jax.random.uniform(rngs.params(), shape, jnp.float32, low, high)))


def softplus_inverse_of_log_uniform(
    rngs: nnx.Rngs, shape: tuple[int, ...], low: float, high: float
) -> nnx.Param:
    """A bias ``b`` with ``softplus(b) = dt``, ``dt`` log-uniform in [low, high] (``dt_bias``)."""
    dt = jnp.exp(
        jax.random.uniform(rngs.params(), shape, jnp.float32, math.log(low), math.log(high))
    )
    return nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
