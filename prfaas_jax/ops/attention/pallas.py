"""Softmax-attention Pallas kernels: ``flash_attention`` (prefill; same contract as ``attention``)
and ``mla_decode_pallas`` (absorbed MLA over the latent cache; same contract as
``mla_decode_absorbed``).

Both are flash attention (FlashAttention-2 online softmax): key blocks are visited in order while
each query row keeps a running max m, a running denominator l and an unnormalised accumulator,

    m' = max(m, max_s x_s),   l' = e^(m - m') l + sum_s e^(x_s - m'),
    acc' = e^(m - m') acc + e^(x - m') V

with x the masked logits of the block. Masks come from positions exactly as in ``attention``
(filled slot, causal, optional window), so ring buffers and continued prefills work unchanged.
The running max starts at the head's sink logit (or at a finite stand-in for -inf) with l = 1:
the sink joins the denominator as in ``attention``, and l >= 1 always, so a row that sees nothing
yields 0, never NaN. Blocks in which no query sees any key are skipped with ``lax.cond``.

``flash_attention``: grid (B, H, T / block_q), one program per query block of one head; GQA maps
head h to key/value group h // (H / H_kv) in the index map. Head dims are zero-padded to powers of
two (MLA's expanded q/k 192 -> 256, v 128), which changes no logit.

``mla_decode_pallas``: multi-query attention of all T x H query rows of one sequence against
keys [c_kv ‖ k_rope] and values c_kv (two dots per block, no concatenation). Grid (B, splits):
each sequence's filled length bounds its own loop, so a batch of slots with different lengths
costs what each slot holds, and ``num_splits > 1`` splits long caches across programs
(flash-decoding), merged afterwards by log-sum-exp. Absorbing W_UK into the queries and W_UV into
the output are small matmuls left to XLA around the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from prfaas_jax.ops.pallas_launch import (
    check_block,
    compiler_params,
    dot_f32,
    heads_first,
    pad_axis,
    pow2_dim,
    resolve_interpret,
)

# Finite stand-in for -inf: exp(MASK - m) underflows to 0 and MASK - MASK stays 0, never NaN.
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_HIGHEST = jax.lax.Precision.HIGHEST


def _softmax_block(carry, logits, mask, values):
    """One online-softmax step over a key block; ``values`` [bk, Dv]."""
    m, l, acc = carry
    logits = jnp.where(mask, logits, MASK)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
    l = correction * l + jnp.sum(p, axis=1, keepdims=True)
    return m_new, l, correction * acc + dot_f32(p, values)


def _flash_kernel(
    sink_ref,  # []        sink logit of this head (MASK when there is none)
    q_pos_ref,  # [bq, 1]   query positions (-1: padding)
    kv_pos_ref,  # [1, S]    slot positions (-1: empty)
    q_ref,  # [bq, Dk]  scaled queries
    k_ref,  # [S, Dk]
    v_ref,  # [S, Dv]
    o_ref,  # [bq, Dv]
    *,
    block_k: int,
    window: int,
):
    bq, S, Dv = q_ref.shape[0], k_ref.shape[0], v_ref.shape[1]
    q, q_pos = q_ref[...], q_pos_ref[...]

    def body(n, carry):
        at = pl.ds(n * block_k, block_k)
        kv_pos = kv_pos_ref[:, at]
        mask = (kv_pos >= 0) & (kv_pos <= q_pos)
        if window:
            mask &= q_pos - kv_pos < window

        def update(carry):
            return _softmax_block(carry, dot_f32(q, k_ref[at, :], (1, 1)), mask, v_ref[at, :])

        return jax.lax.cond(jnp.max(mask.astype(jnp.int32)) > 0, update, lambda c: c, carry)

    init = (
        jnp.full((bq, 1), sink_ref[()], jnp.float32),
        jnp.ones((bq, 1), jnp.float32),
        jnp.zeros((bq, Dv), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, S // block_k, body, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "window", "block_q", "block_k", "interpret"))
def flash_attention(
    q_BTHD: jax.Array,
    k_BSGD: jax.Array,
    v_BSGV: jax.Array,
    *,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    scale: float,
    window: int = 0,
    sinks: jax.Array | None = None,
    block_q: int = 64,
    block_k: int = 64,
    interpret: bool | None = None,
) -> jax.Array:
    """Masked GQA through the flash kernel; same contract as ``attention``."""
    B, T, H, Dk = q_BTHD.shape
    S, G, Dv = k_BSGD.shape[1], k_BSGD.shape[2], v_BSGV.shape[-1]
    if H % G or k_BSGD.shape[-1] != Dk or v_BSGV.shape[:3] != k_BSGD.shape[:3]:
        raise ValueError(f"q {q_BTHD.shape}, k {k_BSGD.shape}, v {v_BSGV.shape} do not fit GQA")
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    per_group = H // G
    bq, bk = min(block_q, pow2_dim(T)), min(block_k, pow2_dim(S))
    T_pad, S_pad = -(-T // bq) * bq, -(-S // bk) * bk
    Dk_pad, Dv_pad = pow2_dim(Dk), pow2_dim(Dv)
    q = heads_first(q_BTHD.astype(jnp.float32) * scale, T_pad, Dk_pad)
    k = heads_first(k_BSGD, S_pad, Dk_pad)
    v = heads_first(v_BSGV, S_pad, Dv_pad)
    q_pos_BT1 = pad_axis(q_pos.astype(jnp.int32), 1, T_pad, -1)[:, :, None]
    kv_pos_B1S = pad_axis(kv_pos.astype(jnp.int32), 1, S_pad, -1)[:, None, :]
    sink_H = jnp.full((H,), MASK, jnp.float32) if sinks is None else sinks.astype(jnp.float32)

    o = pl.pallas_call(
        functools.partial(_flash_kernel, block_k=bk, window=window),
        grid=(B, H, T_pad // bq),
        in_specs=[
            pl.BlockSpec((None,), lambda b, h, i: (h,)),
            pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, 1, S_pad), lambda b, h, i: (b, 0, 0)),
            pl.BlockSpec((None, None, bq, Dk_pad), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, S_pad, Dk_pad), lambda b, h, i: (b, h // per_group, 0, 0)),
            pl.BlockSpec((None, None, S_pad, Dv_pad), lambda b, h, i: (b, h // per_group, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bq, Dv_pad), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, H, T_pad, Dv_pad), v_BSGV.dtype),
        interpret=resolve_interpret(interpret),
        compiler_params=compiler_params(num_warps=4 if Dk_pad <= 64 else 8, num_stages=2),
        name="flash_attention",
    )(sink_H, q_pos_BT1, kv_pos_B1S, q, k, v)
    return o.transpose(0, 2, 1, 3)[:, :T, :, :Dv]


def _mla_decode_kernel(
    kv_len_ref,  # []         filled slots of this sequence (slots past it are all empty)
    q_pos_ref,  # [M, 1]     position of each query row (row = t * H + h)
    kv_pos_ref,  # [1, S]
    q_lat_ref,  # [M, R]     scaled, W_UK-absorbed queries
    q_rope_ref,  # [M, P]     scaled rope queries
    c_kv_ref,  # [S, R]     latent cache: keys (with k_rope) and values
    k_rope_ref,  # [S, P]
    o_ref,  # [M, R]     this split's normalised context
    lse_ref,  # [M, 1]     this split's log-sum-exp
    *,
    block_k: int,
    split_len: int,
):
    M, R = q_lat_ref.shape
    q_lat, q_rope, q_pos = q_lat_ref[...], q_rope_ref[...], q_pos_ref[...]
    start = pl.program_id(1) * split_len
    stop = jnp.minimum(start + split_len, kv_len_ref[()])
    num_blocks = (jnp.maximum(stop - start, 0) + block_k - 1) // block_k

    def body(n, carry):
        at = pl.ds(start + n * block_k, block_k)
        kv_pos = kv_pos_ref[:, at]
        c_kv = c_kv_ref[at, :]
        logits = dot_f32(q_lat, c_kv, (1, 1)) + dot_f32(q_rope, k_rope_ref[at, :], (1, 1))
        return _softmax_block(carry, logits, (kv_pos >= 0) & (kv_pos <= q_pos), c_kv)

    init = (
        jnp.full((M, 1), MASK, jnp.float32),
        jnp.ones((M, 1), jnp.float32),
        jnp.zeros((M, R), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = acc / l
    lse_ref[...] = m + jnp.log(l)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_splits", "interpret"))
def mla_decode_pallas(
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
    block_k: int = 32,
    num_splits: int = 1,
    interpret: bool | None = None,
) -> jax.Array:
    """Absorbed MLA through the kernel; same contract as ``mla_decode_absorbed``."""
    B, T, H, _ = q_nope_BTHN.shape
    S, R = c_kv_BSR.shape[1:]
    P = k_rope_BSP.shape[-1]
    check_block("block_k", block_k)
    if num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    f32 = jnp.float32
    q_lat = jnp.einsum(
        "bthn,rhn->bthr", q_nope_BTHN.astype(f32), w_uk_RHN.astype(f32), precision=_HIGHEST
    )
    M, M_pad, R_pad, P_pad = T * H, pow2_dim(T * H), pow2_dim(R), pow2_dim(P)
    bk = min(block_k, pow2_dim(-(-S // num_splits)))
    split_len = -(-S // (bk * num_splits)) * bk
    S_pad = split_len * num_splits

    def rows(x_BTHD: jax.Array, width: int) -> jax.Array:  # [B, T, H, D] -> [B, M_pad, width]
        x = (x_BTHD.astype(f32) * scale).reshape(B, M, -1)
        return pad_axis(pad_axis(x, 1, M_pad), 2, width)

    def slots(x_BSD: jax.Array, width: int) -> jax.Array:
        return pad_axis(pad_axis(x_BSD.astype(f32), 1, S_pad), 2, width)

    q_pos_rows = jnp.broadcast_to(q_pos.astype(jnp.int32)[:, :, None], (B, T, H)).reshape(B, M)
    kv_pos_B1S = pad_axis(kv_pos.astype(jnp.int32), 1, S_pad, -1)[:, None, :]
    kv_len_B = jnp.max(jnp.where(kv_pos >= 0, jnp.arange(1, S + 1), 0), axis=1).astype(jnp.int32)

    def per_row(*block: int | None) -> pl.BlockSpec:  # the whole of sequence b's array
        return pl.BlockSpec((None, *block), lambda b, j: (b, 0, 0))

    o, lse = pl.pallas_call(
        functools.partial(_mla_decode_kernel, block_k=bk, split_len=split_len),
        grid=(B, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, j: (b,)),
            per_row(M_pad, 1),
            per_row(1, S_pad),
            per_row(M_pad, R_pad),
            per_row(M_pad, P_pad),
            per_row(S_pad, R_pad),
            per_row(S_pad, P_pad),
        ],
        out_specs=[
            pl.BlockSpec((None, None, M_pad, R_pad), lambda b, j: (b, j, 0, 0)),
            pl.BlockSpec((None, None, M_pad, 1), lambda b, j: (b, j, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, num_splits, M_pad, R_pad), f32),
            jax.ShapeDtypeStruct((B, num_splits, M_pad, 1), f32),
        ],
        interpret=resolve_interpret(interpret),
        compiler_params=compiler_params(num_warps=8, num_stages=2),
        name="mla_decode",
    )(
        kv_len_B,
        pad_axis(q_pos_rows, 1, M_pad, -1)[:, :, None],
        kv_pos_B1S,
        rows(q_lat, R_pad),
        rows(q_rope_BTHP, P_pad),
        slots(c_kv_BSR, R_pad),
        slots(k_rope_BSP, P_pad),
    )
    # Merge the splits: each holds softmax over its own slots; weight it by its share of mass.
    weights = jnp.exp(lse - jnp.max(lse, axis=1, keepdims=True))
    ctx = jnp.sum(weights * o, axis=1) / jnp.sum(weights, axis=1)
    ctx_BTHR = ctx[:, :M, :R].reshape(B, T, H, R)
    out = jnp.einsum("bthr,rhv->bthv", ctx_BTHR, w_uv_RHV.astype(f32), precision=_HIGHEST)
    return out.astype(c_kv_BSR.dtype)
