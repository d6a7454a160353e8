"""Chunked gated delta rule as one Pallas kernel: ``delta_rule_pallas``, ``kda_pallas`` and
``gdn_pallas``.

Same contract and chunk algebra as ``prfaas_jax.ops.delta_rule.chunk`` (WY / UT transform, state
S in K x V carried from chunk to chunk), arranged for a kernel. Per chunk of C tokens, with
per-channel decay factors a_s = exp(g_s) <= 1, one pass over the rows i = 0 .. C-1 keeps

    P_i[j]  = prod_{j<s<=i} a_s                  (j <= i; zero above)  decay from key j to query i
    A[i, j] = sum_d q_i[d] k_j[d] P_i[j, d]      (j <= i)
    L[i, j] = beta_i sum_d k_i[d] k_j[d] P_i[j, d]   (j < i)
    W_i = beta_i exp(G_i) k_i - sum_j L[i, j] W_j,    U_i = beta_i v_i - sum_j L[i, j] U_j

(the last line is forward substitution for (I + L) [W | U] = Diag(beta) [exp(G) K | V]); the
running product exp(G_i) and, after the last row, P_{C-1}[j] = exp(G_last - G_j) fall out of the
same pass. Three matmuls finish the chunk:

    V' = U - W S,    O = (exp(G) Q) S + A V',    S <- exp(G_last) S + (exp(G_last - G_j) k_j)^T V'

NaN safety: every decay is a product of factors a_s <= 1, so gates of -2000 underflow to 0 and
nothing can overflow; there is no exp(-G_j) and no difference of prefix sums, and a product of C
factors is accurate to about C ulps.

Grid (B, HV, V / block_v), C and block_v from ``StateBlockSizes``: the delta rule never mixes
value columns, so each program owns a column slice of one head's state, walks its chunks with
``lax.fori_loop`` and carries S [K, block_v] in registers (Triton) or VMEM (Mosaic). GVA needs no
copies: value head h reads q/k head h // (HV / H) through the index map. GDN runs the same kernel
with a gate tile of width 1: each row's decay factor exp(g_t) broadcasts over the key channels
and P_i shrinks to a [C, 1] column.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from prfaas_jax.ops.delta_rule.reference import check_shapes, gate_form
from prfaas_jax.ops.pallas_backend import compiler_params, target_backend
from prfaas_jax.ops.pallas_launch import (
    STATE_KERNEL_STATICS,
    StateBlockSizes,
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


@functools.partial(jax.jit, static_argnames=STATE_KERNEL_STATICS)
def delta_rule_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    block_sizes: StateBlockSizes | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated delta rule through the kernel; same contract as ``delta_rule_reference``.

    ``block_sizes`` defaults to ``StateBlockSizes.get_default()`` for the target backend;
    ``interpret=None`` interprets on CPU and compiles elsewhere.
    """
    check_shapes(q, k, v, g, beta)
    backend, interpret = target_backend(), resolve_interpret(interpret)
    blocks = StateBlockSizes.get_default(backend) if block_sizes is None else block_sizes
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    group = HV // H
    scale = K**-0.5 if scale is None else scale
    T_pad, K_pad, bv, V_pad = state_tiles(T, K, V, blocks, backend)
    Dg = 1 if g.shape[-1] == 1 else K_pad
    # Zero padding is neutral: g = 0 keeps the state, beta = 0 and k = 0 add nothing to it.
    q_BHTK = heads_first(q.astype(jnp.float32) * scale, T_pad, K_pad)
    k_BHTK = heads_first(k, T_pad, K_pad)
    v_BHTV = heads_first(v, T_pad, V_pad)
    g_BHTD = heads_first(g, T_pad, Dg)
    beta_BHT1 = heads_first(beta[..., None], T_pad, 1)
    S0 = padded_state(initial_state, (B, HV, K, V), K_pad, V_pad)

    def tile(width: int, per_value_head: bool, split_v: bool) -> pl.BlockSpec:
        def index(b, h, j):
            return (b, h if per_value_head else h // group, 0, j if split_v else 0)

        return pl.BlockSpec((None, None, T_pad, width), index)

    state_spec = state_block_spec(K_pad, bv)
    o, S = pl.pallas_call(
        functools.partial(_delta_rule_kernel, chunk_size=blocks.chunk_size),
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
            jax.ShapeDtypeStruct((B, HV, T_pad, V_pad), v.dtype),
            jax.ShapeDtypeStruct((B, HV, K_pad, V_pad), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params(
            backend, interpret=interpret, grid_rank=3, num_warps=4, num_stages=1
        ),
        name="delta_rule_chunk",
    )(q_BHTK, k_BHTK, v_BHTV, g_BHTD, beta_BHT1, S0)
    return unpadded_outputs(o, S, T, K, V, output_final_state=output_final_state)


kda_pallas = gate_form(delta_rule_pallas, per_channel=True)
gdn_pallas = gate_form(delta_rule_pallas, per_channel=False)
