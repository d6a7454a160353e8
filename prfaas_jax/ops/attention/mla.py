"""MLA decode in the absorbed form, over the latent cache (DeepSeek-V2/V3; research/models.md §C3).

With ``kv_b_proj`` split per head into ``W_UK[h]`` (latent → k_nope) and ``W_UV[h]`` (latent → v):

    q̃_h     = W_UK[h]ᵀ q_nope_h                                  (R)
    score_hs = scale · (q̃_h · c_kv_s + q_rope_h · k_rope_s)
    ctx_h    = Σ_s softmax_s(score_hs) · c_kv_s                   (R)
    o_h      = W_UV[h] ctx_h                                      (Dv)

This is multi-query attention with (R + Dr)-dim keys and R-dim values shared by every head, so
the cache stays ``c_kv ‖ k_rope`` and is never expanded per head. It equals the expanded form
(``attention`` over ``k = [W_UK c_kv ‖ k_rope]``, ``v = W_UV c_kv``) up to rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def mla_decode_absorbed(
    q_nope_BTHN: jax.Array,
    q_rope_BTHP: jax.Array,
    c_kv_BSR: jax.Array,
    k_rope_BSP: jax.Array,
    w_uk_RHN: jax.Array,
    w_uv_RHV: jax.Array,
    *,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
) -> jax.Array:
    """Absorbed MLA attention; returns ``[B, T, H, Dv]`` in ``c_kv``'s dtype.

    Masked like ``attention`` (filled and causal slots only). Written out rather than through
    ``attention``: the cache is the dots' *left* operand, ``[S, R]`` contracted on its last axis
    as stored, so XLA:CPU reads it in place instead of concatenating ``c_kv ‖ k_rope`` and
    transposing the whole cache every step (over 10x slower at 32 slots of 576 on 2 cores).
    """
    f32 = jnp.float32
    c_kv = c_kv_BSR.astype(f32)
    q_latent = jnp.einsum(
        "bthn,rhn->bthr", q_nope_BTHN.astype(f32), w_uk_RHN.astype(f32), precision=_HIGHEST
    )
    logits_BSTH = jnp.einsum("bsr,bthr->bsth", c_kv, q_latent, precision=_HIGHEST)
    logits_BSTH += jnp.einsum(
        "bsp,bthp->bsth", k_rope_BSP.astype(f32), q_rope_BTHP.astype(f32), precision=_HIGHEST
    )
    kp = kv_pos[:, :, None, None]
    visible = (kp >= 0) & (kp <= q_pos[:, None, :, None])
    logits_BSTH = jnp.where(visible, logits_BSTH * jnp.float32(scale), -jnp.inf)
    peak = jnp.max(logits_BSTH, axis=1, keepdims=True)
    # A query with nothing visible (only possible for padding rows) must not produce NaN.
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(logits_BSTH - peak)
    denom = jnp.sum(weights, axis=1, keepdims=True)
    probs = weights / jnp.maximum(denom, jnp.finfo(f32).tiny)
    ctx = jnp.einsum("bsth,bsr->bthr", probs, c_kv, precision=_HIGHEST)
    out = jnp.einsum("bthr,rhv->bthv", ctx, w_uv_RHV.astype(f32), precision=_HIGHEST)
    return out.astype(c_kv_BSR.dtype)
