"""The ``jnp`` forms of softmax attention: ``attention`` (masked grouped-query attention over a
positioned key buffer), its blocked path ``blocked_attention``, and ``mla_decode_absorbed`` (MLA
decode in the absorbed form, over the latent cache; ``mla_decode_absorbed_heads`` the same on its
weights laid out head-major).

    o[b,t,h] = Σ_s softmax_s( scale · q[b,t,h]·k[b,s,g(h)] + mask[b,t,s] ) · v[b,s,g(h)]

with ``g(h) = h // (H / H_kv)`` and ``mask`` = 0 where slot ``s`` is filled (``kv_pos ≥ 0``),
causal (``kv_pos ≤ q_pos``) and, with a window ``W``, recent (``q_pos − kv_pos < W``: the query
sees itself and the ``W − 1`` tokens before it); −∞ elsewhere. Because masks come from positions,
one function serves prefill over a fresh buffer, prefill that continues a cache, one-token decode,
and sliding-window ring buffers (whose slots hold positions out of order). Optional per-head
*sink* logits join the softmax denominator without contributing a value (attention sinks). A
query that sees no key gets 0.

Everything is computed in at least fp32 (ops/precision.py); the output takes ``v``'s dtype.

Prefill over more than ``BLOCK_LEN`` key slots takes a blocked path with the same result up to
rounding: blocks of ``BLOCK_LEN`` queries walk blocks of ``BLOCK_LEN`` slots with an online
softmax, skipping key blocks that no query of the block can see (a causal prefill computes half
of the ``T × S`` logits, a chunk of a long prompt none of the empty capacity after it), and never
hold more than one block of logits. One ``[T, S]`` pass at T = S = 8192 spent ~3 s of a 5 s MLA
prefill on 2 CPU cores, most of it in the mask and softmax passes over a 1 GB logit matrix
(bench/engine.py); blocked, ~0.8 s.

MLA (DeepSeek-V2/V3) with ``kv_b_proj`` split per head into ``W_UK[h]`` (latent → k_nope) and
``W_UV[h]`` (latent → v):

    q̃_h     = W_UK[h]ᵀ q_nope_h                                  (R)
    score_hs = scale · (q̃_h · c_kv_s + q_rope_h · k_rope_s)
    ctx_h    = Σ_s softmax_s(score_hs) · c_kv_s                   (R)
    o_h      = W_UV[h] ctx_h                                      (Dv)

This is multi-query attention with (R + Dr)-dim keys and R-dim values shared by every head, so
the cache stays ``c_kv ‖ k_rope`` and is never expanded per head. It equals the expanded form
(``attention`` over ``k = [W_UK c_kv ‖ k_rope]``, ``v = W_UV c_kv``) up to rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from prfaas_jax.ops.precision import compute_dtype

_HIGHEST = jax.lax.Precision.HIGHEST
BLOCK_LEN = 512  # queries and key slots per block of the blocked path


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
    if q_BTHD.shape[1] > 1 and k_BSGD.shape[1] > BLOCK_LEN:
        return blocked_attention(
            q_BTHD,
            k_BSGD,
            v_BSGV,
            q_pos=q_pos,
            kv_pos=kv_pos,
            scale=scale,
            window=window,
            sinks=sinks,
        )
    batch, seq_len, num_heads, _ = q_BTHD.shape
    num_groups = k_BSGD.shape[2]
    per_group = num_heads // num_groups
    f32 = compute_dtype(q_BTHD, k_BSGD, v_BSGV)
    # The queries of a group's heads stacked along one axis, (r, t): every product is a batched
    # matmul over (b, g), which XLA:CPU differentiates without the transposes a 5-D einsum
    # costs (the backward at 16 × 256 tokens: 54 → 10 ms with the stopped peak below).
    q = q_BTHD.astype(f32).reshape(batch, seq_len, num_groups, per_group, -1)
    q = q.transpose(0, 2, 3, 1, 4).reshape(batch, num_groups, per_group * seq_len, -1)
    logits = jnp.einsum("bgqd,bsgd->bgqs", q, k_BSGD.astype(f32), precision=_HIGHEST) * scale

    qp = q_pos[:, :, None]
    kp = kv_pos[:, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if window:
        visible &= qp - kp < window
    logits = jnp.where(jnp.tile(visible, (1, per_group, 1))[:, None], logits, -jnp.inf)

    if sinks is None:
        peak = jnp.max(logits, axis=-1, keepdims=True)
    else:
        sink = sinks.astype(f32).reshape(1, num_groups, per_group, 1, 1)
        sink = jnp.broadcast_to(sink, (1, num_groups, per_group, seq_len, 1))
        sink = sink.reshape(1, num_groups, per_group * seq_len, 1)
        peak = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    # The shift cancels in the ratio, so its gradient is zero: stopped, the backward skips the
    # max's. A query with nothing visible (only possible for padding rows) must not give NaN.
    peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    weights = jnp.exp(logits - peak)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - peak)
    probs = weights / jnp.maximum(denom, jnp.finfo(f32).tiny)
    out = jnp.einsum("bgqs,bsgv->bgqv", probs, v_BSGV.astype(f32), precision=_HIGHEST)
    out = out.reshape(batch, num_groups, per_group, seq_len, -1).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, seq_len, num_heads, -1).astype(v_BSGV.dtype)


def _blocks(x: jax.Array, block_len: int, fill: int | float = 0) -> jax.Array:
    """[B, N, ...] -> [ceil(N / block_len), B, block_len, ...], padded with ``fill``."""
    batch, size = x.shape[:2]
    num_blocks = -(-size // block_len)
    pad = [(0, 0), (0, num_blocks * block_len - size)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad, constant_values=fill)
    return jnp.moveaxis(x.reshape(batch, num_blocks, block_len, *x.shape[2:]), 1, 0)


# Jitted so that a model's many attention layers of one shape trace this once: the jaxpr is
# cached per (shapes, scale, window, block_len), and a traced caller inlines it.
@functools.partial(jax.jit, static_argnames=("scale", "window", "block_len"))
def blocked_attention(
    q_BTHD: jax.Array,
    k_BSGD: jax.Array,
    v_BSGV: jax.Array,
    *,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
    window: int = 0,
    sinks: jax.Array | None = None,
    block_len: int = BLOCK_LEN,
) -> jax.Array:
    """``attention`` by blocks of ``min(block_len, T)`` queries × ``block_len`` slots (online
    softmax).

    A key block is skipped for a query block when none of its filled positions is visible to
    any of the block's queries (for every row), which works for out-of-order ring slots too.
    Padded queries carry position −1 (they see nothing) and padded slots are empty. Blocks are
    laid out once, group-major, so each block's two matmuls read their operands as stored.
    """
    batch, seq_len, num_heads, _ = q_BTHD.shape
    num_groups = k_BSGD.shape[2]
    per_group = num_heads // num_groups
    q_len = min(block_len, seq_len)
    rows = per_group * q_len  # query rows per group and block: (head in group, position)
    f32 = compute_dtype(q_BTHD, k_BSGD, v_BSGV)
    q = q_BTHD.astype(f32).reshape(batch, seq_len, num_groups, per_group, -1)
    q_blocks = _blocks(q, q_len).transpose(0, 1, 3, 4, 2, 5)  # [NQ, B, G, R, C, D]
    q_blocks = q_blocks.reshape(*q_blocks.shape[:3], rows, -1)
    qp_blocks = _blocks(q_pos, q_len, -1)  # [NQ, B, C]
    k_blocks = _blocks(k_BSGD.astype(f32), block_len).transpose(0, 1, 3, 4, 2)  # [NK, B, G, D, C]
    v_blocks = _blocks(v_BSGV.astype(f32), block_len).transpose(0, 1, 3, 2, 4)  # [NK, B, G, C, V]
    kp_blocks = _blocks(kv_pos, block_len, -1)  # [NK, B, C]
    filled = kp_blocks >= 0
    first_kp = jnp.min(jnp.where(filled, kp_blocks, jnp.iinfo(jnp.int32).max), axis=-1)  # [NK, B]
    last_kp = jnp.max(jnp.where(filled, kp_blocks, -1), axis=-1)
    stats_shape = (batch, num_groups, rows)
    if sinks is None:  # running max −∞ and sum 0: no key seen yet
        m0, l0 = jnp.full(stats_shape, -jnp.inf, f32), jnp.zeros(stats_shape, f32)
    else:  # the sink is a logit with no value: it starts the running max and sum
        sink = jnp.repeat(sinks.astype(f32).reshape(1, num_groups, per_group), q_len, axis=-1)
        m0, l0 = jnp.broadcast_to(sink, stats_shape), jnp.ones(stats_shape, f32)
    acc0 = jnp.zeros((*stats_shape, v_BSGV.shape[-1]), f32)

    def query_block(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        q_BGTD, qp_BC = args
        last_qp = jnp.max(qp_BC, axis=-1)  # [B]
        first_qp = jnp.min(jnp.where(qp_BC >= 0, qp_BC, jnp.iinfo(jnp.int32).max), axis=-1)
        qp_BT = jnp.tile(qp_BC, (1, per_group))  # position of each query row

        def update(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, l, acc = carry
            logits = jnp.einsum("bgtd,bgds->bgts", q_BGTD, k_blocks[j], precision=_HIGHEST)
            qp, kp = qp_BT[:, None, :, None], kp_blocks[j][:, None, None, :]
            visible = (kp >= 0) & (kp <= qp)
            if window:
                visible &= qp - kp < window
            logits = jnp.where(visible, logits * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            # −∞ while a row has seen nothing: subtract 0 instead, so exp gives 0, not NaN.
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            weights = jnp.exp(logits - m_safe[..., None])
            rescale = jnp.exp(m - m_safe)
            l = l * rescale + jnp.sum(weights, axis=-1)
            acc = acc * rescale[..., None] + jnp.einsum(
                "bgts,bgsv->bgtv", weights, v_blocks[j], precision=_HIGHEST
            )
            return m_new, l, acc

        def key_block(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            seen = (first_kp[j] <= last_qp) & (last_kp[j] >= 0)
            if window:
                seen &= last_kp[j] > first_qp - window
            return jax.lax.cond(jnp.any(seen), update, lambda j, c: c, j, carry)

        _, l, acc = jax.lax.fori_loop(0, kp_blocks.shape[0], key_block, (m0, l0, acc0))
        return acc / jnp.maximum(l, jnp.finfo(f32).tiny)[..., None]  # [B, G, R·C, V]

    out = jax.lax.map(query_block, (q_blocks, qp_blocks))  # [NQ, B, G, R·C, V]
    out = out.reshape(*out.shape[:3], per_group, q_len, -1).transpose(1, 0, 4, 2, 3, 5)
    out = out.reshape(batch, -1, num_heads, v_BSGV.shape[-1])
    return out[:, :seq_len].astype(v_BSGV.dtype)


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

    ``w_uk`` and ``w_uv`` as ``kv_b`` holds them (``[R, H, ·]``); `mla_decode_absorbed_heads`
    with them laid out head-major."""
    return mla_decode_absorbed_heads(
        q_nope_BTHN,
        q_rope_BTHP,
        c_kv_BSR,
        k_rope_BSP,
        jnp.transpose(w_uk_RHN, (1, 0, 2)),
        jnp.transpose(w_uv_RHV, (1, 2, 0)),
        q_pos=q_pos,
        kv_pos=kv_pos,
        scale=scale,
    )


