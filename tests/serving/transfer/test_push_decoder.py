"""`PushDecoder`: a push decoded as it arrives, two frames behind, the trailer and handoff last.

The oracle is `codec.decode` of the whole stream (itself checked against an independent
canonical read in tests/engine/test_codec.py) and the frame counts the module promises.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.codec.layout import canonical_tensors, state_from_arrays
from prfaas_jax.engine.sampling_params import GREEDY
from prfaas_jax.serving.transfer.push_decoder import PushDecoder

CFG = load_model_config("tiny")
LENGTH, FRAME = 90, 1000


@pytest.fixture(scope="module")
def stream() -> tuple[list[bytes], bytes]:
    rng = np.random.default_rng(0)
    arrays = [
        (spec, rng.standard_normal(spec.shape).astype(jax.numpy.dtype(spec.dtype)))
        for spec in canonical_tensors(CFG, LENGTH)
    ]
    state = state_from_arrays(CFG, LENGTH, arrays, LENGTH)
    frames = list(codec.encode(state, CFG, max_frame_bytes=FRAME))
    return frames, pack_handoff(Handoff(7, GREEDY), frames[0])


def _same(a, b) -> bool:
    return all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def test_frames_are_placed_two_behind_and_the_state_is_decoded(stream) -> None:
    frames, handoff = stream
    push = PushDecoder(CFG, max_len=128)
    for taken, frame in enumerate([*frames, handoff], start=1):
        push.take(frame)
        assert push.decoder.frames == max(taken - 2, 0)  # held: at most the last two
    assert push.ends_with_handoff and push.handoff().first_token == 7
    assert push.payload_nbytes == codec.inspect(frames).payload_nbytes
    assert _same(push.state(None), codec.decode(frames, CFG, max_len=128))


def test_a_striped_push_places_the_other_stripes_before_its_trailer(stream) -> None:
    frames, handoff = stream
    header, data, trailer = frames[0], frames[1:-1], frames[-1]
    own, others = data[::2], data[1::2]  # stripe 0 carries every other data frame
    push = PushDecoder(CFG, max_len=128)
    for frame in [header, *own, trailer, handoff]:
        push.take(frame)
    assert push.handoff(others).first_token == 7
    assert _same(push.state(None), codec.decode(frames, CFG, max_len=128))


def test_a_damaged_frame_is_refused_before_the_stream_ends(stream) -> None:
    frames = stream[0]
    damaged = bytearray(frames[2])
    damaged[-1] ^= 1
    push = PushDecoder(CFG, max_len=128)
    for frame in [frames[0], frames[1], bytes(damaged), frames[3]]:
        push.take(frame)
    with pytest.raises(codec.StateDecodeError, match="data frame 2 checksum mismatch"):
        push.take(frames[4])  # frame 2 is placed now, with more than half the stream to come
    assert len(frames) > 8


@pytest.mark.parametrize(
    ("count", "message"),
    [(0, "no frames"), (1, "no handoff frame")],
)
def test_a_push_that_ends_at_once_is_named(stream, count: int, message: str) -> None:
    push = PushDecoder(CFG, max_len=128)
    for frame in stream[0][:count]:
        push.take(frame)
    assert not push.ends_with_handoff
    with pytest.raises(codec.StateDecodeError, match=message):
        push.handoff()
