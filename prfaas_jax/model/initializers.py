"""Random parameter initialisers for seeded toy models (real weights come from checkpoints).

Projections are drawn with std ``1/sqrt(fan_in)`` so activations stay O(1) through the stack and
random models give well-separated logits (deterministic greedy decoding in tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class KeySplitter:
    """Hands out fresh PRNG keys: ``keys()`` each time a parameter needs one."""

    def __init__(self, key: jax.Array):
        self._key = key

    def __call__(self) -> jax.Array:
        self._key, sub = jax.random.split(self._key)
        return sub


def dense(key: jax.Array, shape: tuple[int, ...], dtype, *, fan_in: int | None = None) -> jax.Array:
    fan_in = shape[-2] if fan_in is None else fan_in
    return (jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dtype)


def ones(shape: tuple[int, ...], dtype) -> jax.Array:
    return jnp.ones(shape, dtype)


def uniform(key: jax.Array, shape: tuple[int, ...], low: float, high: float) -> jax.Array:
    return jax.random.uniform(key, shape, jnp.float32, low, high)


def inverse_softplus(x: jax.Array) -> jax.Array:
    return x + jnp.log(-jnp.expm1(-x))
