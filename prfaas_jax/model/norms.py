"""Normalisations used by the hybrid blocks.

* ``rms_norm``: ``x / sqrt(mean(x²) + eps) · w`` over the last axis (pre-norms, q/k norms, the
  per-head output norm of linear layers).
* ``l2_normalize``: ``x / sqrt(Σ x² + eps)`` (q/k of the delta-rule layers; fla's eps = 1e-6).
* ``gated_rms_norm``: ``rms_norm(x, w) · act(z)`` (the output gate of KDA / GDN / Lightning).

Statistics are computed in at least fp32 whatever the input dtype (ops/precision.py); results take
the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.ops.precision import upcast


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = upcast(x)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * upcast(weight)).astype(x.dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = upcast(x)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def gated_rms_norm(x: jax.Array, weight: jax.Array, gate: jax.Array, eps: float, act) -> jax.Array:
    normed = upcast(rms_norm(x, weight, eps))
    return (normed * act(upcast(gate))).astype(x.dtype)
