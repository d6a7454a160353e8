"""The state wire codec: ``encode`` one sequence of a ``ModelState`` into frames, ``decode`` them.

Also ``inspect`` (the header, without a model config), ``payload_nbytes`` and a file container
(``write_file`` / ``read_frames``). What travels is the canonical state of model/state.py, so
the payload (the tensor bytes, prefixes excluded) is exactly ``state_nbytes(cfg, L)``. No pickle.
Byte layouts live in ``codec_format``, the state ↔ tensor mapping in ``codec_layout``.

Wire format, version 1 (integers unsigned little-endian; CRC32 = ``zlib.crc32``)
------------------------------------------------------------------------------

A state is a sequence of frames (gRPC messages, or records of a file). Frame 0 is the header::

    offset  size  field
    0       8     magic b"PRFSTATE"
    8       2     format version (1)
    10      2     reserved, 0
    12      8     L: tokens of state
    20      4     T: number of tensors
    24      32    model fingerprint: the raw SHA-256 that ModelConfig.fingerprint() writes in hex
    56      4     N: byte length of the tensor table
    60      N     tensor table, UTF-8 JSON: {"tensors": [row_0, ..., row_{T-1}]}
    60+N    4     CRC32 of bytes [0, 60+N)

    row_i = [layer, kind, name, dtype, shape, token_axis, chunk_bytes, crc32]
        layer        block index            kind   "mla" "gqa" "swa" "kda" "gdn" "lightning"
        name         state field            dtype  "float32" "bfloat16" "float16"
        shape        canonical shape, a list of sizes (C order)
        token_axis   true when axis 0 counts positions (MLA, GQA, SWA)
        chunk_bytes  c: payload bytes per data frame; a multiple of one token row (token_axis)
                     or of the element size; the tensor's last frame may be shorter
        crc32        CRC32 of the whole canonical buffer of the tensor

Every other frame is a data frame::

    0       4     magic b"PRFD"
    4       4     stream tag: the header's CRC32 field (ties the frame to its header)
    8       4     tensor id i (row index in the table)
    12      8     byte offset o in tensor i's canonical buffer; o = k·c for some k ≥ 0
    20      4     n = min(c, nbytes_i − o), payload length
    24      4     CRC32 of bytes [0, 24) followed by the payload
    28      n     payload: bytes [o, o+n) of the canonical buffer, raw little-endian elements

Tensors, in table order (layer by layer, fields in this order):

    MLA        c_kv [L, kv_lora_rank], k_rope [L, qk_rope_head_dim]    model dtype
    GQA        k [L, Hkv, Dk], v [L, Hkv, Dv]                          model dtype
    SWA        k, v [min(L, W), Hkv, D]: positions L−min(L,W) … L−1     model dtype
    KDA, GDN   recurrent [Hv, K, V] state dtype, conv [k−1, C] model dtype
    Lightning  recurrent [H, K, V]                                     state dtype

A tensor of b bytes has exactly ceil(b / c) data frames (none when b = 0). ``encode`` sends the
header, then each tensor's frames by increasing offset. Because every data frame names its
tensor and offset, a receiver can place any frame the moment it arrives: data frames may come
in any order (decoding gives the identical state) and token-axis tensors split on whole tokens,
so a chunked prefill can ship positions [a, b) of a layer as soon as they are final. Each
(tensor, offset) slot must arrive exactly once; duplicates are rejected. The header carries
whole-tensor CRCs, so in version 1 it is written once the state is final; each data frame's own
CRC lets a receiver verify it on arrival. Every frame, the header too, is ≤ ``max_frame_bytes``.

File container: b"PRFSFILE", a u32 container version (1), then per frame a u32 length and the
frame's bytes, until end of file.

``decode`` trusts nothing: it checks magic, version, checksums, the fingerprint against the
config, L against ``max_len``, every table row against the tensors the config implies for L,
every frame's tag, tensor id, offset, length and slot, then that every tensor is complete and
matches its CRC32. Any failure raises ``StateDecodeError`` naming the problem.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterable, Iterator

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.codec_format import (
    DATA_PREFIX_SIZE,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    StateDecodeError,
    StateHeader,
    TensorEntry,
    pack_data,
    pack_header,
    parse_data,
    parse_header,
    stream_tag,
)
from prfaas_jax.engine.codec_layout import (
    TensorSpec,
    build_state,
    canonical_row,
    canonical_tensors,
)
from prfaas_jax.model.state import ModelState

__all__ = [
    "StateDecodeError",
    "StateHeader",
    "TensorEntry",
    "TensorSpec",
    "decode",
    "encode",
    "inspect",
    "payload_nbytes",
    "read_frames",
    "write_file",
]

DEFAULT_MAX_FRAME_BYTES = 4 * 2**20  # gRPC's default message limit
FILE_MAGIC = b"PRFSFILE"
FILE_VERSION = 1
_FILE_HEAD = struct.Struct("<8sI")
_RECORD = struct.Struct("<I")
_NO_FRAME = object()


def encode(
    state: ModelState,
    cfg: ModelConfig,
    *,
    row: int = 0,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Iterator[bytes]:
    """Frames of sequence ``row`` of ``state``: the header, then data frames layer by layer.

    Every frame, the header included, is at most ``max_frame_bytes`` long. The state is checked
    and read eagerly (ValueError if it does not fit ``cfg``); frames are built as iterated.
    """
    length, tensors = canonical_row(state, cfg, row)
    room = min(max_frame_bytes - DATA_PREFIX_SIZE, MAX_CHUNK_BYTES)
    entries, buffers = [], []
    for spec, buffer in tensors:
        chunk = room // spec.unit_bytes * spec.unit_bytes
        if chunk < 1:
            raise ValueError(
                f"max_frame_bytes={max_frame_bytes} cannot fit one {spec.unit_bytes}-byte unit of "
                f"layer {spec.layer} {spec.name} after the {DATA_PREFIX_SIZE}-byte frame prefix"
            )
        entries.append(TensorEntry(spec, chunk, zlib.crc32(buffer)))
        buffers.append(buffer)
    header = StateHeader(FORMAT_VERSION, cfg.fingerprint(), length, tuple(entries))
    header_frame = pack_header(header)
    if len(header_frame) > max_frame_bytes:
        raise ValueError(
            f"max_frame_bytes={max_frame_bytes} is smaller than the {len(header_frame)}-byte header"
        )
    return _frames(header_frame, entries, buffers)


def _frames(
    header_frame: bytes, entries: list[TensorEntry], buffers: list[bytes]
) -> Iterator[bytes]:
    yield header_frame
    tag = stream_tag(header_frame)
    for tid, (entry, buffer) in enumerate(zip(entries, buffers, strict=True)):
        view = memoryview(buffer)
        for offset in range(0, len(buffer), entry.chunk_bytes):
            yield pack_data(tag, tid, offset, view[offset : offset + entry.chunk_bytes])


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


def decode(frames: Iterable[bytes], cfg: ModelConfig, *, max_len: int | None = None) -> ModelState:
    """Rebuild a batch-1 ``ModelState`` from ``encode``'s frames (data frames in any order).

    Growing caches get capacity ``max_len`` (default: L, at least 1), zeros beyond L; SWA rings
    get ``window_capacity(W, max_len)`` slots with position p in slot p mod ring size. A state
    longer than ``max_len`` (default: the model's ``cfg.max_len``) is rejected before any
    buffer is allocated.
    """
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be ≥ 1, got {max_len}")
    stream = iter(frames)
    first = next(stream, _NO_FRAME)
    if first is _NO_FRAME:
        raise StateDecodeError("no frames: a state stream starts with a header frame")
    header_view = _view(first, 0)
    header = parse_header(header_view)
    _check_header(header, cfg, max_len)
    tag = stream_tag(header_view)
    entries = header.tensors
    buffers = [bytearray(entry.spec.nbytes) for entry in entries]
    seen: list[set[int]] = [set() for _ in entries]
    for index, frame in enumerate(stream, start=1):
        data = parse_data(_view(frame, index), index)
        if data.tag != tag:
            raise StateDecodeError(
                f"data frame {index} belongs to another state stream (tag {data.tag:#010x}, "
                f"this header's is {tag:#010x})"
            )
        if data.tensor_id >= len(entries):
            raise StateDecodeError(
                f"data frame {index} names tensor {data.tensor_id}; the header has {len(entries)}"
            )
        entry, offset = entries[data.tensor_id], data.offset
        where = f"data frame {index} (tensor {data.tensor_id}, offset {offset})"
        if offset >= entry.spec.nbytes or offset % entry.chunk_bytes:
            raise StateDecodeError(
                f"{where} is out of range or off the {entry.chunk_bytes}-byte chunk grid of a "
                f"{entry.spec.nbytes}-byte tensor"
            )
        size = min(entry.chunk_bytes, entry.spec.nbytes - offset)
        if len(data.payload) != size:
            raise StateDecodeError(f"{where} carries {len(data.payload)} bytes, expected {size}")
        if offset in seen[data.tensor_id]:
            raise StateDecodeError(f"{where} is a duplicate: that chunk already arrived")
        seen[data.tensor_id].add(offset)
        buffers[data.tensor_id][offset : offset + size] = data.payload
    for tid, entry in enumerate(entries):
        spec = entry.spec
        if len(seen[tid]) != entry.num_frames:
            raise StateDecodeError(
                f"stream ended early: tensor {tid} (layer {spec.layer} {spec.name}) has "
                f"{len(seen[tid])} of its {entry.num_frames} data frames"
            )
        if zlib.crc32(buffers[tid]) != entry.crc32:
            raise StateDecodeError(f"tensor {tid} (layer {spec.layer} {spec.name}) fails its CRC32")
    capacity = max(header.length, 1) if max_len is None else max_len
    tensors = [(entry.spec, buffer) for entry, buffer in zip(entries, buffers, strict=True)]
    return build_state(cfg, header.length, tensors, capacity)


def inspect(frames: Iterable[bytes]) -> StateHeader:
    """The header of an encoded state (first frame only; checked for structure, not a model)."""
    first = next(iter(frames), _NO_FRAME)
    if first is _NO_FRAME:
        raise StateDecodeError("no frames: a state stream starts with a header frame")
    return parse_header(_view(first, 0))


def payload_nbytes(frames: Iterable[bytes]) -> int:
    """Tensor bytes carried by the data frames of a stream (each frame's structure and CRC are
    checked; the header is parsed but not matched to a model)."""
    total = 0
    for index, frame in enumerate(frames):
        if index == 0:
            parse_header(_view(frame, 0))
        else:
            total += len(parse_data(_view(frame, index), index).payload)
    return total


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
