"""Wire precision (engine/codec/precision.py): a state sent in bf16, fp8 or int8 with scales.

Oracles: the native encoding (a native setting is byte for byte today's stream), bfloat16
rounding done on the bits in NumPy, int8 quantisation recomputed in float64, fp8's error bound
from its 3 mantissa bits, the bytes of each encoding counted from the config by hand, and the
one-shot lossy stream (streamed and incremental lossy streams are its frames).
"""

from __future__ import annotations

import json
import struct
import zlib

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import model, random_state
from test_codec_increment import held
from test_codec_stream import working_state

from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.format import (
    HEADER_FIXED_SIZE,
    StateTrailer,
    pack_data,
    pack_header,
    pack_trailer,
    parse_data,
)
from prfaas_jax.engine.codec.layout import canonical_arrays
from prfaas_jax.engine.codec.precision import WirePrecision, max_scale
from prfaas_jax.model.state import ModelState
from prfaas_jax.state_bytes import layer_token_nbytes, state_nbytes

PRESETS = ("tiny", "tiny-gdn", "tiny-lightning", "tiny-swa")
FRAME = 900
LOSSY = ("bf16", "fp8_e4m3", "int8")


def arrays(state, cfg):
    return canonical_arrays(state, cfg, 0)[1]


def sent(name: str, length: int, wire: str, *, seed: int = 0, base: int = 0):
    cfg = model(name)
    state = random_state(cfg, [length], length + 3, seed)
    frames = list(
        codec.encode(
            state,
            cfg,
            max_frame_bytes=FRAME,
            stream_id=7,
            precision=WirePrecision.parse(wire),
            base=base,
        )
    )
    return cfg, state, frames


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 → float32, rounding to nearest even on the bit pattern."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


# --- what each encoding gives back ---------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_native_is_todays_stream_byte_for_byte(name):
    cfg, state, frames = sent(name, 21, "native")
    assert frames == list(codec.encode(state, cfg, max_frame_bytes=FRAME, stream_id=7))


@pytest.mark.parametrize("name", PRESETS)
def test_bf16_rounds_each_float32_element_to_nearest_even(name):
    cfg, state, frames = sent(name, 21, "bf16")
    for (spec, a), (_, b) in zip(
        arrays(state, cfg), arrays(codec.decode(frames, cfg), cfg), strict=True
    ):
        assert b.dtype == a.dtype and b.shape == a.shape
        expected = bf16_bits(a) if spec.dtype == "float32" else a  # 16-bit tensors as they are
        assert np.array_equal(np.asarray(b, np.float32), np.asarray(expected, np.float32))


def vectors(name: str, wire: str):
    """Per tensor: its spec, and the source and decoded values as float64 vectors along the
    last axis."""
    cfg, state, frames = sent(name, 21, wire)
    decoded = arrays(codec.decode(frames, cfg), cfg)
    for (spec, a), (_, b) in zip(arrays(state, cfg), decoded, strict=True):
        x = np.asarray(a, np.float64).reshape(-1, spec.shape[-1])
        yield spec, x, np.asarray(b, np.float64).reshape(x.shape)


@pytest.mark.parametrize("name", PRESETS)
def test_int8_is_the_float64_quantisation_per_last_axis_vector(name):
    for spec, x, got in vectors(name, "int8"):
        scale = np.abs(x).max(axis=1, keepdims=True) / 127
        q = x / np.where(scale > 0, scale, 1)
        expected = np.round(q) * scale  # ties to even
        # float32 arithmetic: q·scale within a few ulps, and a q within 1e-4 of a tie may
        # round either way.
        near_tie = np.abs(np.abs(q - np.floor(q)) - 0.5) < 1e-4
        tolerance = np.where(near_tie, scale * (1 + 1e-5), 2e-5 * scale) + 1e-30
        assert np.all(np.abs(got - expected) <= tolerance), spec
        assert np.all(np.abs(got - x) <= scale * (0.5 + 1e-6)), spec


