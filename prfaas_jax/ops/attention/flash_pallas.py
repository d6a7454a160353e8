"""Flash attention for prefill as a Pallas kernel: ``FlashBlockSizes`` and ``flash_attention``
(same contract as ``attention``).

The FlashAttention-2 online softmax (``online_softmax``) over key blocks visited in order. Masks
come from positions exactly as in ``attention`` (filled slot, causal, optional window), so ring
buffers and continued prefills work unchanged; a key block that no query of the block sees is
skipped with ``lax.cond``. The running max starts at the head's sink logit, so the sink joins the
denominator as in ``attention`` and a row that sees nothing yields 0.

Grid (B, H, T / block_q), one program per query block of one head; GQA maps head h to key/value
group h // (H / H_kv) in the index map. Head dims are zero-padded to powers of two (MLA's expanded
q/k 192 -> 256, v 128), which changes no logit.
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
    heads_first,
    pad_axis,
    pow2_dim,
    resolve_interpret,
)


@dataclasses.dataclass(frozen=True, slots=True)
class FlashBlockSizes:
    """Tile sizes of ``flash_attention``.

    Attributes:
      block_q: query rows per program (fewer when T is shorter).
      block_k: key slots per step of a program's loop (fewer when S is shorter).

    Both must be powers of two (``ValueError`` otherwise); on TPUs ``block_k`` (a lane slice of
    the slot positions) must also be a multiple of 128 or cover all slots (checked at the call).
    Frozen and hashable: a jit static.
    """

    block_q: int
    block_k: int

    def __post_init__(self) -> None:
        check_block("block_q", self.block_q)
        check_block("block_k", self.block_k)

    @classmethod
    def get_default(cls, backend: Backend | None = None) -> FlashBlockSizes:
        """64 queries x 64 key slots for Triton, 128 x 128 for Mosaic (a whole lane tile of
        slot positions, the MXU's width) — ``backend`` defaults to ``target_backend()``."""
        size = 128 if (backend or target_backend()) is Backend.TPU else 64
        return cls(block_q=size, block_k=size)


def _flash_kernel(
    sink_ref,  # []        sink logit of this head, MASK when there is none (Mosaic: [H] in SMEM)
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
            return softmax_block(carry, dot_f32(q, k_ref[at, :], (1, 1)), mask, v_ref[at, :])

        return jax.lax.cond(jnp.max(mask.astype(jnp.int32)) > 0, update, lambda c: c, carry)

    init = (
        jnp.full((bq, 1), read_scalar(sink_ref, 1), jnp.float32),
        jnp.ones((bq, 1), jnp.float32),
        jnp.zeros((bq, Dv), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, S // block_k, body, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "window", "block_sizes", "interpret"))
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
    block_sizes: FlashBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Masked GQA through the flash kernel; same contract as ``attention``.

    ``block_sizes`` defaults to ``FlashBlockSizes.get_default()`` for the target backend;
    ``interpret=None`` interprets on CPU and compiles elsewhere.
    """
    B, T, H, Dk = q_BTHD.shape
    S, G, Dv = k_BSGD.shape[1], k_BSGD.shape[2], v_BSGV.shape[-1]
    if H % G or k_BSGD.shape[-1] != Dk or v_BSGV.shape[:3] != k_BSGD.shape[:3]:
        raise ValueError(f"q {q_BTHD.shape}, k {k_BSGD.shape}, v {v_BSGV.shape} do not fit GQA")
    backend, interpret = target_backend(), resolve_interpret(interpret)
    blocks = FlashBlockSizes.get_default(backend) if block_sizes is None else block_sizes
    per_group = H // G
    bq, bk = min(blocks.block_q, pow2_dim(T)), min(blocks.block_k, pow2_dim(S))
    T_pad, S_pad = -(-T // bq) * bq, -(-S // bk) * bk
    check_tile(backend, "block_q", bq, T_pad, lanes=False)
    check_tile(backend, "block_k", bk, S_pad, lanes=True)
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
            scalar_spec(backend, axis=1),
            pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, 1, S_pad), lambda b, h, i: (b, 0, 0)),
            pl.BlockSpec((None, None, bq, Dk_pad), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, S_pad, Dk_pad), lambda b, h, i: (b, h // per_group, 0, 0)),
            pl.BlockSpec((None, None, S_pad, Dv_pad), lambda b, h, i: (b, h // per_group, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bq, Dv_pad), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, H, T_pad, Dv_pad), v_BSGV.dtype),
        interpret=interpret,
        compiler_params=compiler_params(
            backend,
            interpret=interpret,
            grid_rank=3,
            num_warps=4 if Dk_pad <= 64 else 8,
            num_stages=2,
        ),
        name="flash_attention",
    )(sink_H, q_pos_BT1, kv_pos_B1S, q, k, v)
    return o.transpose(0, 2, 1, 3)[:, :T, :, :Dv]
