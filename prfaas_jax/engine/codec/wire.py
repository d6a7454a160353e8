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
``stream``, the file container in ``file``.

``decode`` trusts nothing: magic, version, checksums, fingerprint, L against ``max_len``, the
tensor table against the config, every frame's stream id, tensor, offset, length and slot, the
trailer last, completeness. Any failure raises ``StateDecodeError`` naming the problem.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.codec.checksum import crc32_combine
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
from prfaas_jax.engine.codec.layout import (
    KvPrefix,
    StateBuffers,
    TensorSpec,
    canonical_tensors,
    row_length,
    wire_view,
)
from prfaas_jax.engine.codec.stream import DEFAULT_MAX_FRAME_BYTES, StreamEncoder
from prfaas_jax.model.state import ModelState

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "KvPrefix",
    "StateDecodeError",
    "StateHeader",
    "StateTrailer",
    "StreamEncoder",
    "TensorEntry",
    "TensorSpec",
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
) -> Iterator[bytes]:
    """Frames of sequence ``row`` of ``state``: header, data frames layer by layer, trailer.

    ``StreamEncoder`` in one go (``stream_id``: random unless given; ``base``: leading positions
    of the growing caches left out, which the receiver holds). Every frame is at most
    ``max_frame_bytes`` long. The state is checked and read eagerly (ValueError if it does not
    fit ``cfg``); frames are built as iterated.
    """
    _, length = row_length(state, row)
    encoder = StreamEncoder(
        cfg, length, max_frame_bytes=max_frame_bytes, stream_id=stream_id, base=base
    )
    return itertools.chain([encoder.header()], encoder.finish(state, row=row))


def _view(frame: object, index: int) -> memoryview:
    try:
        return memoryview(frame).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise StateDecodeError(
            f"frame {index} is a {type(frame).__name__}, not a contiguous bytes-like object"
        ) from None


def _check_header(header: StateHeader, cfg: ModelConfig, max_len: int | None) -> None:
    expected = cfg.fingerprint()
    if header.fingerprint != expected:
        raise StateDecodeError(
            f"model fingerprint mismatch: the config {cfg.name!r} expects {expected}, the state "
            f"was encoded for {header.fingerprint}"
        )
    limit = cfg.max_len if max_len is None else max_len
    if header.length > limit:
        what = "the model's max_len" if max_len is None else "max_len"
        raise StateDecodeError(f"state holds {header.length} tokens, more than {what} ({limit})")
    specs = canonical_tensors(cfg, header.length)
    if len(header.tensors) != len(specs):
        raise StateDecodeError(
            f"header lists {len(header.tensors)} tensors; {cfg.name!r} at L={header.length} "
            f"has {len(specs)}"
        )
    for tid, (entry, spec) in enumerate(zip(header.tensors, specs, strict=True)):
        if entry.spec != spec:
            raise StateDecodeError(
                f"header tensor {tid} is {entry.spec}, but {cfg.name!r} at L={header.length} "
                f"implies {spec}"
            )


def decode(
    frames: Iterable[bytes],
    cfg: ModelConfig,
    *,
    max_len: int | None = None,
    base: KvPrefix | None = None,
) -> ModelState:
    """Rebuild a batch-1 ``ModelState`` from ``encode``'s frames (data frames in any order).

    Growing caches get capacity ``max_len`` (default: L, at least 1), zeros beyond L; SWA rings
    get ``window_capacity(W, max_len)`` slots with position p in slot p mod ring size. A state
    longer than ``max_len`` (default: the model's ``cfg.max_len``) is rejected before any
    buffer is allocated. A stream whose header has a ``base`` (an increment) needs ``base``,
    the receiver's rows of those positions, of exactly that length.
    """
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be ≥ 1, got {max_len}")
    stream = iter(frames)
    header = _first_header(stream)
    _check_header(header, cfg, max_len)
    held = 0 if base is None else base.length
    if header.base != held:
        raise StateDecodeError(
            f"the stream leaves out the first {header.base} positions of its KV caches, but "
            f"the receiver holds {held} of them"
        )
    entries = header.tensors
    capacity = max(header.length, 1) if max_len is None else max_len
    # Each frame's payload is copied once, straight into the state field that keeps it.
    buffers = StateBuffers(cfg, header.length, capacity)
    targets = [_bytes_of(buffers.canonical(tid)) for tid in range(len(entries))]
    # Per tensor, the CRC32 of each data frame's payload, by frame number.
    crcs: list[list[int | None]] = [[None] * entry.num_frames for entry in entries]
    trailer, trailer_index = None, 0
    for index, frame in enumerate(stream, start=1):
        view = _view(frame, index)
        if trailer is not None:
            raise StateDecodeError(
                f"frame {index} follows the trailer (frame {trailer_index}), which ends a state "
                "stream: trailing garbage"
            )
        if is_trailer(view):
            trailer, trailer_index = _trailer_of(header, view, index), index
            continue
        data = parse_data(view, index)
        _check_stream(header, data.stream_id, f"data frame {index}")
        if data.tensor_id >= len(entries):
            raise StateDecodeError(
                f"data frame {index} names tensor {data.tensor_id}; the header has {len(entries)}"
            )
        entry, offset = entries[data.tensor_id], data.offset
        where = f"data frame {index} (tensor {data.tensor_id}, offset {offset})"
        skip = entry.skip_bytes
        if not skip <= offset < entry.spec.nbytes or (offset - skip) % entry.chunk_bytes:
            raise StateDecodeError(
                f"{where} is out of range or off the {entry.chunk_bytes}-byte chunk grid of a "
                f"{entry.spec.nbytes}-byte tensor" + (f" from byte {skip}" if skip else "")
            )
        size = min(entry.chunk_bytes, entry.spec.nbytes - offset)
        if len(data.payload) != size:
            raise StateDecodeError(f"{where} carries {len(data.payload)} bytes, expected {size}")
        slot = (offset - skip) // entry.chunk_bytes
        if crcs[data.tensor_id][slot] is not None:
            raise StateDecodeError(f"{where} is a duplicate: that chunk already arrived")
        crcs[data.tensor_id][slot] = data.payload_crc
        targets[data.tensor_id][offset : offset + size] = data.payload
    for tid, entry in enumerate(entries):
        spec, arrived = entry.spec, sum(crc is not None for crc in crcs[tid])
        if arrived != entry.num_frames:
            raise StateDecodeError(
                f"stream ended early: tensor {tid} (layer {spec.layer} {spec.name}) has "
                f"{arrived} of its {entry.num_frames} data frames"
            )
    if trailer is None:
        raise StateDecodeError(
            "stream ended early: no trailer frame (it follows the last data frame)"
        )
    for tid, entry in enumerate(entries):
        if _tensor_crc(entry, crcs[tid]) != trailer.crc32s[tid]:
            spec = entry.spec
            raise StateDecodeError(f"tensor {tid} (layer {spec.layer} {spec.name}) fails its CRC32")
        if entry.skip_bytes:
            targets[tid][: entry.skip_bytes] = _base_rows(entry.spec, base)
        if sys.byteorder == "big":  # the wire is little-endian
            raw = buffers.canonical(tid).view(f"u{entry.spec.itemsize}")
            raw.byteswap(inplace=True)
    return buffers.state()


