"""The state wire codec: ``encode`` one sequence of a ``ModelState`` into frames, ``decode`` them.

Also ``StreamEncoder`` (the same frames written during a chunked prefill: header first, cache
rows as chunks finish), ``inspect`` (the header, without a model config), ``inspect_trailer``,
``payload_nbytes`` and a file container (``write_file`` / ``read_frames``). What travels is the
canonical state of model/state.py, so the payload (the tensor bytes, prefixes excluded) is
exactly ``state_nbytes(cfg, L)``. No pickle.

Format version 2, specified byte by byte in docs/wire-format.md: a header frame (model
fingerprint, L, stream id, tensor table) that can leave before the state exists, self-placing
data frames with their own CRC32 in any order, and a trailer with each tensor's CRC32. Byte
layouts live in ``format``, the state ↔ tensor mapping in ``layout``, the encoder in
``stream``, the decoder (``StreamDecoder``, which ``decode`` feeds; it trusts nothing) in
``decoder``, the file container in ``file``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.codec.decoder import StreamDecoder, frame_view, trailer_of
from prfaas_jax.engine.codec.file import read_frames, write_file
from prfaas_jax.engine.codec.format import (
    StateDecodeError,
    StateHeader,
    StateTrailer,
    TensorEntry,
    is_trailer,
    parse_data,
    parse_header,
    parse_trailer,
)
from prfaas_jax.engine.codec.layout import KvPrefix, TensorSpec, row_length
from prfaas_jax.engine.codec.precision import WIRE_NATIVE, WirePrecision
from prfaas_jax.engine.codec.stream import DEFAULT_MAX_FRAME_BYTES, StreamEncoder
from prfaas_jax.model.state import ModelState

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "KvPrefix",
    "StateDecodeError",
    "StateHeader",
    "StateTrailer",
    "StreamDecoder",
    "StreamEncoder",
    "TensorEntry",
    "TensorSpec",
    "WirePrecision",
    "decode",
    "encode",
    "inspect",
    "inspect_trailer",
    "payload_nbytes",
    "read_frames",
    "write_file",
]

_NO_FRAME = object()


def encode(
    state: ModelState,
    cfg: ModelConfig,
    *,
    row: int = 0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    stream_id: int | None = None,
    base: int = 0,
    precision: WirePrecision = WIRE_NATIVE,
) -> Iterator[bytes]:
    """Frames of sequence ``row`` of ``state``: header, data frames layer by layer, trailer.

    ``StreamEncoder`` in one go (``stream_id``: random unless given; ``base``: leading positions
    of the growing caches left out, which the receiver holds; ``precision``: each kind of
    tensor's encoding, native by default). Every frame is at most
    ``max_frame_bytes`` long. The state is checked and read eagerly (ValueError if it does not
    fit ``cfg``); frames are built as iterated.
    """
    _, length = row_length(state, row)
    encoder = StreamEncoder(
        cfg,
        length,
        max_frame_bytes=max_frame_bytes,
        stream_id=stream_id,
        base=base,
        precision=precision,
    )
    return itertools.chain([encoder.header()], encoder.finish(state, row=row))


def decode(
    frames: Iterable[bytes],
    cfg: ModelConfig,
    *,
    max_len: int | None = None,
    base: KvPrefix | None = None,
) -> ModelState:
    """Rebuild a batch-1 ``ModelState`` from ``encode``'s frames (data frames in any order).

    ``StreamDecoder`` fed the whole stream: growing caches get capacity ``max_len`` (default:
    L, at least 1), zeros beyond L; SWA rings get ``window_capacity(W, max_len)`` slots with
    position p in slot p mod ring size. A state longer than ``max_len`` (default: the model's
    ``cfg.max_len``) is rejected before any buffer is allocated. A stream whose header has a
    ``base`` (an increment) needs ``base``, the receiver's rows of those positions, of exactly
    that length.
    """
    decoder = StreamDecoder(cfg, max_len=max_len)
    for frame in frames:
        decoder.feed(frame)
        if decoder.frames == 1:  # the header: an increment's base is checked before its data
            decoder.check_base(base)
    return decoder.finish(base)


def _first_header(stream: Iterator[object]) -> StateHeader:
    first = next(stream, _NO_FRAME)
    if first is _NO_FRAME:
        raise StateDecodeError("no frames: a state stream starts with a header frame")
    return parse_header(frame_view(first, 0))


def inspect(frames: Iterable[bytes]) -> StateHeader:
    """The header of an encoded state (first frame only; checked for structure, not a model)."""
    return _first_header(iter(frames))


def inspect_trailer(frames: Sequence[bytes]) -> StateTrailer:
    """The trailer of a complete stream (its last frame), checked against the header's stream
    id and tensor count but not against a model or the data."""
    header = inspect(frames)
    if len(frames) < 2:
        raise StateDecodeError("stream ended early: no trailer frame after the header")
    index = len(frames) - 1
    view = frame_view(frames[index], index)
    if not is_trailer(view):
        raise StateDecodeError(f"stream ended early: its last frame ({index}) is not the trailer")
    return trailer_of(header, view, index)


def payload_nbytes(frames: Iterable[bytes]) -> int:
    """Tensor bytes carried by the data frames of a stream (each frame's structure and CRC are
    checked; the header is parsed but not matched to a model)."""
    total = 0
    for index, frame in enumerate(frames):
        view = frame_view(frame, index)
        if index == 0:
            parse_header(view)
        elif is_trailer(view):
            parse_trailer(view, index)
        else:
            total += len(parse_data(view, index).payload)
    return total