@pytest.mark.parametrize("name", PRESETS)
def test_fp8_keeps_each_element_within_its_mantissa(name):
    for spec, x, got in vectors(name, "fp8_e4m3"):
        scale = np.abs(x).max(axis=1, keepdims=True) / 448
        # 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 the steps are 2^-9.
        bound = np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
        assert np.all(np.abs(got - x) <= bound), spec
        peak = np.abs(x).argmax(axis=1)
        rows = np.arange(len(x))
        assert np.allclose(got[rows, peak], x[rows, peak], rtol=1e-6)  # ±448 is exact


def test_zero_vectors_come_back_zero():
    cfg = model("tiny")
    state = random_state(cfg, [9], 9, 1)
    zero = ModelState(state.lengths, jax.tree_util.tree_map(jax.numpy.zeros_like, state.layers))
    for wire in ("int8", "fp8_e4m3"):
        frames = codec.encode(zero, cfg, precision=WirePrecision.parse(wire))
        decoded = arrays(codec.decode(frames, cfg), cfg)
        assert sum(array.size for _, array in decoded) > 1000
        for _, array in decoded:
            assert not np.asarray(array, np.float32).any() and not np.signbit(array).any()


# --- bytes --------------------------------------------------------------------------------


def hand_bytes(name: str, length: int, wire: str) -> int:
    """The state's wire bytes from the config's dimensions (each vector: a 4-byte scale)."""
    cfg = model(name)
    total = 0
    for spec in codec.StreamEncoder(cfg, length).entries:  # the shapes; sizes by hand below
        shape, itemsize = spec.spec.shape, spec.spec.itemsize
        n = int(np.prod(shape))
        if wire == "native" or (wire == "bf16" and spec.spec.dtype != "float32"):
            total += n * itemsize
        elif wire == "bf16":
            total += n * 2
        else:
            total += n // shape[-1] * (4 + shape[-1])
    return total


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("wire", ("native", *LOSSY))
def test_the_frames_carry_the_bytes_counted_by_hand(name, wire):
    _, _, frames = sent(name, 30, wire)
    header = codec.inspect(frames)
    assert header.payload_nbytes == hand_bytes(name, 30, wire) == codec.payload_nbytes(frames)
    assert all(len(frame) <= FRAME for frame in frames)


SETTINGS = ("native", *LOSSY, "state=int8,kv=bf16", "latent=fp8_e4m3,rope=int8,conv=bf16")


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("wire", SETTINGS)
def test_the_frames_carry_what_the_byte_formula_says(name, wire):
    setting = WirePrecision.parse(wire)
    _, _, frames = sent(name, 30, wire)
    assert codec.payload_nbytes(frames) == state_nbytes(model(name), 30, setting)
    _, _, frames = sent(name, 30, wire, base=11)  # an increment: the formula less 11 rows
    per_token = sum(
        layer_token_nbytes(model(name), kind, setting)
        for kind in model(name).layers
        if kind.has_growing_state
    )
    assert codec.payload_nbytes(frames) == state_nbytes(model(name), 30, setting) - 11 * per_token


@pytest.mark.parametrize(
    "name", ["kimi-linear-48b", "qwen3-next-80b", "mimo-v2-flash", "prfaas-1t"]
)
@pytest.mark.parametrize("wire", SETTINGS)
def test_full_size_tables_agree_with_the_byte_formula(name, wire):
    setting = WirePrecision.parse(wire)
    cfg = model(name)
    header = codec.StreamEncoder(cfg, 8192, precision=setting).state_header
    assert header.payload_nbytes == state_nbytes(cfg, 8192, setting)


def test_the_kinds_choose_per_tensor_and_the_header_says_which():
    cfg, state, frames = sent("tiny", 12, "state=int8,latent=fp8_e4m3")
    table = codec.inspect(frames).to_dict()["tensors"]
    wires = {(row["name"], row["kind"]): row["wire"] for row in table}
    assert wires == {
        ("recurrent", "kda"): "int8",
        ("conv", "kda"): "native",
        ("c_kv", "mla"): "fp8_e4m3",
        ("k_rope", "mla"): "native",
    }
    decoded = arrays(codec.decode(frames, cfg), cfg)
    for (spec, a), (_, b) in zip(arrays(state, cfg), decoded, strict=True):
        if spec.name in ("conv", "k_rope"):
            assert a.tobytes() == b.tobytes()  # native: exact


