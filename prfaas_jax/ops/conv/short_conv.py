"""Depthwise causal 1-D convolution over time with a carried tail.

    y[t, c] = Σ_{j=0}^{W−1} w[j, c] · x̃[t + j, c],   x̃ = tail ‖ x  (tail: the previous W−1 inputs)

so ``w[W−1]`` multiplies the current token. The new tail is the last ``W−1`` inputs of the
*valid* prefix: for row ``b`` with ``valid_len[b]`` real tokens, ``x̃[valid_len[b] : valid_len[b]
+ W − 1]``. Padding after the valid tokens therefore never leaks into the carried state, which is
what lets a prefill padded to a length bucket continue exactly.

``short_conv`` is the shifted-sum form (W fused multiply-adds over the whole sequence);
``short_conv_reference`` walks token by token with ``lax.scan`` and is its oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.ops.precision import compute_dtype


def _tail_after(x_ext: jax.Array, valid_len: jax.Array, width: int) -> jax.Array:
    """Rows ``x_ext[b, valid_len[b] : valid_len[b] + width]`` (``x_ext`` already holds the tail)."""
    take = jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, width, axis=0))
    return take(x_ext, valid_len)


def short_conv(
    x_BTC: jax.Array,
    weight_WC: jax.Array,
    *,
    tail: jax.Array | None = None,
    valid_len: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv. Returns ``(y[B,T,C], new_tail[B,W−1,C])`` in ``x``'s dtype.

    ``tail`` (``[B, W−1, C]``, zeros if None) holds the inputs before ``x``; ``valid_len``
    (``[B]``, default ``T``) marks where each row's real tokens end.
    """
    batch, seq_len, channels = x_BTC.shape
    width = weight_WC.shape[0]
    if tail is None:
        tail = jnp.zeros((batch, width - 1, channels), x_BTC.dtype)
    if valid_len is None:
        valid_len = jnp.full((batch,), seq_len, jnp.int32)
    # Accumulate in fp32: the conv output feeds an L2 norm and the delta rule.
    x_ext = jnp.concatenate([tail.astype(x_BTC.dtype), x_BTC], axis=1)
    f32 = compute_dtype(x_BTC, weight_WC)
    x32, w32 = x_ext.astype(f32), weight_WC.astype(f32)
    y = sum(x32[:, j : j + seq_len] * w32[j] for j in range(width))
    return y.astype(x_BTC.dtype), _tail_after(x_ext, valid_len, width - 1)


def short_conv_reference(
    x_BTC: jax.Array,
    weight_WC: jax.Array,
    *,
    tail: jax.Array | None = None,
    valid_len: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token oracle for ``short_conv``: a window of the last W inputs slides over time."""
    batch, seq_len, channels = x_BTC.shape
    width = weight_WC.shape[0]
    if tail is None:
        tail = jnp.zeros((batch, width - 1, channels), x_BTC.dtype)
    if valid_len is None:
        valid_len = jnp.full((batch,), seq_len, jnp.int32)
    f32 = compute_dtype(x_BTC, weight_WC)
    w32 = weight_WC.astype(f32)

    def step(carry, inputs):
        window, final = carry  # window: [B, W−1, C] most recent inputs, oldest first
        x_t, t = inputs
        full = jnp.concatenate([window, x_t[:, None]], axis=1)
        y_t = jnp.einsum("bwc,wc->bc", full.astype(f32), w32)
        window = full[:, 1:]
        # Freeze the carried tail once a row runs past its valid tokens.
        final = jnp.where((t < valid_len)[:, None, None], window, final)
        return (window, final), y_t

    init = (tail.astype(x_BTC.dtype), tail.astype(x_BTC.dtype))
    (_, new_tail), y = jax.lax.scan(
        step, init, (jnp.swapaxes(x_BTC, 0, 1), jnp.arange(seq_len, dtype=jnp.int32))
    )
    return jnp.swapaxes(y, 0, 1).astype(x_BTC.dtype), new_tail
