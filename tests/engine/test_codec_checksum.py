"""The codec's checksums and its copies: zlib's CRC32 on every frame and tensor, states read and
written in place.

The oracle for every checksum is CPython's own ``zlib.crc32`` over bytes this file cuts out of
the frames by the byte layout of docs/wire-format.md, not the codec's checksum module.
"""

from __future__ import annotations

import struct
import zlib

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.checksum import crc32, crc32_combine
from prfaas_jax.engine.codec.layout import (
    StateBuffers,
    canonical_arrays,
    canonical_tensors,
    state_from_arrays,
    wire_view,
)

PRESETS = ("tiny", "tiny-gdn", "tiny-lightning", "tiny-swa")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.binary(max_size=5000))
def test_the_checksum_is_zlibs(a: bytes, b: bytes) -> None:
    assert crc32(a) == zlib.crc32(a)
    assert crc32_combine(crc32(a), crc32(b), len(b)) == zlib.crc32(a + b)


def _random_state(name: str, length: int, seed: int):
    cfg = load_model_config(name)
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in canonical_tensors(cfg, length):
        raw = rng.integers(0, 256, spec.nbytes, np.uint8)
        arrays.append((spec, raw.view(jax.numpy.dtype(spec.dtype)).reshape(spec.shape)))
    return cfg, arrays, state_from_arrays(cfg, length, arrays, length + 5)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("frame_bytes", [700, 1000, 2**22])
def test_every_frame_and_tensor_crc_is_zlibs(name: str, frame_bytes: int) -> None:
    cfg, arrays, state = _random_state(name, 77, seed=frame_bytes)
    frames = list(codec.encode(state, cfg, max_frame_bytes=frame_bytes))
    head, data, trailer = frames[0], frames[1:-1], frames[-1]
    assert struct.unpack("<I", head[-4:])[0] == zlib.crc32(head[:-4])
    carried: dict[int, list[tuple[int, bytes]]] = {}
    for frame in data:  # magic, stream, tensor, offset, length; CRC over prefix + payload
        _, _, tid, offset, size = struct.unpack_from("<4sQIQI", frame)
        (stored,) = struct.unpack_from("<I", frame, 28)
        payload = frame[32:]
        assert len(payload) == size and stored == zlib.crc32(frame[:28] + payload)
        carried.setdefault(tid, []).append((offset, payload))
    count = struct.unpack_from("<I", trailer, 12)[0]
    crcs = struct.unpack_from(f"<{count}I", trailer, 16)
    assert struct.unpack("<I", trailer[-4:])[0] == zlib.crc32(trailer[:-4])
    for tid, (spec, array) in enumerate(arrays):
        parts = b"".join(payload for _, payload in sorted(carried.get(tid, [])))
        assert parts == array.astype(array.dtype.newbyteorder("<")).tobytes()
        assert crcs[tid] == zlib.crc32(parts), spec


def test_wire_view_is_the_array_itself_when_it_can_be() -> None:
    array = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    view = wire_view(array)
    assert np.shares_memory(np.frombuffer(view, np.uint8), array)
    assert bytes(view) == array.astype("<f4").tobytes()
    strided = array[:, ::2]  # not contiguous: copied, in C order
    assert bytes(wire_view(strided)) == np.ascontiguousarray(strided).astype("<f4").tobytes()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="host views of device buffers")
def test_a_batch_one_state_is_read_in_place() -> None:
    cfg, _, state = _random_state("tiny", 40, seed=1)
    _, arrays = canonical_arrays(state, cfg, 0)
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(state.layers)]
    assert all(any(np.shares_memory(a, leaf) for leaf in leaves) for _, a in arrays)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU adopts aligned host buffers")
@pytest.mark.parametrize("name", PRESETS)
def test_decoded_tensors_land_in_the_state_without_a_copy(name: str) -> None:
    cfg = load_model_config(name)
    buffers = StateBuffers(cfg, 30, capacity=50)
    for index in range(len(buffers.specs)):
        buffers.canonical(index)[...] = index + 1
    state = buffers.state()
    fields = {
        (layer, name): np.asarray(getattr(state.layers[layer], name))
        for layer, name in ((spec.layer, spec.name) for spec in buffers.specs)
    }
    for index, spec in enumerate(buffers.specs):
        field = fields[(spec.layer, spec.name)]
        if spec.kind.value != "swa":  # an SWA window is laid into its ring, a copy
            assert np.shares_memory(field, buffers.canonical(index)), spec
        if spec.token_axis and spec.kind.value != "swa":  # zeros beyond L, the rows before
            assert (field[0, :30] == index + 1).all() and not field[0, 30:].any()
        else:
            assert (field == index + 1).sum() == buffers.canonical(index).size


def test_state_from_arrays_refuses_missing_or_misshaped_tensors() -> None:
    cfg, arrays, _ = _random_state("tiny", 12, seed=2)
    with pytest.raises(ValueError, match="no array for layer 0"):
        state_from_arrays(cfg, 12, arrays[1:], 12)
    spec, array = arrays[-1]  # a growing cache: a single row must not broadcast over 12
    with pytest.raises(ValueError, match="given an array of shape"):
        state_from_arrays(cfg, 12, [*arrays[:-1], (spec, array[:1])], 12)