# --- streamed and incremental --------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from((("tiny", 61), ("tiny-gdn", 40), ("tiny-swa", 45))),
    st.sampled_from(LOSSY),
    st.lists(st.integers(0, 70), max_size=4),
)
def test_a_streamed_lossy_state_is_the_one_shot_stream(picked, wire, marks):
    name, length = picked
    cfg, state, frames = sent(name, length, wire)
    encoder = codec.StreamEncoder(
        cfg, length, max_frame_bytes=FRAME, stream_id=7, precision=WirePrecision.parse(wire)
    )
    streamed = [encoder.header()]
    for done in sorted(min(m, length) for m in marks):
        streamed += encoder.ready_frames(working_state(state, cfg, done, done + 1), done)
    streamed += encoder.finish(state)
    assert sorted(streamed) == sorted(frames)


@pytest.mark.parametrize("wire", LOSSY)
def test_a_lossy_increment_keeps_the_receivers_rows_exact(wire):
    cfg, state, _ = sent("tiny", 50, wire)
    whole = arrays(codec.decode(sent("tiny", 50, wire)[2], cfg), cfg)
    _, _, frames = sent("tiny", 50, wire, base=32)
    decoded = arrays(codec.decode(frames, cfg, base=held(state, cfg, 32)), cfg)
    source = arrays(state, cfg)
    for (spec, a), (_, b), (_, c) in zip(source, decoded, whole, strict=True):
        if spec.kind.has_growing_state:
            assert b[:32].tobytes() == a[:32].tobytes()  # the receiver's own rows
            assert b[32:].tobytes() == c[32:].tobytes()  # the rest as the whole stream has it
        else:
            assert b.tobytes() == c.tobytes()


# --- what a decoder refuses ------------------------------------------------------------------


def rewrite(frames: list[bytes], index: int, payload: bytes) -> list[bytes]:
    """Data frame ``index`` with a new payload, its CRC and the trailer's made valid again."""
    header = codec.inspect(frames)
    data = parse_data(memoryview(frames[index]), index)
    out = list(frames)
    out[index] = pack_data(data.stream_id, data.tensor_id, data.offset, payload)
    parts: dict[int, list[tuple[int, bytes]]] = {}
    for frame in out[1:-1]:
        d = parse_data(memoryview(frame), 1)
        parts.setdefault(d.tensor_id, []).append((d.offset, bytes(d.payload)))
    crcs = tuple(
        zlib.crc32(b"".join(p for _, p in sorted(parts[tid]))) for tid in range(len(header.tensors))
    )
    out[-1] = pack_trailer(StateTrailer(header.stream_id, crcs))
    return out


def scaled_frame(frames: list[bytes]) -> int:
    header = codec.inspect(frames)
    for index, frame in enumerate(frames[1:-1], 1):
        if header.tensors[parse_data(memoryview(frame), index).tensor_id].spec.name == "recurrent":
            return index
    raise AssertionError("no frame of a recurrent state")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("wire", ("int8", "fp8_e4m3"))
def test_a_bad_scale_is_a_clean_decode_error(wire, bad):
    cfg, _, frames = sent("tiny", 12, wire)
    index = scaled_frame(frames)
    payload = bytearray(parse_data(memoryview(frames[index]), index).payload)
    payload[0:4] = struct.pack("<f", bad)
    with pytest.raises(codec.StateDecodeError, match=r"recurrent, .*vector 0 has scale"):
        codec.decode(rewrite(frames, index, bytes(payload)), cfg)


