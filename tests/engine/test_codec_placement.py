"""``StreamDecoder.target``: a data frame's payload received straight into the state (the data
path's receiver, serving/transfer/data_path.py) decodes to exactly the state ``feed`` builds,
and every frame ``target`` could not vouch for from its prefix alone goes to ``feed`` whole.

The oracle is ``codec.decode`` of the same frames (itself checked against the encoded state in
test_codec.py); the placement is done as the receiver does it — the frame's first
``DATA_PREFIX_SIZE`` bytes to ``target``, the rest copied into what it returns.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_codec import assert_same_state, model, random_state

from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.decoder import PlacedFrame
from prfaas_jax.engine.codec.format import DATA_PREFIX_SIZE, pack_data, parse_data
from prfaas_jax.engine.codec.precision import WirePrecision

FRAME = 700


def frames_of(name: str, length: int, precision: str = "native") -> tuple[object, list[bytes]]:
    cfg = model(name)
    state = random_state(cfg, [length], length, seed=length)
    wire = WirePrecision.parse(precision)
    return cfg, list(codec.encode(state, cfg, max_frame_bytes=FRAME, precision=wire))


def placed(decoder: codec.StreamDecoder, frame: bytes) -> PlacedFrame | None:
    """What the receiver does with one frame: `target`, then the payload into it."""
    view = memoryview(frame)
    placement = decoder.target(view[:DATA_PREFIX_SIZE], len(frame))
    if placement is not None:
        placement.payload[:] = np.frombuffer(view[DATA_PREFIX_SIZE:], np.uint8)
    return placement


@pytest.mark.parametrize(
    ("name", "length", "precision"),
    [("tiny", 37, "native"), ("tiny-swa", 45, "native"), ("tiny-gdn", 20, "state=bf16,kv=int8")],
)
def test_payloads_received_in_place_decode_to_the_fed_state(name, length, precision):
    cfg, frames = frames_of(name, length, precision)
    decoder = codec.StreamDecoder(cfg)
    taken = 0
    for frame in frames:
        placement = placed(decoder, frame)
        decoder.feed(frame if placement is None else placement)
        taken += placement is not None
    assert taken == len(frames) - 2  # every data frame; never the header or the trailer
    assert_same_state(decoder.finish(), codec.decode(frames, cfg))


def test_target_vouches_only_for_a_data_frame_that_fits_an_empty_slot():
    cfg, frames = frames_of("tiny", 37)
    header, data, trailer = frames[0], frames[1:-1], frames[-1]
    decoder = codec.StreamDecoder(cfg)
    assert placed(decoder, data[0]) is None  # no header yet
    decoder.feed(header)
    assert placed(decoder, header) is None and placed(decoder, trailer) is None  # not data
    first = parse_data(memoryview(data[0]), 1)
    other_stream = pack_data(first.stream_id ^ 1, first.tensor_id, first.offset, first.payload)
    off_grid = pack_data(first.stream_id, first.tensor_id, first.offset + 1, first.payload)
    no_tensor = pack_data(first.stream_id, 10**6, first.offset, first.payload)
    for frame in (other_stream, off_grid, no_tensor, data[0][:-1], data[0] + b"x"):
        assert placed(decoder, frame) is None
    assert isinstance(placed(decoder, data[0]), PlacedFrame)
    assert placed(decoder, data[0]) is None  # its slot is taken: a duplicate comes whole
    with pytest.raises(codec.StateDecodeError, match="is a duplicate"):
        decoder.feed(data[0])


def test_a_corrupt_payload_received_in_place_fails_its_checksum():
    cfg, frames = frames_of("tiny", 37)
    decoder = codec.StreamDecoder(cfg)
    decoder.feed(frames[0])
    damaged = bytearray(frames[1])
    damaged[-1] ^= 0x40
    placement = placed(decoder, bytes(damaged))
    assert placement is not None  # the prefix is sound: the damage shows only in the CRC
    with pytest.raises(codec.StateDecodeError, match="data frame 1 checksum mismatch"):
        decoder.feed(placement)


def test_a_placement_is_fed_once_and_only_to_its_decoder():
    cfg, frames = frames_of("tiny", 37)
    a, b = codec.StreamDecoder(cfg), codec.StreamDecoder(cfg)
    a.feed(frames[0])
    b.feed(frames[0])
    placement = placed(a, frames[1])
    with pytest.raises(codec.StateDecodeError, match="not placed by this decoder"):
        b.feed(placement)
    a.feed(placement)
    with pytest.raises(codec.StateDecodeError, match="not placed by this decoder"):
        a.feed(placement)