def _bytes_of(array: np.ndarray) -> memoryview:
    """A writable byte view of a C-contiguous array."""
    return memoryview(array.view(np.uint8).reshape(-1))


def _tensor_crc(entry: TensorEntry, frame_crcs: list[int | None]) -> int:
    """CRC32 of the bytes a tensor's frames carry, combined from their payloads' CRCs."""
    crc, remaining = 0, entry.spec.nbytes - entry.skip_bytes
    for frame_crc in frame_crcs:
        size = min(entry.chunk_bytes, remaining)
        crc, remaining = crc32_combine(crc, frame_crc, size), remaining - size
    return crc


def _base_rows(spec: TensorSpec, base: KvPrefix | None) -> bytes:
    """The receiver's bytes of the positions a stream left out of tensor ``spec``."""
    assert base is not None  # decode checked that the receiver holds the header's base
    rows = base.rows.get((spec.layer, spec.name))
    expected = (base.length, *spec.shape[1:])
    if rows is None or rows.shape != expected or rows.dtype.name != spec.dtype:
        got = "nothing" if rows is None else f"{rows.dtype.name}{list(rows.shape)}"
        raise StateDecodeError(
            f"the receiver's rows of layer {spec.layer} {spec.name} are {got}, the stream "
            f"needs {spec.dtype}{list(expected)}"
        )
    return wire_view(rows)


def _first_header(stream: Iterator[object]) -> StateHeader:
    first = next(stream, _NO_FRAME)
    if first is _NO_FRAME:
        raise StateDecodeError("no frames: a state stream starts with a header frame")
    return parse_header(_view(first, 0))


def _check_stream(header: StateHeader, stream_id: int, where: str) -> None:
    if stream_id != header.stream_id:
        raise StateDecodeError(
            f"{where} belongs to another state stream (stream id {stream_id:016x}, this "
            f"header's is {header.stream_id:016x})"
        )


def _trailer_of(header: StateHeader, view: memoryview, index: int) -> StateTrailer:
    trailer = parse_trailer(view, index)
    _check_stream(header, trailer.stream_id, f"trailer frame {index}")
    if len(trailer.crc32s) != len(header.tensors):
        raise StateDecodeError(
            f"trailer frame {index} lists {len(trailer.crc32s)} tensor CRCs; the header has "
            f"{len(header.tensors)} tensors"
        )
    return trailer


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
    view = _view(frames[index], index)
    if not is_trailer(view):
        raise StateDecodeError(f"stream ended early: its last frame ({index}) is not the trailer")
    return _trailer_of(header, view, index)


def payload_nbytes(frames: Iterable[bytes]) -> int:
    """Tensor bytes carried by the data frames of a stream (each frame's structure and CRC are
    checked; the header is parsed but not matched to a model)."""
    total = 0
    for index, frame in enumerate(frames):
        view = _view(frame, index)
        if index == 0:
            parse_header(view)
        elif is_trailer(view):
            parse_trailer(view, index)
        else:
            total += len(parse_data(view, index).payload)
    return total
