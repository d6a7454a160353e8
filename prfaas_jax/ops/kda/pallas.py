"""Chunked gated delta rule as one Pallas kernel: ``kda_pallas`` and ``delta_rule_pallas``.

Same contract and chunk algebra as ``prfaas_jax.ops.kda.chunk`` (WY / UT transform, state S in
K x V carried from chunk to chunk), arranged for a kernel. Per chunk of C tokens, with per-channel
decay factors a_s = exp(g_s) <= 1, one pass over the rows i = 0 .. C-1 keeps

    P_i[j]  = prod_{j<s<=i} a_s                  (j <= i; zero above)  decay from key j to query i
    A[i, j] = sum_d q_i[d] k_j[d] P_i[j, d]      (j <= i)
    L[i, j] = beta_i sum_d k_i[d] k_j[d] P_i[j, d]   (j < i)
    W_i = beta_i exp(G_i) k_i - sum_j L[i, j] W_j,    U_i = beta_i v_i - sum_j L[i, j] U_j

(the last line is forward substitution for (I + L) [W | U] = Diag(beta) [exp(G) K | V]); the
running product exp(G_i) and, after the last row, P_{C-1}[j] = exp(G_last - G_j) fall out of the
same pass. Three matmuls finish the chunk:

    V' = U - W S,    O = (exp(G) Q) S + A V',    S <- exp(G_last) S + (exp(G_last - G_j) k_j)^T V'

NaN safety (research/models.md §A3): every decay is a product of factors a_s <= 1, so gates of
-2000 underflow to 0 and nothing can overflow; there is no exp(-G_j) and no difference of prefix
sums, and a product of C factors is accurate to about C ulps.

Grid (B, HV, V / block_v): the delta rule never mixes value columns, so each program owns a
column slice of one head's state, walks its chunks with ``lax.fori_loop`` and carries S
[K, block_v] in registers (Triton) or VMEM (Mosaic). GVA needs no copies: value head h reads
q/k head h // (HV / H) through the index map. GDN runs the same kernel with a gate tile of
width 1, which broadcasts over the key channels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from prfaas_jax.ops.kda.reference import check_gate_shapes
from prfaas_jax.ops.pallas_launch import (
    STATE_KERNEL_STATICS,
    check_block,
    compiler_params,
    dot_f32,
    heads_first,
    padded_state,
    resolve_interpret,
    state_block_spec,
    state_tiles,
    unpadded_outputs,
)


def _delta_rule_kernel(
    q_ref,  # [T, K]   scaled queries of this head's q/k head
    k_ref,  # [T, K]
    v_ref,  # [T, bv]  this program's value columns
    g_ref,  # [T, Dg]  log decay, Dg = K (KDA) or 1 (GDN)
    beta_ref,  # [T, 1]
    s0_ref,  # [K, bv]  initial state slice
    o_ref,  # [T, bv]
    s_ref,  # [K, bv]  final state slice
    *,
    chunk_size: int,
):
    C = chunk_size
    T, K = k_ref.shape
    bv, Dg = v_ref.shape[-1], g_ref.shape[-1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)

    def chunk_body(n, S_KV):
        start = n * C
        k_CK = k_ref[pl.ds(start, C), :]

        def row_body(i, carry):
            P_CD, decay_1D, W_CK, U_CV, At_CC, qe_CK = carry
            at = pl.ds(start + i, 1)
            q_1K, k_1K, v_1V = q_ref[at, :], k_ref[at, :], v_ref[at, :]
            a_1D, beta_11 = jnp.exp(g_ref[at, :]), beta_ref[at, :]
            P_CD = jnp.where(rows == i, 1.0, P_CD * a_1D)  # rows j > i stay 0
            decay_1D = decay_1D * a_1D  # exp(G_i)
            kP_CK = k_CK * P_CD
            a_qk_C1 = jnp.sum(kP_CK * q_1K, axis=1, keepdims=True)
            l_C1 = jnp.where(rows < i, beta_11 * jnp.sum(kP_CK * k_1K, axis=1, keepdims=True), 0.0)
            w_1K = beta_11 * decay_1D * k_1K - jnp.sum(l_C1 * W_CK, axis=0, keepdims=True)
            u_1V = beta_11 * v_1V - jnp.sum(l_C1 * U_CV, axis=0, keepdims=True)
            W_CK = jnp.where(rows == i, w_1K, W_CK)
            U_CV = jnp.where(rows == i, u_1V, U_CV)
            At_CC = jnp.where(cols == i, a_qk_C1, At_CC)  # A transposed: column i is row i of A
            qe_CK = jnp.where(rows == i, q_1K * decay_1D, qe_CK)
            return P_CD, decay_1D, W_CK, U_CV, At_CC, qe_CK

        f32 = jnp.float32
        init = (
            jnp.zeros((C, Dg), f32),
            jnp.ones((1, Dg), f32),
            jnp.zeros((C, K), f32),
            jnp.zeros((C, bv), f32),
            jnp.zeros((C, C), f32),
            jnp.zeros((C, K), f32),
        )
        P_CD, decay_1D, W_CK, U_CV, At_CC, qe_CK = jax.lax.fori_loop(0, C, row_body, init)
        v_new_CV = U_CV - dot_f32(W_CK, S_KV)
        o_CV = dot_f32(qe_CK, S_KV) + dot_f32(At_CC, v_new_CV, contract=(0, 0))
        o_ref[pl.ds(start, C), :] = o_CV.astype(o_ref.dtype)
        # P_{C-1}[j] = exp(G_last - G_j); decay_1D = exp(G_last), as a column to scale S's rows.
        decay_last_D1 = decay_1D.reshape(Dg, 1)
        return decay_last_D1 * S_KV + dot_f32(k_CK * P_CD, v_new_CV, contract=(0, 0))

    S_KV = jax.lax.fori_loop(0, T // C, chunk_body, s0_ref[...].astype(jnp.float32))
    s_ref[...] = S_KV.astype(s_ref.dtype)


def delta_rule_pallas(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHV: jax.Array,
    g_BTHD: jax.Array,
    beta_BTH: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    block_v: int = 64,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated delta rule through the kernel; g's last axis is K (per channel) or 1 (per head)."""
    B, T, H, K = q_BTHK.shape
    HV, V = v_BTHV.shape[2:]
    if k_BTHK.shape != q_BTHK.shape or HV % H or g_BTHD.shape[-1] not in (1, K):
        raise ValueError(f"q {q_BTHK.shape}, k {k_BTHK.shape}, v {v_BTHV.shape} do not fit GVA")
    check_block("chunk_size", chunk_size)
    check_block("block_v", block_v)
    group = HV // H
    scale = K**-0.5 if scale is None else scale
    T_pad, K_pad, bv, V_pad = state_tiles(T, K, V, chunk_size=chunk_size, block_v=block_v)
    Dg = 1 if g_BTHD.shape[-1] == 1 else K_pad
    # Zero padding is neutral: g = 0 keeps the state, beta = 0 and k = 0 add nothing to it.
    q = heads_first(q_BTHK.astype(jnp.float32) * scale, T_pad, K_pad)
    k = heads_first(k_BTHK, T_pad, K_pad)
    v = heads_first(v_BTHV, T_pad, V_pad)
    g = heads_first(g_BTHD, T_pad, Dg)
    beta = heads_first(beta_BTH[..., None], T_pad, 1)
    S0 = padded_state(initial_state, (B, HV, K, V), K_pad, V_pad)

    def tile(width: int, per_value_head: bool, split_v: bool) -> pl.BlockSpec:
        def index(b, h, j):
            return (b, h if per_value_head else h // group, 0, j if split_v else 0)

        return pl.BlockSpec((None, None, T_pad, width), index)

    state_spec = state_block_spec(K_pad, bv)
    o, S = pl.pallas_call(
        functools.partial(_delta_rule_kernel, chunk_size=chunk_size),
        grid=(B, HV, V_pad // bv),
        in_specs=[
            tile(K_pad, False, False),
            tile(K_pad, False, False),
            tile(bv, True, True),
            tile(Dg, True, False),
            tile(1, True, False),
            state_spec,
        ],
        out_specs=[tile(bv, True, True), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((B, HV, T_pad, V_pad), v_BTHV.dtype),
            jax.ShapeDtypeStruct((B, HV, K_pad, V_pad), jnp.float32),
        ],
        interpret=resolve_interpret(interpret),
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        name="delta_rule_chunk",
    )(q, k, v, g, beta, S0)
    return unpadded_outputs(o, S, T, K, V, output_final_state=output_final_state)


@functools.partial(jax.jit, static_argnames=STATE_KERNEL_STATICS)
def kda_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    block_v: int = 64,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """KDA through the Pallas kernel; same contract as ``kda_reference``.

    ``interpret=None`` interprets on CPU and compiles elsewhere; ``chunk_size`` and ``block_v``
    must be powers of two (at least 16 to compile with Triton).
    """
    check_gate_shapes(q, v, g, beta, per_channel=True)
    return delta_rule_pallas(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        block_v=block_v,
        interpret=interpret,
    )
