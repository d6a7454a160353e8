"""What every Pallas kernel in ``ops`` shares: ``resolve_interpret``, ``pow2_dim``, ``check_block``
(the rule every block size obeys), ``pad_axis``, ``heads_first`` and ``dot_f32``; and what the
recurrent kernels (delta rule, Lightning) share: ``StateBlockSizes``, ``STATE_KERNEL_STATICS``,
``state_tiles``, ``padded_state``, ``state_block_spec`` and ``unpadded_outputs``.

Kernels are written once against ``jax.experimental.pallas`` and lowered by whichever backend runs
them: Triton on GPUs, Mosaic on TPUs, and the interpreter (the kernel body evaluated as ordinary
XLA ops inside a loop over the grid) on CPU; ``pallas_backend`` holds what differs between them.
The wrappers pad every tile dimension to a power of two (at least 16) because Triton's loads and
``tl.dot`` require it; zero padding is neutral for every op here and is sliced away on the way out.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from prfaas_jax.ops.pallas_backend import Backend, check_tile, target_backend

MIN_TILE = 16  # smallest M, N and K that Triton's tl.dot accepts
_HIGHEST = jax.lax.Precision.HIGHEST
_log = logging.getLogger("prfaas.kernels")
# The jit-static keywords of the recurrent kernels' entry points (delta_rule/lightning_pallas).
STATE_KERNEL_STATICS = ("scale", "output_final_state", "block_sizes", "interpret")


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means "interpret exactly when there is no accelerator" (CPU backend); that case
    is logged once per process, since an interpreted kernel is exact but far slower than the
    ``chunk`` path it replaces."""
    if interpret is not None:
        return bool(interpret)
    if jax.default_backend() != "cpu":
        return False
    _say_interpreted()
    return True


@functools.cache
def _say_interpreted() -> None:
    _log.warning("Pallas kernels run interpreted (no GPU or TPU): exact outputs, slow")


def pow2_dim(size: int, *, minimum: int = MIN_TILE) -> int:
    """The tile size that holds ``size``: the next power of two, at least ``minimum``."""
    return max(minimum, pl.next_power_of_2(size))


def check_block(name: str, size: int) -> None:
    """A block size must be a positive power of two (at least 16 to compile with Triton)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"{name} must be a positive power of two, got {size}")


def pad_axis(x: jax.Array, axis: int, size: int, value: float | int = 0) -> jax.Array:
    """Pads ``x`` at the end of ``axis`` to ``size`` with ``value``."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def heads_first(x_BTHD: jax.Array, seq_len: int, dim: int) -> jax.Array:
    """[B, T, H, D] -> fp32 [B, H, seq_len, dim], zero-padded.

    Head-major tiles make every block's last two dimensions (T, D) whole array dimensions, which
    is what Mosaic (TPU) requires; Triton would accept the strided [B, T, H, D] layout as well.
    """
    x = pad_axis(pad_axis(x_BTHD.astype(jnp.float32), 1, seq_len), 3, dim)
    return x.transpose(0, 2, 1, 3)


def dot_f32(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    """2-D matmul contracting ``a``'s axis ``contract[0]`` with ``b``'s axis ``contract[1]``."""
    # fp32 operands at HIGHEST lower to IEEE fp32 on Triton: TF32 would cost ~1e-3 relative.
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True, slots=True)
class StateBlockSizes:
    """Tile sizes of the recurrent kernels (``delta_rule_pallas``, ``lightning_pallas``).

    Attributes:
      chunk_size: tokens per chunk C; the state is carried from chunk to chunk.
      block_v: value columns of one head's state per program (V is split into such blocks).

    Both must be powers of two (``ValueError`` otherwise); on TPUs ``block_v`` must also be a
    multiple of 128 or cover V (checked at the call). Frozen and hashable: a jit static.
    """

    chunk_size: int
    block_v: int

    def __post_init__(self) -> None:
        check_block("chunk_size", self.chunk_size)
        check_block("block_v", self.block_v)

    @classmethod
    def get_default(cls, backend: Backend | None = None) -> StateBlockSizes:
        """C = 64 (the jnp chunk size); value columns per program: 64 for Triton (the state
        slice stays in registers), 128 for Mosaic (a whole lane tile) — ``backend`` defaults to
        ``target_backend()``."""
        block_v = 128 if (backend or target_backend()) is Backend.TPU else 64
        return cls(chunk_size=64, block_v=block_v)


def state_tiles(
    T: int, K: int, V: int, blocks: StateBlockSizes, backend: Backend
) -> tuple[int, int, int, int]:
    """``(T_pad, K_pad, bv, V_pad)`` of a recurrent kernel carrying a [K, V] state per head.

    T is padded to whole chunks, K to one tile, V to whole blocks of ``bv`` value columns: each
    program owns one such block of its head's state (the recurrences never mix value columns).
    ``bv`` is the last dim of the value, output and state blocks: ``backend``'s rule applies.
    """
    T_pad = -(-T // blocks.chunk_size) * blocks.chunk_size
    K_pad, bv = pow2_dim(K), min(blocks.block_v, pow2_dim(V))
    V_pad = -(-V // bv) * bv
    check_tile(backend, "block_v", bv, V_pad, lanes=True)
    return T_pad, K_pad, bv, V_pad


def padded_state(
    initial_state: jax.Array | None, shape: tuple[int, int, int, int], K_pad: int, V_pad: int
) -> jax.Array:
    """``initial_state`` [B, H, K, V] (= ``shape``) as fp32 [B, H, K_pad, V_pad], zero-padded.

    ``None`` means a fresh (zero) state; any other shape is a ``ValueError``.
    """
    if initial_state is None:
        return jnp.zeros((*shape[:2], K_pad, V_pad), jnp.float32)
    if initial_state.shape != shape:
        raise ValueError(f"initial_state has shape {initial_state.shape}, expected {shape}")
    return pad_axis(pad_axis(initial_state.astype(jnp.float32), 2, K_pad), 3, V_pad)


def state_block_spec(K_pad: int, bv: int) -> pl.BlockSpec:
    """Program (b, h, j) of a grid (B, H, V_pad / bv) owns state columns j·bv … of head h."""
    return pl.BlockSpec((None, None, K_pad, bv), lambda b, h, j: (b, h, 0, j))


def unpadded_outputs(
    o_BHTV: jax.Array, S_BHKV: jax.Array, T: int, K: int, V: int, *, output_final_state: bool
) -> tuple[jax.Array, jax.Array | None]:
    """The padded kernel outputs back in the op contract: o [B, T, H, V] and S [B, H, K, V]."""
    o_BTHV = o_BHTV.transpose(0, 2, 1, 3)[:, :T, :, :V]
    return o_BTHV, (S_BHKV[:, :, :K, :V] if output_final_state else None)
