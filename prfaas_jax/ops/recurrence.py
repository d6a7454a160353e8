"""What the ``jnp`` forms of the linear recurrences (delta rule, Lightning) share:
``initial_state_or_zeros`` (the carried state), ``to_chunks`` / ``from_chunks`` (the chunk layout)
and ``log_decay_matrix`` / ``sum_after`` (segment sums of log decays within a chunk).

A decay between positions j < i of a chunk is exp(sum_{j<s<=i} g_s). Real gates reach -2000 per
step, so both helpers build every such exponent as a sum over exactly the segment it spans (<= 0):
never exp(-G_j), and never a difference of two large prefix sums, whose fp32 rounding ``exp``
would amplify.
"""

import jax
import jax.numpy as jnp


def initial_state_or_zeros(
    initial_state: jax.Array | None, shape: tuple[int, int, int, int], dtype: jnp.dtype
) -> jax.Array:
    """The carried state [B, HV, K, V] in ``dtype`` (the recurrence's compute dtype, fp32 or
    wider); ``None`` means a fresh (zero) state."""
    if initial_state is None:
        return jnp.zeros(shape, dtype)
    if initial_state.shape != shape:
        raise ValueError(f"initial_state has shape {initial_state.shape}, expected {shape}")
    return initial_state.astype(dtype)


def to_chunks(x_BTHD: jax.Array, chunk_size: int) -> jax.Array:
    """[B, T, H, D] -> [N, B, H, C, D], zero-padded at the end to N = ceil(T / C) chunks."""
    B, T, H, D = x_BTHD.shape
    N = -(-T // chunk_size)
    x = jnp.pad(x_BTHD, ((0, 0), (0, N * chunk_size - T), (0, 0), (0, 0)))
    return x.reshape(B, N, chunk_size, H, D).transpose(1, 0, 3, 2, 4)


def from_chunks(x_NBHCD: jax.Array, length: int) -> jax.Array:
    """Inverse of ``to_chunks``: [N, B, H, C, D] -> [B, length, H, D]."""
    N, B, H, C, D = x_NBHCD.shape
    return x_NBHCD.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, D)[:, :length]


def log_decay_matrix(g_CD: jax.Array) -> jax.Array:
    """[..., C, D] -> [..., C, C, D]: sum_{j<s<=i} g_s for i >= j, -inf above the diagonal."""
    C = g_CD.shape[-2]
    pos = jnp.arange(C)
    strict = (pos[:, None] > pos[None, :])[:, :, None]
    seg_CCD = jnp.cumsum(jnp.where(strict, g_CD[..., :, None, :], 0.0), axis=-3)
    return jnp.where((pos[:, None] >= pos[None, :])[:, :, None], seg_CCD, -jnp.inf)


def sum_after(g_CD: jax.Array) -> jax.Array:
    """sum_{s>j} g_s along the C axis (-2), accumulated from the far end: each entry adds only
    the terms of its own segment, so its rounding is relative to its own (small) magnitude."""
    tail = jax.lax.cumsum(g_CD[..., 1:, :], axis=g_CD.ndim - 2, reverse=True)
    return jnp.concatenate([tail, jnp.zeros_like(g_CD[..., :1, :])], axis=-2)