def test_a_nan_fp8_element_is_a_clean_decode_error():
    cfg, _, frames = sent("tiny", 12, "fp8_e4m3")
    index = scaled_frame(frames)
    payload = bytearray(parse_data(memoryview(frames[index]), index).payload)
    payload[5] = 0x7F  # float8_e4m3fn NaN
    with pytest.raises(codec.StateDecodeError, match="vector 0 holds a NaN element"):
        codec.decode(rewrite(frames, index, bytes(payload)), cfg)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(("int8", "fp8_e4m3")), st.integers(0, 10**6), st.binary(min_size=4, max_size=4)
)
def test_any_scale_bytes_decode_or_fail_cleanly(wire, where, scale):
    cfg, _, frames = sent("tiny-gdn", 12, wire)
    index = scaled_frame(frames)
    payload = bytearray(parse_data(memoryview(frames[index]), index).payload)
    header = codec.inspect(frames)
    entry = header.tensors[parse_data(memoryview(frames[index]), index).tensor_id]
    vector = where % (len(payload) // entry.unit_bytes) * entry.unit_bytes
    payload[vector : vector + 4] = scale
    (value,) = struct.unpack("<f", scale)
    damaged = rewrite(frames, index, bytes(payload))
    if 0 <= value <= max_scale(wire):  # a valid scale: the vector is scaled by it
        state = codec.decode(damaged, cfg)
        assert all(np.isfinite(np.asarray(a, np.float32)).all() for _, a in arrays(state, cfg))
    else:
        with pytest.raises(codec.StateDecodeError, match="has scale"):
            codec.decode(damaged, cfg)


@pytest.mark.parametrize("wire", LOSSY)
def test_a_lossy_stream_for_another_model_is_refused_by_its_fingerprint(wire):
    _, _, frames = sent("tiny-gdn", 9, wire)
    with pytest.raises(codec.StateDecodeError, match="fingerprint mismatch"):
        codec.decode(frames, model("tiny"))


def retable(frames: list[bytes], edit) -> list[bytes]:
    header = codec.inspect(frames)
    table = json.loads(pack_header(header)[HEADER_FIXED_SIZE:-4])
    edit(table["tensors"])
    head = pack_header(header)
    blob = json.dumps(table).encode()
    body = head[: HEADER_FIXED_SIZE - 4] + struct.pack("<I", len(blob)) + blob
    return [body + struct.pack("<I", zlib.crc32(body)), *frames[1:]]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda rows: rows[0].__setitem__(7, "native"), "wire encoding must be one of"),
        (lambda rows: rows[0].__setitem__(7, "int4"), "wire encoding must be one of"),
        (lambda rows: rows[0].append("int8"), "expected a list of 7 fields"),
        (lambda rows: rows[0].__setitem__(3, "bfloat16"), "cannot travel as bf16"),
    ],
)
def test_a_bad_wire_column_is_named(edit, message):
    cfg, _, frames = sent("tiny", 9, "bf16")
    with pytest.raises(codec.StateDecodeError, match=message):
        codec.decode(retable(frames, edit), cfg)


def test_a_bf16_setting_leaves_16_bit_tensors_native():
    cfg = model("kimi-linear-48b")  # bf16 caches, a float32 recurrent state
    entries = codec.StreamEncoder(cfg, 4, precision=WirePrecision.parse("bf16")).entries
    assert {(e.spec.dtype, e.wire) for e in entries} == {
        ("float32", "bf16"),
        ("bfloat16", "native"),
    }


def test_non_finite_values_cannot_travel_scaled():
    cfg = model("tiny")
    state = random_state(cfg, [5], 5, 0)
    bad = jax.tree_util.tree_map(
        lambda a: a.at[0, 0, 0, 0].set(np.inf) if a.ndim == 4 else a, state
    )
    with pytest.raises(ValueError, match="non-finite values cannot travel as int8"):
        list(codec.encode(bad, cfg, precision=WirePrecision.parse("int8")))
    list(codec.encode(bad, cfg))  # native carries them as they are


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("int4", "state='int4': expected one of native, bf16, fp8_e4m3, int8"),
        ("state=int8,weights=bf16", "the kinds are state, conv, latent, rope, kv"),
        ("kv=bf16,kv=int8", "names kv twice"),
    ],
)
def test_a_bad_setting_is_named(text, message):
    with pytest.raises(ValueError, match=message):
        WirePrecision.parse(text)


def test_a_setting_reads_back_from_its_name():
    for text in ("native", "int8", "state=int8,kv=bf16"):
        setting = WirePrecision.parse(text)
        assert WirePrecision.parse(str(setting)) == setting
    assert str(WirePrecision.parse("state=int8,conv=int8,latent=int8,rope=int8,kv=int8")) == "int8"
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == 448  # the scale's divisor
