"""Grouped-query softmax attention over a key buffer whose slots carry absolute positions.

    o[b,t,h] = Σ_s softmax_s( scale · q[b,t,h]·k[b,s,g(h)] + mask[b,t,s] ) · v[b,s,g(h)]

with ``g(h) = h // (H / H_kv)`` and ``mask`` = 0 where slot ``s`` is filled (``kv_pos ≥ 0``),
causal (``kv_pos ≤ q_pos``) and, with a window ``W``, recent (``q_pos − kv_pos < W``: the query
sees itself and the ``W − 1`` tokens before it); −∞ elsewhere. Because masks come from positions,
one function serves prefill over a fresh buffer, prefill that continues a cache, one-token decode,
and sliding-window ring buffers (whose slots hold positions out of order). Optional per-head
*sink* logits join the softmax denominator without contributing a value (attention sinks).

Everything is computed in fp32; the output takes ``v``'s dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def attention(
    q_BTHD: jax.Array,
    k_BSGD: jax.Array,
    v_BSGV: jax.Array,
    *,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
    window: int = 0,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Masked GQA. ``q_pos`` [B,T], ``kv_pos`` [B,S] (−1 marks an empty slot), ``sinks`` [H]."""
    batch, seq_len, num_heads, _ = q_BTHD.shape
    num_groups = k_BSGD.shape[2]
    per_group = num_heads // num_groups
    q = q_BTHD.astype(jnp.float32).reshape(batch, seq_len, num_groups, per_group, -1)
    logits = jnp.einsum(
        "btgrd,bsgd->bgrts", q, k_BSGD.astype(jnp.float32), precision=_HIGHEST
    ) * jnp.float32(scale)

    qp = q_pos[:, :, None]
    kp = kv_pos[:, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if window:
        visible &= qp - kp < window
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)

    if sinks is None:
        peak = jnp.max(logits, axis=-1, keepdims=True)
    else:
        sink = sinks.astype(jnp.float32).reshape(1, num_groups, per_group, 1, 1)
        peak = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    # A query with nothing visible (only possible for padding rows) must not produce NaN.
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(logits - peak)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - peak)
    probs = weights / jnp.maximum(denom, jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("bgrts,bsgv->btgrv", probs, v_BSGV.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(batch, seq_len, num_heads, -1).astype(v_BSGV.dtype)
