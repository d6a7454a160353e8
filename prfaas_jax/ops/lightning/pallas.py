"""Lightning attention as a Pallas kernel (Lightning Attention-2 intra/inter blocks):
``lightning_pallas``.

Same contract as ``lightning_reference``. Lightning's log gate is the constant ``decay_h`` on
every real token and 0 on padding (t >= valid_len[b]), so the decay between two positions only
depends on how many real tokens lie between them. With n_i = min(i + 1, valid_len) real tokens up
to and including position i, per chunk of C tokens starting at c0 (n_first = n_{c0 - 1}):

    M[i, j] = exp(decay_h (n_i - n_j))  for j <= i, else 0
    O = (exp(decay_h (n_i - n_first)) Q) S + ((Q K^T) ⊙ M) V
    S <- exp(decay_h (n_last - n_first)) S + (exp(decay_h (n_last - n_j)) k_j)^T V

The exponents are an exact integer count times one log decay (<= 0): no prefix-sum rounding,
nothing to overflow. Padding keys are zeroed, so padding neither decays nor feeds the state.

Grid (B, H, V / block_v), C and block_v from ``StateBlockSizes``; each program walks its chunks
with ``lax.fori_loop`` and carries S [K, block_v]. ``decay_h`` and ``valid_len[b]`` reach the
kernel as 0-d blocks on Triton (scalar loads) and as whole arrays in SMEM on Mosaic
(``scalar_spec``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from prfaas_jax.ops.lightning.reference import prepare_lightning
from prfaas_jax.ops.pallas_backend import (
    compiler_params,
    read_scalar,
    scalar_spec,
    target_backend,
)
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


def _lightning_kernel(
    decay_ref,  # []  log decay of this head (Mosaic: [H] in SMEM)
    valid_ref,  # []  real tokens in this row (Mosaic: [B] in SMEM)
    q_ref,  # [T, K]   scaled queries
    k_ref,  # [T, K]
    v_ref,  # [T, bv]
    s0_ref,  # [K, bv]
    o_ref,  # [T, bv]
    s_ref,  # [K, bv]
    *,
    chunk_size: int,
):
    C = chunk_size
    T = q_ref.shape[0]
    decay, valid_len = read_scalar(decay_ref, 1), read_scalar(valid_ref, 0)
    rows = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)

    def count(pos):  # real tokens at positions <= pos, as an exact fp32 integer
        return jnp.minimum(pos + 1, valid_len).astype(jnp.float32)

    def chunk_body(n, S_KV):
        start = n * C
        q_CK = q_ref[pl.ds(start, C), :]
        k_CK = jnp.where(start + rows < valid_len, k_ref[pl.ds(start, C), :], 0.0)
        v_CV = v_ref[pl.ds(start, C), :]
        n_C1, n_1C = count(start + rows), count(start + cols)
        n_first, n_last = count(start - 1), count(start + C - 1)
        causal = rows >= cols
        # The inner where keeps exp's argument <= 0 above the diagonal too: no inf to mask.
        M_CC = jnp.where(causal, jnp.exp(decay * jnp.where(causal, n_C1 - n_1C, 0.0)), 0.0)
        A_CC = dot_f32(q_CK, k_CK, contract=(1, 1)) * M_CC
        o_CV = dot_f32(q_CK * jnp.exp(decay * (n_C1 - n_first)), S_KV) + dot_f32(A_CC, v_CV)
        o_ref[pl.ds(start, C), :] = o_CV.astype(o_ref.dtype)
        k_out_CK = k_CK * jnp.exp(decay * (n_last - n_C1))
        S_KV = jnp.exp(decay * (n_last - n_first)) * S_KV
        return S_KV + dot_f32(k_out_CK, v_CV, contract=(0, 0))

    S_KV = jax.lax.fori_loop(0, T // C, chunk_body, s0_ref[...].astype(jnp.float32))
    s_ref[...] = S_KV.astype(s_ref.dtype)


@functools.partial(jax.jit, static_argnames=STATE_KERNEL_STATICS)
def lightning_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    decay: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    valid_len: jax.Array | None = None,
    block_sizes: StateBlockSizes | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Lightning through the Pallas kernel; same contract as ``lightning_reference``.

    ``block_sizes`` defaults to ``StateBlockSizes.get_default()`` for the target backend;
    ``interpret=None`` interprets on CPU and compiles elsewhere.
    """
    backend, interpret = target_backend(), resolve_interpret(interpret)
    blocks = StateBlockSizes.get_default(backend) if block_sizes is None else block_sizes
    q_BTHK, k_BTHK, v_BTHV, decay_H, _ = prepare_lightning(q, k, v, decay, scale, valid_len)
    B, T, H, K = q_BTHK.shape
    V = v.shape[-1]
    T_pad, K_pad, bv, V_pad = state_tiles(T, K, V, blocks, backend)
    lengths_B = jnp.full((B,), T, jnp.int32)
    if valid_len is not None:
        lengths_B = jnp.minimum(jnp.asarray(valid_len, jnp.int32).reshape(B), T)
    S0 = padded_state(initial_state, (B, H, K, V), K_pad, V_pad)

    def seq_tile(width: int, split_v: bool) -> pl.BlockSpec:
        return pl.BlockSpec(
            (None, None, T_pad, width), lambda b, h, j: (b, h, 0, j if split_v else 0)
        )

    state_spec = state_block_spec(K_pad, bv)
    o, S = pl.pallas_call(
        functools.partial(_lightning_kernel, chunk_size=blocks.chunk_size),
        grid=(B, H, V_pad // bv),
        in_specs=[
            scalar_spec(backend, axis=1),
            scalar_spec(backend, axis=0),
            seq_tile(K_pad, False),
            seq_tile(K_pad, False),
            seq_tile(bv, True),
            state_spec,
        ],
        out_specs=[seq_tile(bv, True), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((B, H, T_pad, V_pad), v.dtype),
            jax.ShapeDtypeStruct((B, H, K_pad, V_pad), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=compiler_params(
            backend, interpret=interpret, grid_rank=3, num_warps=4, num_stages=1
        ),
        name="lightning_chunk",
    )(
        decay_H,
        lengths_B,
        heads_first(q_BTHK, T_pad, K_pad),
        heads_first(k_BTHK, T_pad, K_pad),
        heads_first(v_BTHV, T_pad, V_pad),
        S0,
    )
    return unpadded_outputs(o, S, T, K, V, output_final_state=output_final_state)
