"""``StreamEncoder``: a state streamed chunk by chunk is the one-shot stream, frame for frame.

The chunked prefill is emulated (any cut points, every preset: MLA, GQA, SWA and linear layers)
with working states whose not-yet-final parts hold garbage, so a frame built from anything but
final positions shows up; and run for real with a ``PrefillEngine`` on ``tiny``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import preset
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import assert_same_state, model, random_state

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.format import DATA_MAGIC, FrameParts, parse_data
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.state import ModelState, state_nbytes

FRAME = 600
STREAM_ID = 0x0123_4567_89AB_CDEF


def working_state(full: ModelState, cfg: ModelConfig, done: int, seed: int) -> ModelState:
    """What a chunked prefill's working state could hold after ``done`` tokens: ``full``'s first
    ``done`` positions of every growing cache, garbage everywhere else."""
    garbage = random_state(cfg, [done], full.capacity, seed)
    layers = []
    for kind, real, junk in zip(cfg.layers, full.layers, garbage.layers, strict=True):
        if kind.has_growing_state:
            keep = lambda a, b: jnp.where(  # noqa: E731
                (jnp.arange(a.shape[1]) < done).reshape(1, -1, *[1] * (a.ndim - 2)), a, b
            )
            junk = jax.tree_util.tree_map(keep, real, junk)
        layers.append(junk)
    return ModelState(lengths=jnp.array([done], jnp.int32), layers=tuple(layers))


def rows_of(frame: bytes, header: codec.StateHeader) -> tuple[int, int, int]:
    """``(tensor id, first row, end row)`` of a data frame of a token-axis tensor."""
    data = parse_data(memoryview(frame), 1)
    unit = header.tensors[data.tensor_id].spec.unit_bytes
    return data.tensor_id, data.offset // unit, (data.offset + len(data.payload)) // unit


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from((("tiny", 61), ("tiny-gdn", 40), ("tiny-lightning", 33), ("tiny-swa", 45))),
    st.lists(st.integers(0, 70), max_size=6),
    st.integers(0, 2**64 - 1),
)
def test_streamed_frames_are_the_one_shot_frames(picked, cuts, stream_id) -> None:
    name, length = picked
    cfg = model(name)
    full = random_state(cfg, [length], 72, seed=length)
    encoder = codec.StreamEncoder(cfg, length, max_frame_bytes=FRAME, stream_id=stream_id)
    header = codec.inspect([encoder.header()])
    early: list[bytes] = []
    for seed, done in enumerate(sorted({min(c, length) for c in cuts})):
        for frame in encoder.ready_frames(working_state(full, cfg, done, seed), done):
            tid, _, end = rows_of(frame, header)
            assert header.tensors[tid].spec.kind.has_growing_state and end <= done
            early.append(frame)
    rest = list(encoder.finish(full))
    streamed = [encoder.header(), *early, *rest]
    one_shot = list(codec.encode(full, cfg, max_frame_bytes=FRAME, stream_id=stream_id))
    # The same frames, byte for byte (only their order differs), trailer last.
    assert sorted(streamed) == sorted(one_shot) and streamed[-1] == one_shot[-1]
    assert len(set(streamed)) == len(streamed)
    assert codec.payload_nbytes(streamed) == state_nbytes(cfg, length)
    assert_same_state(codec.decode(streamed, cfg), codec.decode(one_shot, cfg))


@pytest.mark.parametrize(
    ("name", "length", "groups"),
    [("tiny", 61, 4), ("tiny-gdn", 40, 2), ("tiny-lightning", 33, 3), ("tiny-swa", 45, 4)],
)
def test_layer_frames_stream_each_group_once_and_read_nothing_else(name, length, groups) -> None:
    """A layer-wise prefill's stream: early KV rows, then each group of layers from a state in
    which only the layers streamed so far are final (the rest garbage), then ``finish``, which
    is left the trailer alone. The frames are the one-shot frames; nothing is sent twice."""
    from prfaas_jax.engine.prefill import split_layers

    cfg = model(name)
    full = random_state(cfg, [length], 72, seed=length)
    encoder = codec.StreamEncoder(cfg, length, max_frame_bytes=FRAME, stream_id=STREAM_ID)
    streamed = [encoder.header(), *encoder.ready_frames(working_state(full, cfg, 16, 0), 16)]
    for seed, group in enumerate(split_layers(cfg.num_layers, groups), start=1):
        garbage = working_state(full, cfg, 0, seed)  # no final position anywhere
        layers = [
            full.layers[i] if i < group.stop else garbage.layers[i] for i in range(len(cfg.layers))
        ]
        partial = ModelState(lengths=full.lengths, layers=tuple(layers))
        streamed += encoder.layer_frames(partial, group)
        assert list(encoder.layer_frames(full, group)) == []  # nothing is sent twice
    rest = list(encoder.finish(full))
    assert len(rest) == 1 and rest[0][:4] != DATA_MAGIC  # the trailer
    one_shot = list(codec.encode(full, cfg, max_frame_bytes=FRAME, stream_id=STREAM_ID))
    streamed += rest
    assert sorted(streamed) == sorted(one_shot) and streamed[-1] == one_shot[-1]
    assert_same_state(codec.decode(streamed, cfg), codec.decode(one_shot, cfg))
    with pytest.raises(ValueError, match="already ran"):
        encoder.layer_frames(full, range(0, 1))
    with pytest.raises(ValueError, match="the header says"):
        codec.StreamEncoder(cfg, length - 1, max_frame_bytes=FRAME).layer_frames(full, range(1))


def test_ready_frames_tile_the_token_grid() -> None:
    cfg = model("tiny")  # MLA c_kv rows are 128 bytes: 4 rows per 600-byte frame
    full = random_state(cfg, [30], 30, seed=1)
    encoder = codec.StreamEncoder(cfg, 30, max_frame_bytes=FRAME)
    header = codec.inspect([encoder.header()])
    c_kv = header.tensors[6]
    assert (c_kv.spec.name, c_kv.frame_rows) == ("c_kv", 4)
    assert list(encoder.ready_frames(full, 3)) == []  # no whole frame of rows yet
    seen = [rows_of(f, header) for f in encoder.ready_frames(working_state(full, cfg, 9, 0), 9)]
    assert (6, 0, 4) in seen and (6, 4, 8) in seen and all(end <= 8 for _, _, end in seen)
    assert list(encoder.ready_frames(full, 9)) == []  # nothing is sent twice
    last = [rows_of(f, header) for f in encoder.ready_frames(full, 30)]
    assert (6, 28, 30) in last  # at L the short last frame is ready too
    # Every MLA frame went out early: finish sends only the other tensors and the trailer.
    rest = list(encoder.finish(full))
    assert {rows_of(f, header)[0] for f in rest[:-1]}.isdisjoint({6, 7})
    assert rest[-1][:4] != DATA_MAGIC


@pytest.mark.parametrize(("name", "length"), [("tiny", 61), ("tiny-swa", 45)])
def test_frames_as_views_join_to_the_frames(name: str, length: int) -> None:
    """``finish(views=True)``: each data frame as its prefix and a view of the state's bytes,
    which join to exactly the frame ``finish`` copies; the trailer is the same."""
    cfg = model(name)
    state = random_state(cfg, [length], length, seed=3)
    frames = {}
    for views in (False, True):
        encoder = codec.StreamEncoder(cfg, length, max_frame_bytes=FRAME, stream_id=STREAM_ID)
        frames[views] = list(encoder.finish(state, views=views))
    assert all(isinstance(f, FrameParts) for f in frames[True][:-1])
    assert [bytes(f) for f in frames[True]] == frames[False]


def test_encoder_misuse_is_refused() -> None:
    cfg = model("tiny")
    full = random_state(cfg, [20], 20, seed=2)
    encoder = codec.StreamEncoder(cfg, 20, max_frame_bytes=FRAME)
    with pytest.raises(ValueError, match="outside"):
        encoder.ready_frames(full, 21)
    with pytest.raises(ValueError, match="holds 5 positions, fewer than 8"):
        encoder.ready_frames(working_state(full, cfg, 5, 0), 8)
    with pytest.raises(ValueError, match="L=20 tokens, the header says 19"):
        codec.StreamEncoder(cfg, 19, max_frame_bytes=FRAME).finish(full)
    with pytest.raises(ValueError, match="layer 3 is a MlaState, not gqa"):
        codec.StreamEncoder(model("tiny-gdn"), 20).ready_frames(full, 20)
    list(encoder.finish(full))
    with pytest.raises(ValueError, match="already ran"):
        encoder.ready_frames(full, 20)
    with pytest.raises(ValueError, match="already ran"):
        encoder.finish(full)
    with pytest.raises(ValueError, match="u64"):
        codec.StreamEncoder(cfg, 20, stream_id=2**64)


@pytest.mark.parametrize("prefix_len", [0, 20])
def test_real_chunked_prefill_streams_the_one_shot_state(prefix_len: int) -> None:
    cfg, params = preset("tiny")
    engine = PrefillEngine(cfg, params, chunk_len=16, buckets=(64,))
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 50).tolist()
    prefix = None
    if prefix_len:
        prefix = engine.prefill(ids[:prefix_len]).state
    encoder = codec.StreamEncoder(cfg, len(ids), max_frame_bytes=FRAME, stream_id=STREAM_ID)
    events: list[tuple[str, int]] = []
    early: list[bytes] = []

    def on_chunk(state: ModelState, done: int) -> None:
        frames = list(encoder.ready_frames(state, done))
        events.append(("chunk", done))
        events.extend(("frame", done) for _ in frames)
        early.extend(frames)

    result = engine.prefill(ids[prefix_len:], prefix=prefix, on_chunk=on_chunk)
    events.append(("prefill returned", len(ids)))
    rest = list(encoder.finish(result.state))
    # Frames left during prefill, after the first chunk: long before the last one.
    chunk_ends = [done for what, done in events if what == "chunk"]
    assert chunk_ends == ([16, 32, 48, 50] if not prefix_len else [32, 48, 50])
    first_frame = next(i for i, (what, _) in enumerate(events) if what == "frame")
    assert events[first_frame][1] == chunk_ends[0]
    header = encoder.state_header
    mla = [tid for tid, e in enumerate(header.tensors) if e.spec.kind.has_growing_state]
    assert sorted({rows_of(f, header)[0] for f in early}) == mla
    assert len(early) == sum(header.tensors[tid].num_frames for tid in mla)
    streamed = [encoder.header(), *early, *rest]
    one_shot = list(codec.encode(result.state, cfg, max_frame_bytes=FRAME, stream_id=STREAM_ID))
    assert sorted(streamed) == sorted(one_shot)
    assert codec.payload_nbytes(streamed) == state_nbytes(cfg, len(ids))
    # Both decode to the prefill's own result, bit for bit.
    assert_same_state(codec.decode(streamed, cfg), result.state)
    assert_same_state(codec.decode(one_shot, cfg), result.state)


def test_encoder_entries_match_the_header() -> None:
    encoder = codec.StreamEncoder(model("tiny-swa"), 12, max_frame_bytes=FRAME, stream_id=5)
    header = codec.inspect([encoder.header()])
    assert dataclasses.astuple(header) == dataclasses.astuple(encoder.state_header)
    assert header.stream_id == 5 and header.num_frames == 2 + header.num_data_frames
