"""The state file container: ``write_file`` and ``read_frames`` (spec: docs/wire-format.md).

A file holds the frames of one state stream (and, from ``prfaas prefill``, its handoff frame):
b"PRFSFILE", a u32 container version, then per frame a u32 length and the frame's bytes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable

from prfaas_jax.engine.codec.format import StateDecodeError

FILE_MAGIC = b"PRFSFILE"
FILE_VERSION = 1
_FILE_HEAD = struct.Struct("<8sI")
_RECORD = struct.Struct("<I")


def write_file(path: str | os.PathLike[str], frames: Iterable[bytes]) -> int:
    """Write frames to a file container (module docstring); returns the bytes written."""
    with open(path, "wb") as fh:
        written = fh.write(_FILE_HEAD.pack(FILE_MAGIC, FILE_VERSION))
        for frame in frames:
            written += fh.write(_RECORD.pack(len(frame))) + fh.write(frame)
    return written


def read_frames(path: str | os.PathLike[str]) -> list[bytes]:
    """The frames of a file container; ``StateDecodeError`` if the container is malformed."""
    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < _FILE_HEAD.size or data[: len(FILE_MAGIC)] != FILE_MAGIC:
        raise StateDecodeError(f"{path} is not a PrfaaS state file (no {FILE_MAGIC!r} magic)")
    _, version = _FILE_HEAD.unpack_from(data)
    if version != FILE_VERSION:
        raise StateDecodeError(f"{path}: unsupported container version {version}")
    frames, pos = [], _FILE_HEAD.size
    while pos < len(data):
        if len(data) - pos < _RECORD.size:
            raise StateDecodeError(f"{path} is truncated inside a frame length at byte {pos}")
        (size,) = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        if len(data) - pos < size:
            raise StateDecodeError(f"{path} is truncated: a {size}-byte frame at byte {pos}")
        frames.append(data[pos : pos + size])
        pos += size
    return frames
