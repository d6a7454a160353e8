"""Rotary position embedding over the first ``rotary_dim`` dims of each head.

For frequency ``f_i = θ^(−2i/r)``, ``i < r/2``, a pair ``(a, b)`` at position ``p`` becomes
``(a cos pf_i − b sin pf_i, b cos pf_i + a sin pf_i)``. ``NEOX`` pairs dim ``i`` with ``i + r/2``
(rotate-half); ``INTERLEAVED`` pairs ``2i`` with ``2i + 1`` (DeepSeek / Ring MLA). Dims past
``rotary_dim`` pass through unchanged (partial RoPE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.config import RopeKind
from prfaas_jax.ops.precision import upcast


def apply_rope(
    x_BTHD: jax.Array, positions_BT: jax.Array, *, kind: RopeKind, rotary_dim: int, theta: float
) -> jax.Array:
    if kind is RopeKind.NONE or rotary_dim == 0:
        return x_BTHD
    half = rotary_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rotary_dim)
    angles = positions_BT.astype(jnp.float32)[..., None, None] * freqs  # [B, T, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    rot = upcast(x_BTHD[..., :rotary_dim])
    if kind is RopeKind.NEOX:
        a, b = rot[..., :half], rot[..., half:]
        rot = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([rot.astype(x_BTHD.dtype), x_BTHD[..., rotary_dim:]], axis=-1)
