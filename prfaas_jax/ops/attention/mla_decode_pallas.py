"""Absorbed MLA decode as a Pallas kernel: ``MlaDecodeBlockSizes`` and ``mla_decode_pallas``
(same contract as ``mla_decode_absorbed``).

Multi-query attention of all T x H query rows of one sequence against keys [c_kv ‖ k_rope] and
values c_kv (two dots per block, no concatenation), with the online softmax of
``online_softmax``. Grid (B, splits): each sequence's filled length bounds its own loop, so a
batch of slots with different lengths costs what each slot holds, and ``num_splits > 1`` splits
long caches across programs (flash-decoding), merged afterwards by log-sum-exp. Absorbing W_UK
into the queries and W_UV into the output are small matmuls left to XLA around the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from prfaas_jax.ops.attention.online_softmax import MASK, softmax_block
from prfaas_jax.ops.pallas_backend import (
    Backend,
    check_tile,
    compiler_params,
    read_scalar,
    scalar_spec,
    target_backend,
)
from prfaas_jax.ops.pallas_launch import (
    check_block,
    dot_f32,
    pad_axis,
    pow2_dim,
    resolve_interpret,
)

_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True, slots=True)
class MlaDecodeBlockSizes:
    """How ``mla_decode_pallas`` tiles the latent cache.

    Attributes:
      block_k: cache slots per step of a program's loop (fewer when a split is shorter); a
        power of two, and on TPUs (a lane slice of the slot positions) a multiple of 128 or the
        whole cache (checked at the call).
      num_splits: programs per sequence, each over its own share of the slots (flash-decoding);
        at least 1.

    Anything else is a ``ValueError``. Frozen and hashable: a jit static.
    """

    block_k: int
    num_splits: int

    def __post_init__(self) -> None:
        check_block("block_k", self.block_k)
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be positive, got {self.num_splits}")

    @classmethod
    def get_default(cls, backend: Backend | None = None) -> MlaDecodeBlockSizes:
        """One program per sequence, 32 slots per step for Triton (the [M, 512] accumulator
        and a [32, 512] block stay in registers), 128 for Mosaic (a whole lane tile of slot
        positions) — ``backend`` defaults to ``target_backend()``."""
        block_k = 128 if (backend or target_backend()) is Backend.TPU else 32
        return cls(block_k=block_k, num_splits=1)


def _mla_decode_kernel(
    kv_len_ref,  # []         filled slots of this sequence, all empty past it (Mosaic: [B], SMEM)
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
    stop = jnp.minimum(start + split_len, read_scalar(kv_len_ref, 0))
    num_blocks = (jnp.maximum(stop - start, 0) + block_k - 1) // block_k

    def body(n, carry):
        at = pl.ds(start + n * block_k, block_k)
        kv_pos = kv_pos_ref[:, at]
        c_kv = c_kv_ref[at, :]
        logits = dot_f32(q_lat, c_kv, (1, 1)) + dot_f32(q_rope, k_rope_ref[at, :], (1, 1))
        return softmax_block(carry, logits, (kv_pos >= 0) & (kv_pos <= q_pos), c_kv)

    init = (
        jnp.full((M, 1), MASK, jnp.float32),
        jnp.ones((M, 1), jnp.float32),
        jnp.zeros((M, R), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = acc / l
    lse_ref[...] = m + jnp.log(l)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
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
    block_sizes: MlaDecodeBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Absorbed MLA through the kernel; same contract as ``mla_decode_absorbed``.

    ``block_sizes`` defaults to ``MlaDecodeBlockSizes.get_default()`` for the target backend;
    ``interpret=None`` interprets on CPU and compiles elsewhere.
    """
    backend, interpret = target_backend(), resolve_interpret(interpret)
    blocks = MlaDecodeBlockSizes.get_default(backend) if block_sizes is None else block_sizes
    num_splits = blocks.num_splits
    B, T, H, _ = q_nope_BTHN.shape
    S, R = c_kv_BSR.shape[1:]
    P = k_rope_BSP.shape[-1]
    f32 = jnp.float32
    q_lat = jnp.einsum(
        "bthn,rhn->bthr", q_nope_BTHN.astype(f32), w_uk_RHN.astype(f32), precision=_HIGHEST
    )
    M, M_pad, R_pad, P_pad = T * H, pow2_dim(T * H), pow2_dim(R), pow2_dim(P)
    bk = min(blocks.block_k, pow2_dim(-(-S // num_splits)))
    split_len = -(-S // (bk * num_splits)) * bk
    S_pad = split_len * num_splits
    check_tile(backend, "block_k", bk, S_pad, lanes=True)

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
            scalar_spec(backend, axis=0),
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
        interpret=interpret,
        compiler_params=compiler_params(
            backend, interpret=interpret, grid_rank=2, num_warps=8, num_stages=2
        ),
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