def mla_decode_absorbed_heads(
    q_nope_BTHN: jax.Array,
    q_rope_BTHP: jax.Array,
    c_kv_BSR: jax.Array,
    k_rope_BSP: jax.Array,
    w_uk_HRN: jax.Array,
    w_uv_HVR: jax.Array,
    *,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
) -> jax.Array:
    """`mla_decode_absorbed` on the absorbing weights laid out head-major, each contracted on
    its last axis as stored (``W_UK[h]`` as ``[R, N]``, ``W_UV[h]`` as ``[V, R]``).

    Masked like ``attention`` (filled and causal slots only). Written out rather than through
    ``attention``: the cache is the dots' *left* operand, ``[S, R]`` contracted on its last axis
    as stored, so XLA:CPU reads it in place instead of concatenating ``c_kv ‖ k_rope`` and
    transposing the whole cache every step (over 10x slower at 32 slots of 576 on 2 cores).
    The weights' layout is the one XLA:CPU's per-head dots take without copying them, so a
    decode engine that stores them so (model/decode_weights.py) pays no per-step transposes.
    """
    f32 = compute_dtype(q_nope_BTHN, c_kv_BSR)
    c_kv = c_kv_BSR.astype(f32)
    q_latent = jnp.einsum(
        "bthn,hrn->bthr", q_nope_BTHN.astype(f32), w_uk_HRN.astype(f32), precision=_HIGHEST
    )
    logits_BSTH = jnp.einsum("bsr,bthr->bsth", c_kv, q_latent, precision=_HIGHEST)
    logits_BSTH += jnp.einsum(
        "bsp,bthp->bsth", k_rope_BSP.astype(f32), q_rope_BTHP.astype(f32), precision=_HIGHEST
    )
    kp = kv_pos[:, :, None, None]
    visible = (kp >= 0) & (kp <= q_pos[:, None, :, None])
    logits_BSTH = jnp.where(visible, logits_BSTH * scale, -jnp.inf)
    peak = jnp.max(logits_BSTH, axis=1, keepdims=True)
    # A query with nothing visible (only possible for padding rows) must not produce NaN.
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(logits_BSTH - peak)
    denom = jnp.sum(weights, axis=1, keepdims=True)
    probs = weights / jnp.maximum(denom, jnp.finfo(f32).tiny)
    ctx = jnp.einsum("bsth,bsr->bthr", probs, c_kv, precision=_HIGHEST)
    out = jnp.einsum("bthr,hvr->bthv", ctx, w_uv_HVR.astype(f32), precision=_HIGHEST)
    return out.astype(c_kv_BSR.dtype)
