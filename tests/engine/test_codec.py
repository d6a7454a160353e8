"""The state codec: round trips per preset and length, the wire layout, and adversarial input.

Canonical content is recomputed here from model/state.py's docstring (first L positions of
growing caches, last min(L, W) positions of an SWA ring in position order, whole recurrent and
conv states) rather than taken from the codec, so the two are checked against each other.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prfaas_jax.config import LayerKind, ModelConfig, load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.format import (
    DATA_MAGIC,
    DATA_PREFIX_SIZE,
    HEADER_FIXED_SIZE,
    HEADER_MAGIC,
    TRAILER_MAGIC,
    StateDecodeError,
    StateTrailer,
    TensorEntry,
    pack_header,
    pack_trailer,
)
from prfaas_jax.engine.codec.layout import canonical_tensors
from prfaas_jax.model.state import ModelState, init_state, state_nbytes, window_capacity

PRESETS = ("tiny", "tiny-gdn", "tiny-lightning", "tiny-swa")
LENGTHS = (1, 7, 8, 63, 64, 65, 200)
SMALL_FRAME = 1000
PROPERTY = settings(max_examples=80, deadline=None)


@functools.cache
def model(name: str) -> ModelConfig:
    return load_model_config(name)


def random_state(cfg: ModelConfig, lengths: list[int], max_len: int, seed: int) -> ModelState:
    """Random values everywhere, garbage beyond L included, so the codec must pick the live part."""
    rng = np.random.default_rng(seed)
    empty = init_state(cfg, len(lengths), max_len)
    layers = jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype)), empty.layers
    )
    return ModelState(lengths=jnp.asarray(lengths, jnp.int32), layers=layers)


def canonical(state: ModelState, cfg: ModelConfig, row: int) -> list[np.ndarray]:
    length = int(state.lengths[row])
    out = []
    for kind, layer in zip(cfg.layers, state.layers, strict=True):
        leaves = [np.asarray(leaf)[row] for leaf in jax.tree_util.tree_leaves(layer)]
        if kind is LayerKind.SWA:
            ring = leaves[0].shape[0]
            slots = [p % ring for p in range(length - min(length, cfg.swa.window), length)]
            out += [leaf[slots] for leaf in leaves]
        elif kind.has_growing_state:
            out += [leaf[:length] for leaf in leaves]
        else:
            out += leaves
    return out


def assert_bitwise_equal(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tobytes() == y.tobytes()  # bitwise: bf16 and -0.0 included


def assert_same_state(a: ModelState, b: ModelState) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    leaves_a = [np.asarray(x) for x in jax.tree_util.tree_leaves(a)]
    assert_bitwise_equal(leaves_a, [np.asarray(x) for x in jax.tree_util.tree_leaves(b)])


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("length", LENGTHS)
def test_round_trip(name: str, length: int) -> None:
    cfg = model(name)
    # Row 1 is the one shipped; row 0 has another length so a row mix-up shows.
    state = random_state(cfg, [37, length], max_len=256, seed=length)
    frames = list(codec.encode(state, cfg, row=1, max_frame_bytes=SMALL_FRAME))
    assert all(len(frame) <= SMALL_FRAME for frame in frames)
    assert codec.payload_nbytes(frames) == state_nbytes(cfg, length)
    header = codec.inspect(frames)
    assert header.length == length and header.payload_nbytes == state_nbytes(cfg, length)
    assert header.num_frames == len(frames)

    out = codec.decode(frames, cfg)
    assert out.lengths.tolist() == [length] and out.lengths.dtype == jnp.int32
    assert_bitwise_equal(canonical(out, cfg, 0), canonical(state, cfg, 1))
    assert out.capacity == length
    # Decoding is the inverse of encoding: re-encoding (same stream id) gives the same bytes.
    again = codec.encode(out, cfg, max_frame_bytes=SMALL_FRAME, stream_id=header.stream_id)
    assert list(again) == frames

    wide = codec.decode(frames, cfg, max_len=256)
    assert_bitwise_equal(canonical(wide, cfg, 0), canonical(state, cfg, 1))
    for kind, layer in zip(cfg.layers, wide.layers, strict=True):
        if kind.has_growing_state:
            for leaf in jax.tree_util.tree_leaves(layer):
                assert leaf.shape[:2] == (1, 256)
                assert not np.asarray(leaf)[0, length:].any()
        elif kind is LayerKind.SWA:
            ring = window_capacity(cfg.swa.window, 256)
            live = {p % ring for p in range(max(0, length - cfg.swa.window), length)}
            for leaf in (layer.k, layer.v):
                assert leaf.shape[1] == ring
                assert not np.asarray(leaf)[0, sorted(set(range(ring)) - live)].any()


@pytest.mark.parametrize("name", PRESETS)
def test_default_frames_and_empty_state(name: str) -> None:
    cfg = model(name)
    state = random_state(cfg, [65], max_len=65, seed=1)
    frames = list(codec.encode(state, cfg))
    # With 4 MiB frames every non-empty tensor fits in one data frame (plus header, trailer).
    assert len(frames) == 2 + sum(spec.nbytes > 0 for spec in canonical_tensors(cfg, 65))
    assert_bitwise_equal(canonical(codec.decode(frames, cfg), cfg, 0), canonical(state, cfg, 0))

    empty = init_state(cfg, 1, 4)
    out = codec.decode(codec.encode(empty, cfg), cfg)
    assert codec.payload_nbytes(codec.encode(empty, cfg)) == state_nbytes(cfg, 0)
    assert out.lengths.tolist() == [0] and out.capacity == 1


def test_token_chunks_split_whole_positions() -> None:
    cfg = model("tiny")
    frames = list(codec.encode(random_state(cfg, [200], 200, 2), cfg, max_frame_bytes=SMALL_FRAME))
    for entry in codec.inspect(frames).tensors:
        assert entry.chunk_bytes % entry.spec.unit_bytes == 0
        assert entry.chunk_bytes <= SMALL_FRAME - DATA_PREFIX_SIZE
    mla = cfg.mla.kv_lora_rank * 4  # one c_kv position, fp32
    c_kv_entry = codec.inspect(frames).tensors[6]
    assert (c_kv_entry.spec.name, c_kv_entry.chunk_bytes) == ("c_kv", (972 // mla) * mla)


def test_wire_bytes_are_little_endian_in_position_order() -> None:
    cfg = model("tiny-swa")
    state = init_state(cfg, 1, 16)
    ring = state.layers[1]  # SWA, W' = 8; position 10 lives in slot 2
    ring = dataclasses.replace(ring, k=ring.k.at[0, 2, 0, 0].set(1.5))
    state = ModelState(jnp.array([11], jnp.int32), (state.layers[0], ring, *state.layers[2:]))
    frames = list(codec.encode(state, cfg))
    k_frame = frames[3]  # header, layer-0 k and v, then layer-1 k
    magic, stream_id, tensor_id = struct.unpack_from("<4sQI", k_frame)
    assert (magic, stream_id, tensor_id) == (DATA_MAGIC, codec.inspect(frames).stream_id, 2)
    row_bytes = cfg.swa.num_kv_heads * cfg.swa.head_dim * 4
    # Canonical SWA positions are 3..10, so position 10 is row 7.
    assert k_frame[DATA_PREFIX_SIZE + 7 * row_bytes :][:4] == struct.pack("<f", 1.5)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_bfloat16_round_trip(state_dtype: str) -> None:
    cfg = dataclasses.replace(model("tiny"), dtype="bfloat16", state_dtype=state_dtype)
    state = random_state(cfg, [5, 70], max_len=80, seed=3)
    frames = list(codec.encode(state, cfg, row=1, max_frame_bytes=SMALL_FRAME))
    assert codec.payload_nbytes(frames) == state_nbytes(cfg, 70)
    out = codec.decode(frames, cfg, max_len=80)
    assert out.layers[3].c_kv.dtype == jnp.bfloat16
    assert_bitwise_equal(canonical(out, cfg, 0), canonical(state, cfg, 1))
    with pytest.raises(StateDecodeError, match="fingerprint"):
        codec.decode(frames, model("tiny"))


def test_file_container(tmp_path) -> None:
    cfg = model("tiny-gdn")
    frames = list(codec.encode(random_state(cfg, [30], 30, 4), cfg, max_frame_bytes=SMALL_FRAME))
    path = tmp_path / "state.prfs"
    assert codec.write_file(path, frames) == path.stat().st_size
    assert codec.read_frames(path) == frames
    data = path.read_bytes()
    for bad in (data[:-1], data[:13], b"PRFSFILX" + data[8:], data[:8] + b"\x02\0\0\0" + data[12:]):
        path.write_bytes(bad)
        with pytest.raises(StateDecodeError):
            codec.read_frames(path)


def test_inspect_reports_the_table() -> None:
    cfg = model("tiny-lightning")
    frames = list(codec.encode(random_state(cfg, [9], 9, 5), cfg))
    summary = codec.inspect(frames).to_dict()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["fingerprint"] == cfg.fingerprint() and summary["length"] == 9
    assert int(summary["stream_id"], 16) == codec.inspect(frames).stream_id
    assert [(t["layer"], t["kind"], t["name"]) for t in summary["tensors"]] == [
        *((i, "lightning", "recurrent") for i in range(7)),
        (7, "mla", "c_kv"),
        (7, "mla", "k_rope"),
    ]


def test_encode_rejects_states_that_do_not_fit() -> None:
    cfg = model("tiny")
    state = random_state(cfg, [4], 8, 6)
    with pytest.raises(ValueError, match="row 1"):
        codec.encode(state, cfg, row=1)
    with pytest.raises(ValueError, match="layer 0"):
        codec.encode(state, model("tiny-gdn"))
    with pytest.raises(ValueError, match="max_frame_bytes"):
        codec.encode(state, cfg, max_frame_bytes=100)
    too_long = ModelState(jnp.array([9], jnp.int32), state.layers)
    with pytest.raises(ValueError, match="cannot hold"):
        codec.encode(too_long, cfg)


# --- named failures -----------------------------------------------------------------------------


@functools.cache
def stream(name: str, length: int) -> tuple[tuple[bytes, ...], ModelState]:
    cfg = model(name)
    frames = tuple(
        codec.encode(random_state(cfg, [length], length, length), cfg, max_frame_bytes=800)
    )
    return frames, codec.decode(frames, cfg)


def reheader(frames: tuple[bytes, ...], table: object = None, **fields: object) -> list[bytes]:
    """Rewrite the header with a valid CRC (what a buggy or hostile sender could produce)."""
    header = dataclasses.replace(codec.inspect(frames), **fields)
    head = pack_header(header)
    if table is not None:
        blob = json.dumps(table).encode()
        body = head[: HEADER_FIXED_SIZE - 4] + struct.pack("<I", len(blob)) + blob
        head = body + struct.pack("<I", zlib.crc32(body))
    return [head, *frames[1:]]


def test_wrong_model_is_named() -> None:
    frames, _ = stream("tiny-gdn", 9)
    with pytest.raises(StateDecodeError, match="fingerprint mismatch") as err:
        codec.decode(frames, model("tiny"))
    assert model("tiny").fingerprint() in str(err.value)
    assert model("tiny-gdn").fingerprint() in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: [], "no frames"),
        (lambda f: [b"XXXXXXXX" + f[0][8:], *f[1:]], "bad magic"),
        (lambda f: [f[0][:8] + b"\x01" + f[0][9:], *f[1:]], "version 1"),
        (lambda f: [f[0][:-3], *f[1:]], "header frame truncated"),
        (lambda f: [f[0] + b"\0", *f[1:]], "trailing bytes"),
        (lambda f: list(f[1:]), "data frame; a state stream must start"),
        (lambda f: [f[-1], *f[1:-1]], "trailer frame; a state stream must start"),
        (lambda f: [*f[:-1], f[0], f[-1]], "second header"),
        (lambda f: [*f[:-1], f[1], f[-1]], "duplicate"),
        (lambda f: list(f[:-1]), "ended early: no trailer"),
        (lambda f: [f[0], *f[2:]], "ended early: tensor 0"),
        (lambda f: [*f, f[1]], "follows the trailer"),
        (lambda f: [*f, f[-1]], "follows the trailer"),
        (lambda f: [f[0], f[-1], *f[1:-1]], "follows the trailer"),
        (lambda f: [*f[:-1], f[-1][:-1]], "truncated"),
        (lambda f: [*f[:-1], f[-1] + b"\0"], "trailing bytes"),
        (lambda f: [*f[:-1], f[-1][:-1] + bytes([f[-1][-1] ^ 1])], "checksum mismatch"),
        (lambda f: [*f, 42], "not a contiguous bytes-like"),
        (lambda f: reheader(f, length=11), "implies"),
        (lambda f: reheader(f, fingerprint="00" * 32), "fingerprint"),
        (lambda f: reheader(f, length=10**9), "more than the model's max_len"),
        (lambda f: reheader(f, table={"tensors": []}), "header says"),
        (lambda f: reheader(f, table=[1]), "must be a JSON object"),
        (lambda f: reheader(f, table={"tensors": [[True] * 7] * 8}), "layer must be"),
    ],
)
def test_named_failures(mutate, message: str) -> None:
    frames, _ = stream("tiny", 20)
    with pytest.raises(StateDecodeError, match=message):
        codec.decode(mutate(frames), model("tiny"))


def test_table_rows_are_checked_against_the_config() -> None:
    frames, _ = stream("tiny", 20)
    header = codec.inspect(frames)
    entry = header.tensors[6]
    spec = dataclasses.replace(entry.spec, shape=(21, *entry.spec.shape[1:]))
    bad = (
        *header.tensors[:6],
        TensorEntry(spec, entry.chunk_bytes),
        header.tensors[7],
    )
    with pytest.raises(StateDecodeError, match="header tensor 6 is layer 3 mla c_kv"):
        codec.decode(reheader(frames, tensors=bad), model("tiny"))


def test_frames_of_another_stream_are_rejected() -> None:
    frames, state = stream("tiny", 20)
    # The same state encoded again: identical payloads, but a fresh random stream id.
    other = list(codec.encode(state, model("tiny"), max_frame_bytes=800))
    assert codec.inspect(other).stream_id != codec.inspect(frames).stream_id
    assert [f[DATA_PREFIX_SIZE:] for f in other[1:-1]] == [
        f[DATA_PREFIX_SIZE:] for f in frames[1:-1]
    ]
    for mixed in ([frames[0], other[1], *frames[2:]], [*frames[:-1], other[-1]]):
        with pytest.raises(StateDecodeError, match="another state stream"):
            codec.decode(mixed, model("tiny"))
    assert_same_state(codec.decode(other, model("tiny")), state)


def retrailer(frames: tuple[bytes, ...], crc32s: tuple[int, ...]) -> list[bytes]:
    """Replace the trailer by one with a valid frame CRC but the given tensor CRCs."""
    trailer = pack_trailer(StateTrailer(codec.inspect(frames).stream_id, crc32s))
    return [*frames[:-1], trailer]


def test_the_trailer_is_checked() -> None:
    frames, state = stream("tiny", 20)
    crcs = codec.inspect_trailer(frames).crc32s
    assert len(crcs) == len(codec.inspect(frames).tensors)
    assert_same_state(codec.decode(retrailer(frames, crcs), model("tiny")), state)
    wrong = (*crcs[:2], crcs[2] ^ 1, *crcs[3:])
    with pytest.raises(StateDecodeError, match=r"tensor 2 \(layer 1 recurrent\) fails its CRC32"):
        codec.decode(retrailer(frames, wrong), model("tiny"))
    with pytest.raises(StateDecodeError, match="lists 7 tensor CRCs; the header has 8"):
        codec.decode(retrailer(frames, crcs[:-1]), model("tiny"))
    corrupt = bytearray(frames[-1])
    corrupt[20] ^= 0x10  # inside the CRC list
    with pytest.raises(StateDecodeError, match=r"trailer frame \d+ checksum mismatch"):
        codec.decode([*frames[:-1], bytes(corrupt)], model("tiny"))
    with pytest.raises(StateDecodeError, match="not the trailer"):
        codec.inspect_trailer(frames[:-1])


def test_max_len_below_length() -> None:
    frames, _ = stream("tiny-swa", 12)
    with pytest.raises(StateDecodeError, match="more than max_len"):
        codec.decode(frames, model("tiny-swa"), max_len=11)
    out = codec.decode([bytearray(f) for f in frames], model("tiny-swa"), max_len=12)
    assert out.layers[1].k.shape[1] == 8


# --- properties -----------------------------------------------------------------------------------

STREAMS = (("tiny", 65), ("tiny-gdn", 9), ("tiny-lightning", 3), ("tiny-swa", 13))


def decodes_to_original_or_fails(frames: list, name: str, length: int) -> bool:
    """Decode mutated frames: a failure must be a StateDecodeError, a success the original."""
    try:
        out = codec.decode(frames, model(name))
    except StateDecodeError:
        return False
    assert_same_state(out, stream(name, length)[1])
    return True


@st.composite
def a_stream(draw: st.DrawFn) -> tuple[str, int, list[bytes]]:
    name, length = draw(st.sampled_from(STREAMS))
    return name, length, list(stream(name, length)[0])


@PROPERTY
@given(a_stream(), st.data())
def test_any_truncation_is_rejected(picked, data) -> None:
    name, length, frames = picked
    index = data.draw(st.integers(0, len(frames) - 1))
    frames[index] = frames[index][: data.draw(st.integers(0, len(frames[index]) - 1))]
    assert not decodes_to_original_or_fails(frames, name, length)


@PROPERTY
@given(a_stream(), st.data())
def test_any_bit_flip_is_rejected(picked, data) -> None:
    name, length, frames = picked
    index = data.draw(st.integers(0, len(frames) - 1))
    bit = data.draw(st.integers(0, 8 * len(frames[index]) - 1))
    flipped = bytearray(frames[index])
    flipped[bit // 8] ^= 1 << (bit % 8)
    frames[index] = bytes(flipped)
    assert not decodes_to_original_or_fails(frames, name, length)


@PROPERTY
@given(a_stream(), st.data())
def test_dropped_or_duplicated_frames_are_rejected(picked, data) -> None:
    name, length, frames = picked
    index = data.draw(st.integers(0, len(frames) - 1))
    if data.draw(st.booleans()):
        del frames[index]
    else:
        frames.insert(data.draw(st.integers(0, len(frames))), frames[index])
    assert not decodes_to_original_or_fails(frames, name, length)


@PROPERTY
@given(a_stream(), st.randoms(use_true_random=False))
def test_data_frames_are_self_placing(picked, rnd) -> None:
    name, length, frames = picked
    order = list(range(len(frames)))
    rnd.shuffle(order)
    # Data frames may come in any order; the header must come first and the trailer last.
    ok = decodes_to_original_or_fails([frames[i] for i in order], name, length)
    assert ok == (order[0] == 0 and order[-1] == len(frames) - 1)


@PROPERTY
@given(
    a_stream(), st.lists(st.tuples(st.integers(0, 4), st.integers(0), st.integers(0)), max_size=4)
)
def test_mutation_sequences_never_decode_wrong(picked, steps) -> None:
    name, length, frames = picked
    for op, i, j in steps:
        if not frames:
            break
        i %= len(frames)
        if op == 0:  # swap two frames
            j %= len(frames)
            frames[i], frames[j] = frames[j], frames[i]
        elif op == 1:  # cut a frame short (or keep it whole)
            frames[i] = frames[i][: j % (len(frames[i]) + 1)]
        elif op == 2:  # append another frame's payload
            frames[i] = frames[i] + frames[j % len(frames)][DATA_PREFIX_SIZE:]
        elif op == 3:
            del frames[i]
        else:  # xor every byte (a no-op when the mask is 0)
            frames[i] = bytes(b ^ (j & 0xFF) for b in frames[i])
    decodes_to_original_or_fails(frames, name, length)


garbage = st.one_of(
    st.binary(max_size=120),
    st.binary(max_size=120).map(lambda b: HEADER_MAGIC + b"\x02\0" + b),
    st.binary(max_size=120).map(lambda b: DATA_MAGIC + b),
    st.binary(max_size=120).map(lambda b: TRAILER_MAGIC + b),
)


@PROPERTY
@given(st.sampled_from(STREAMS), st.booleans(), st.lists(garbage, max_size=4))
def test_garbage_is_rejected(picked, keep_header, junk) -> None:
    name, length = picked
    frames = [stream(name, length)[0][0]] if keep_header else []
    assert not decodes_to_original_or_fails(frames + junk, name, length)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=9) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=30,
)


@PROPERTY
@given(a_stream(), st.data())
def test_hostile_headers_with_valid_crc_are_rejected(picked, data) -> None:
    name, length, frames = picked
    rows = [list(row) for row in json.loads(frames[0][HEADER_FIXED_SIZE:-4])["tensors"]]
    row = data.draw(st.integers(0, len(rows) - 1))
    column = data.draw(st.integers(0, len(rows[row]) - 1))
    rows[row][column] = data.draw(json_values)
    table = data.draw(st.sampled_from([{"tensors": rows}, data.draw(json_values)]))
    decodes_to_original_or_fails(reheader(tuple(frames), table=table), name, length)
