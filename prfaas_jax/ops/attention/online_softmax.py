"""The online-softmax step both attention kernels share: ``MASK`` and ``softmax_block``.

FlashAttention-2: key blocks are visited in order while each query row keeps a running max m, a
running denominator l and an unnormalised accumulator,

    m' = max(m, max_s x_s),   l' = e^(m - m') l + sum_s e^(x_s - m'),
    acc' = e^(m - m') acc + e^(x - m') V

with x the masked logits of the block. The kernels start m at the head's sink logit (or at
``MASK``, a finite stand-in for -inf) with l = 1: the sink joins the denominator as in
``attention``, and l >= 1 always, so a row that sees nothing yields 0, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.ops.pallas_launch import dot_f32

# Finite stand-in for -inf: exp(MASK - m) underflows to 0 and MASK - MASK stays 0, never NaN.
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def softmax_block(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    logits: jax.Array,
    mask: jax.Array,
    values: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One online-softmax step over a key block: ``carry`` (m, l, acc) [M, 1], [M, 1], [M, Dv];
    ``logits`` and ``mask`` [M, bk]; ``values`` [bk, Dv]."""
    m, l, acc = carry
    logits = jnp.where(mask, logits, MASK)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
    l = correction * l + jnp.sum(p, axis=1, keepdims=True)
    return m_new, l, correction * acc + dot_f32(p, values)
