"""Decoded states live in `STATE_BLOCKS` (engine/host_memory.py): a state's large fields are
pooled blocks, which later decodes reuse once the state is gone and never while it is held;
a reused block's leftovers never show (a growing cache's rows past L, an SWA ring).

The oracle is the source state's canonical tensors (test_codec.py's `canonical`), and zeros
where the layout puts no token; the blocks are counted by the pool itself.
"""

from __future__ import annotations

import jax
import numpy as np
from test_codec import assert_bitwise_equal, canonical, model, random_state

from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.layout import _aligned, canonical_tensors
from prfaas_jax.engine.host_memory import POOLED_BYTES, STATE_BLOCKS

PRESET = "kimi-linear-48b"  # full size: its recurrent states are 2 MiB each
LENGTH = 48


def frames_of(seed: int) -> tuple[object, object, list[bytes]]:
    cfg = model(PRESET)
    state = random_state(cfg, [LENGTH], LENGTH, seed=seed)
    return cfg, state, list(codec.encode(state, cfg))


def pooled_sizes(cfg, length: int, capacity: int) -> list[int]:
    """The bytes of each of a decoded state's pooled fields: the fixed-size ones of ≥ 1 MiB and
    the growing caches whose ``capacity`` positions take ≥ 1 MiB."""
    sizes = [
        spec.nbytes // length * capacity if spec.token_axis else spec.nbytes
        for spec in canonical_tensors(cfg, length)
    ]
    return [nbytes for nbytes in sizes if nbytes >= POOLED_BYTES]


def let_go() -> None:
    """A JAX call: JAX lets go of the host buffers of the arrays that died since its last."""
    jax.device_put(np.zeros(1)).block_until_ready()


def test_later_decodes_reuse_a_dropped_states_blocks_and_never_a_kept_ones():
    cfg, kept_source, kept_frames = frames_of(seed=1)
    _, source, frames = frames_of(seed=2)
    expected = len(pooled_sizes(cfg, LENGTH, LENGTH))
    assert expected == 20  # by hand: 20 KDA layers, one 32×128×128 f32 state each
    taken = STATE_BLOCKS.taken
    kept = codec.decode(kept_frames, cfg)
    assert STATE_BLOCKS.taken - taken == expected
    reused = STATE_BLOCKS.reused
    for _ in range(4):
        decoded = codec.decode(frames, cfg)
        assert_bitwise_equal(canonical(decoded, cfg, 0), canonical(source, cfg, 0))
        del decoded
        let_go()
    assert STATE_BLOCKS.reused - reused >= 3 * expected  # every decode after the first
    assert_bitwise_equal(canonical(kept, cfg, 0), canonical(kept_source, cfg, 0))


def test_a_reused_block_shows_none_of_its_leftovers():
    cfg, source, frames = frames_of(seed=3)
    capacity = 4096  # an MLA cache of 4096 positions: 4.5 MiB, pooled; L = 48 of them written
    sizes = pooled_sizes(cfg, LENGTH, capacity)
    assert len(sizes) == 27  # by hand: 20 KDA states and 7 MLA caches of 4096 × 576 bf16
    dirty = [STATE_BLOCKS.take(nbytes) for nbytes in sizes]  # the blocks the decode gets next
    for block in dirty:
        block[:] = 0xFF
    del dirty, block
    reused = STATE_BLOCKS.reused
    decoded = codec.decode(frames, cfg, max_len=capacity)
    assert STATE_BLOCKS.reused - reused == len(sizes)
    assert_bitwise_equal(canonical(decoded, cfg, 0), canonical(source, cfg, 0))
    for kind, layer in zip(cfg.layers, decoded.layers, strict=True):
        if kind.has_growing_state:
            for leaf in jax.tree_util.tree_leaves(layer):
                assert not np.asarray(leaf)[0, LENGTH:].any()  # zeros past L, as ever
    # An SWA ring asks for zeros: a reused block is cleared for it.
    block = STATE_BLOCKS.take(3 * 2**20)
    block[:] = 0xFF
    address = block.ctypes.data
    del block
    ring = _aligned((1, 3 * 2**18), np.dtype(np.float32), zeros=True)
    assert ring.ctypes.data == address  # the dirty block itself
    assert not ring.any()
