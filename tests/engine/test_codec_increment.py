"""Increments: a stream with ``base = K`` leaves out the first K positions of every growing cache
(MLA, GQA), which the receiver holds; with them it decodes to the whole state, bit for bit.

Oracles: the one-shot encoding of the same state (streamed increments are its frames), the
original state (decoding with the receiver's rows restores it), and the bytes per position of the
growing caches computed from the config by hand.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import assert_same_state, model, random_state
from test_codec_stream import working_state

from prfaas_jax.config import LayerKind, ModelConfig, dtype_nbytes
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.format import parse_data
from prfaas_jax.engine.codec.layout import KvPrefix, canonical_arrays
from prfaas_jax.model.state import ModelState, state_nbytes

FRAME = 700


def growing_row_bytes(cfg: ModelConfig) -> int:
    """Bytes one position adds to the growing caches, from the config's dimensions."""
    size = dtype_nbytes(cfg.dtype)
    total = 0
    for kind in cfg.layers:
        if kind is LayerKind.MLA:
            total += (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * size
        elif kind is LayerKind.GQA:
            att = cfg.attention
            total += att.num_kv_heads * (att.head_dim + att.value_dim) * size
    return total


def held(state: ModelState, cfg: ModelConfig, base: int) -> KvPrefix:
    """What a receiver that cached the first ``base`` positions holds of ``state``."""
    _, arrays = canonical_arrays(state, cfg, 0)
    rows = {
        (spec.layer, spec.name): np.array(array[:base])
        for spec, array in arrays
        if spec.kind.has_growing_state
    }
    return KvPrefix(base, rows)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from((("tiny", 61), ("tiny-gdn", 40), ("tiny-lightning", 33), ("tiny-swa", 45))),
    st.data(),
)
def test_a_streamed_increment_is_the_one_shot_one_and_decodes_to_the_state(picked, data) -> None:
    name, length = picked
    cfg = model(name)
    base = data.draw(st.integers(0, length), label="base")
    cuts = data.draw(st.lists(st.integers(0, length), max_size=5), label="cuts")
    full = random_state(cfg, [length], 72, seed=length + base)
    encoder = codec.StreamEncoder(cfg, length, max_frame_bytes=FRAME, stream_id=7, base=base)
    header = codec.inspect([encoder.header()])
    assert header.base == base
    early = []
    for seed, done in enumerate(sorted(set(cuts))):
        early += encoder.ready_frames(working_state(full, cfg, done, seed), done)
    streamed = [encoder.header(), *early, *encoder.finish(full)]
    one_shot = list(codec.encode(full, cfg, max_frame_bytes=FRAME, stream_id=7, base=base))
    assert sorted(streamed) == sorted(one_shot) and streamed[-1] == one_shot[-1]
    # Only the increment travels: the base's rows of every growing cache stay behind.
    expected = state_nbytes(cfg, length) - base * growing_row_bytes(cfg)
    assert codec.payload_nbytes(streamed) == header.payload_nbytes == expected
    for frame in streamed[1:-1]:
        part = parse_data(memoryview(frame), 1)
        entry = header.tensors[part.tensor_id]
        if entry.spec.kind.has_growing_state:
            assert part.offset >= base * entry.spec.unit_bytes
    out = codec.decode(streamed, cfg, max_len=72, base=held(full, cfg, base) if base else None)
    assert_same_state(out, codec.decode(list(codec.encode(full, cfg)), cfg, max_len=72))


def test_an_increment_needs_the_receivers_rows_of_its_base() -> None:
    cfg = model("tiny")
    full = random_state(cfg, [40], 64, seed=0)
    frames = list(codec.encode(full, cfg, max_frame_bytes=FRAME, base=16))
    with pytest.raises(codec.StateDecodeError, match="leaves out the first 16 positions"):
        codec.decode(frames, cfg)
    with pytest.raises(codec.StateDecodeError, match="receiver holds 32"):
        codec.decode(frames, cfg, base=held(full, cfg, 32))
    # A whole stream is refused by a receiver that expected an increment, too.
    whole = list(codec.encode(full, cfg, max_frame_bytes=FRAME))
    with pytest.raises(codec.StateDecodeError, match="first 0 positions"):
        codec.decode(whole, cfg, base=held(full, cfg, 16))
    short = held(full, cfg, 16)
    key = next(iter(short.rows))
    short.rows[key] = short.rows[key][:, :3]
    with pytest.raises(codec.StateDecodeError, match=f"layer {key[0]} {key[1]}"):
        codec.decode(frames, cfg, base=short)
    # The receiver's rows are not covered by the trailer: wrong rows decode (to the wrong
    # state) — which is why the decode worker only stitches rows of the prompt it was told.
    other = held(random_state(cfg, [40], 64, seed=1), cfg, 16)
    assert codec.decode(frames, cfg, base=other).lengths.tolist() == [40]


def test_a_base_beyond_the_state_is_refused() -> None:
    cfg = model("tiny")
    with pytest.raises(ValueError, match="base must be in"):
        codec.StreamEncoder(cfg, 10, base=11)
    frames = list(codec.encode(random_state(cfg, [10], 16, seed=0), cfg, base=4))
    header = bytearray(frames[0])
    at = bytes(header).index(b'"base":4') + len(b'"base":')

    def with_base_digit(digit: bytes) -> list[bytes]:
        """The header with its base rewritten, its checksum fixed (a hostile sender)."""
        header[at : at + 1] = digit
        header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")
        return [bytes(header)]

    assert codec.inspect(with_base_digit(b"9")).base == 9
    with pytest.raises(codec.StateDecodeError, match="base must be an integer in"):
        codec.inspect(with_base_digit(b"0"))  # a base is ≥ 1; none is written as no key
