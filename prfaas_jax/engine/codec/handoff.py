"""The handoff frame: what decoding a prefilled state needs besides the state itself — token 0
and the request's sampling settings — sent after the state's trailer (``Handoff``,
``pack_handoff``, ``split_handoff``, ``is_handoff_frame``).

The frame repeats the state header's stream id, which binds it to that state; its byte layout
is in docs/wire-format.md, "Handoff frame".
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from collections.abc import Sequence

from prfaas_jax.engine.codec.format import StateDecodeError
from prfaas_jax.engine.codec.wire import inspect
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.errors import UserError

HANDOFF_MAGIC = b"PRFH"
_HANDOFF_HEAD = struct.Struct("<4sQI")
_CRC = struct.Struct("<I")


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What decoding a prefilled state needs besides the state: token 0 and how to sample."""

    first_token: int
    sampling: SamplingParams


def pack_handoff(handoff: Handoff, header_frame: bytes) -> bytes:
    """The handoff frame for the state whose header frame is ``header_frame``."""
    stream_id = inspect([header_frame]).stream_id
    blob = json.dumps(
        {"first_token": handoff.first_token, "sampling": dataclasses.asdict(handoff.sampling)},
        separators=(",", ":"),
    ).encode()
    body = _HANDOFF_HEAD.pack(HANDOFF_MAGIC, stream_id, len(blob)) + blob
    return body + _CRC.pack(zlib.crc32(body))


def is_handoff_frame(frame: bytes) -> bool:
    """Whether ``frame`` starts like a handoff frame (the last frame of a complete stream)."""
    return bytes(frame[:4]) == HANDOFF_MAGIC


def parse_handoff(frame: bytes, stream_id: int) -> Handoff:
    """The handoff frame of stream ``stream_id``, checked (StateDecodeError if malformed)."""
    size = _HANDOFF_HEAD.size + _CRC.size
    if len(frame) < size or frame[:4] != HANDOFF_MAGIC:
        raise StateDecodeError("the stream does not end with a handoff frame (first token)")
    _, frame_stream, blob_len = _HANDOFF_HEAD.unpack_from(frame)
    if len(frame) != size + blob_len:
        raise StateDecodeError(
            f"handoff frame is {len(frame)} bytes, its length says {size + blob_len}"
        )
    (stored,) = _CRC.unpack_from(frame, len(frame) - _CRC.size)
    if zlib.crc32(frame[: -_CRC.size]) != stored:
        raise StateDecodeError("handoff frame checksum mismatch: the frame is corrupt")
    if frame_stream != stream_id:
        raise StateDecodeError("the handoff frame belongs to another state stream")
    try:
        data = json.loads(frame[_HANDOFF_HEAD.size : -_CRC.size].decode("utf-8"))
        first_token, sampling = data["first_token"], SamplingParams(**data["sampling"])
    except (ValueError, TypeError, KeyError, RecursionError, UserError) as err:
        raise StateDecodeError(f"handoff frame JSON is malformed: {err}") from None
    integers = (first_token, sampling.top_k, sampling.seed, sampling.first_index)
    if not all(type(v) is int for v in integers):
        raise StateDecodeError("handoff first_token, top_k, seed and first_index must be integers")
    return Handoff(first_token, sampling)


def split_handoff(frames: Sequence[bytes]) -> tuple[list[bytes], Handoff]:
    """``(state frames, handoff)`` of a stream whose last frame is a handoff frame.

    Only the header of the state is checked here (``codec.decode`` checks the rest).
    """
    header = inspect(frames)
    if len(frames) < 2:
        raise StateDecodeError("the stream has no handoff frame (first token) after its header")
    return list(frames[:-1]), parse_handoff(bytes(frames[-1]), header.stream_id)
