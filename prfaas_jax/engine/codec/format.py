"""Byte layouts of the state wire format (specified in docs/wire-format.md).

The header (``StateHeader``, ``pack_header`` / ``parse_header``), the data-frame prefix
(``pack_data`` / ``parse_data``) and the trailer (``StateTrailer``, ``pack_trailer`` /
``parse_trailer``), with the error they raise (``StateDecodeError``). Parsers check structure
and checksums only; whether a header fits a given model is ``codec.decode``'s job (it compares
the table with ``layout.canonical_tensors``), as is matching frames to their stream.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any, NoReturn

from prfaas_jax.config import LayerKind
from prfaas_jax.engine.codec import precision
from prfaas_jax.engine.codec.checksum import crc32, crc32_combine
from prfaas_jax.engine.codec.layout import TensorSpec
from prfaas_jax.errors import UserError

HEADER_MAGIC = b"PRFSTATE"
DATA_MAGIC = b"PRFD"
TRAILER_MAGIC = b"PRFT"
FORMAT_VERSION = 2

# magic, version, reserved, stream id, token count, tensor count, fingerprint (sha256), JSON length
_HEADER = struct.Struct("<8sHHQQI32sI")
_CRC = struct.Struct("<I")
# magic, stream id, tensor id, byte offset, payload length; then the frame's CRC32
_DATA_HEAD = struct.Struct("<4sQIQI")
# magic, stream id, tensor count; then one CRC32 per tensor and the frame's CRC32
_TRAILER_HEAD = struct.Struct("<4sQI")
HEADER_FIXED_SIZE = _HEADER.size  # the tensor table starts here
DATA_PREFIX_SIZE = _DATA_HEAD.size + _CRC.size
HEADER_OVERHEAD = _HEADER.size + _CRC.size
MAX_CHUNK_BYTES = 2**32 - 1  # the payload length field is a u32
MAX_STREAM_ID = 2**64 - 1

_COLUMNS = ("layer", "kind", "name", "dtype", "shape", "token_axis", "chunk_bytes")
_KINDS = {kind.value: kind for kind in LayerKind}
_DTYPES = ("float32", "bfloat16", "float16")


class StateDecodeError(UserError, ValueError):
    """Bytes that claim to be an encoded model state are malformed or belong to another model."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """A row of the header's tensor table: the tensor and how its data frames cut it."""

    spec: TensorSpec
    chunk_bytes: int  # every data frame of the tensor but the last carries exactly this many
    # Leading bytes the stream does not carry (the receiver holds them: the header's ``base``
    # rows of a growing cache); frames are cut from here on.
    skip_bytes: int = 0
    wire: str = precision.NATIVE  # how its elements travel (engine/codec/precision.py)

    @property
    def nbytes(self) -> int:
        """The tensor's bytes on the wire (``spec.nbytes`` unless a narrower encoding)."""
        return precision.nbytes(self.spec, self.wire)

    @property
    def unit_bytes(self) -> int:
        """Wire bytes of one token row, element or scaled vector: chunks are multiples of it."""
        return precision.unit_bytes(self.spec, self.wire)

    @property
    def num_frames(self) -> int:
        return -(-(self.nbytes - self.skip_bytes) // self.chunk_bytes)

    @property
    def first_row(self) -> int:
        """The first token row the stream carries (0 but for a growing cache after a base)."""
        return self.skip_bytes // self.unit_bytes if self.spec.token_axis else 0

    @property
    def frame_rows(self) -> int:
        """Token rows per data frame of a token-axis tensor (the grid frames are cut on)."""
        return self.chunk_bytes // self.unit_bytes


@dataclasses.dataclass(frozen=True)
class StateHeader:
    """Frame 0 of an encoded state: version, model, stream id, token count and tensor table."""

    version: int
    fingerprint: str  # hex SHA-256 of the model config (ModelConfig.fingerprint)
    stream_id: int  # random u64 that every later frame of the stream repeats
    length: int  # tokens of state (L)
    tensors: tuple[TensorEntry, ...]
    # Positions of every growing cache (MLA, GQA) the stream leaves out: the receiver already
    # holds them (an increment on a cached prefix). 0: the whole state.
    base: int = 0

    @property
    def payload_nbytes(self) -> int:
        """Tensor bytes the stream carries (the base's rows excluded)."""
        return sum(entry.nbytes - entry.skip_bytes for entry in self.tensors)

    @property
    def num_data_frames(self) -> int:
        return sum(entry.num_frames for entry in self.tensors)

    @property
    def num_frames(self) -> int:
        """Frames of the whole stream: header, data frames, trailer."""
        return self.num_data_frames + 2

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary with stable keys (for ``--json`` output)."""
        table = [
            {
                "id": tid,
                **dict(zip(_COLUMNS, _row(entry)[: len(_COLUMNS)], strict=True)),
                "nbytes": entry.spec.nbytes,
                "wire": entry.wire,
                "wire_nbytes": entry.nbytes,
                "num_frames": entry.num_frames,
            }
            for tid, entry in enumerate(self.tensors)
        ]
        return {
            "version": self.version,
            "fingerprint": self.fingerprint,
            # A string: a u64 does not survive JSON readers that parse numbers as doubles.
            "stream_id": f"{self.stream_id:016x}",
            "length": self.length,
            "base": self.base,
            "payload_nbytes": self.payload_nbytes,
            "num_frames": self.num_frames,
            "tensors": table,
        }


def _row(entry: TensorEntry) -> list[Any]:
    """A tensor-table row, in ``_COLUMNS`` order; an encoding other than native is an eighth
    field (a native row is what it has always been)."""
    s = entry.spec
    row = [s.layer, s.kind.value, s.name, s.dtype, list(s.shape), s.token_axis, entry.chunk_bytes]
    return row if entry.wire == precision.NATIVE else [*row, entry.wire]


def pack_header(header: StateHeader) -> bytes:
    rows = [_row(entry) for entry in header.tensors]
    table: dict[str, Any] = {"tensors": rows}
    if header.base:
        table["base"] = header.base
    blob = json.dumps(table, separators=(",", ":")).encode()
    fixed = _HEADER.pack(
        HEADER_MAGIC,
        header.version,
        0,
        header.stream_id,
        header.length,
        len(header.tensors),
        bytes.fromhex(header.fingerprint),
        len(blob),
    )
    body = fixed + blob
    return body + _CRC.pack(crc32(body))


def _fail(message: str) -> NoReturn:
    raise StateDecodeError(message)


def _reject_constant(name: str) -> NoReturn:
    _fail(f"header JSON contains {name}, which is not valid JSON")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        _fail(f"header JSON object has duplicate keys {sorted(keys)}")
    return dict(pairs)


def _is_int(value: Any, low: int, high: int) -> bool:
    # bool is an int subclass; `true` must not pass for a number.
    return type(value) is int and low <= value <= high


def _parse_entry(tid: int, row: Any) -> TensorEntry:
    where = f"header tensor {tid}"
    if type(row) is not list or len(row) not in (len(_COLUMNS), len(_COLUMNS) + 1):
        _fail(
            f"{where}: expected a list of {len(_COLUMNS)} fields {list(_COLUMNS)} (and a wire "
            f"encoding), got {row!r:.80}"
        )
    layer, kind, name, dtype, shape, token_axis, chunk_bytes = row[: len(_COLUMNS)]
    wire = row[len(_COLUMNS)] if len(row) > len(_COLUMNS) else precision.NATIVE
    if not _is_int(layer, 0, 2**31):
        _fail(f"{where}: layer must be a non-negative integer, got {layer!r:.40}")
    if type(kind) is not str or kind not in _KINDS:
        _fail(f"{where}: kind must be one of {sorted(_KINDS)}, got {kind!r:.40}")
    if type(name) is not str:
        _fail(f"{where}: name must be a string, got {name!r:.40}")
    if type(dtype) is not str or dtype not in _DTYPES:
        _fail(f"{where}: dtype must be one of {list(_DTYPES)}, got {dtype!r:.40}")
    if type(shape) is not list or len(shape) > 8 or not all(_is_int(d, 0, 2**48) for d in shape):
        _fail(f"{where}: shape must be a list of at most 8 sizes ≥ 0, got {shape!r:.80}")
    if type(token_axis) is not bool:
        _fail(f"{where}: token_axis must be true or false, got {token_axis!r:.40}")
    if not _is_int(chunk_bytes, 1, MAX_CHUNK_BYTES):
        _fail(f"{where}: chunk_bytes must be an integer in [1, 2**32), got {chunk_bytes!r:.40}")
    lossy = [e for e in precision.ENCODINGS if e != precision.NATIVE]
    if len(row) > len(_COLUMNS) and (type(wire) is not str or wire not in lossy):
        _fail(f"{where}: wire encoding must be one of {lossy}, got {wire!r:.40}")
    if not precision.valid_for(dtype, wire):
        _fail(f"{where}: a {dtype} tensor cannot travel as {wire}")
    if precision.is_scaled(wire) and len(shape) < 1 + token_axis:
        _fail(f"{where}: a {wire} tensor needs an axis to scale along, got shape {shape}")
    spec = TensorSpec(layer, _KINDS[kind], name, dtype, tuple(shape), token_axis)
    entry = TensorEntry(spec, chunk_bytes, wire=wire)
    if token_axis and (not shape or entry.unit_bytes == 0):
        _fail(f"{where}: a token-axis tensor needs a non-empty token row, got shape {shape}")
    if entry.unit_bytes and chunk_bytes % entry.unit_bytes:
        unit = "token row" if token_axis else "element"
        unit = "vector" if precision.is_scaled(wire) and not token_axis else unit
        _fail(
            f"{where}: chunk_bytes {chunk_bytes} is not a multiple of the "
            f"{entry.unit_bytes}-byte {unit}"
        )
    return entry


def parse_header(frame: memoryview) -> StateHeader:
    """Parse and self-check the first frame (structure and CRC; no model knowledge)."""
    if bytes(frame[: len(DATA_MAGIC)]) in (DATA_MAGIC, TRAILER_MAGIC):
        kind = "data" if bytes(frame[: len(DATA_MAGIC)]) == DATA_MAGIC else "trailer"
        _fail(f"frame 0 is a {kind} frame; a state stream must start with its header frame")
    if len(frame) < HEADER_OVERHEAD:
        _fail(f"header frame truncated: {len(frame)} bytes, a header needs ≥ {HEADER_OVERHEAD}")
    magic, version, reserved, stream_id, length, count, digest, blob_len = _HEADER.unpack_from(
        frame
    )
    if magic != HEADER_MAGIC:
        _fail(f"bad magic {magic!r} in frame 0: not a PrfaaS state (expected {HEADER_MAGIC!r})")
    if version != FORMAT_VERSION:
        _fail(f"unsupported state format version {version}; this build reads {FORMAT_VERSION}")
    expected = HEADER_OVERHEAD + blob_len
    if len(frame) < expected:
        _fail(f"header frame truncated: {len(frame)} bytes, its lengths say {expected}")
    if len(frame) > expected:
        _fail(f"header frame has {len(frame) - expected} trailing bytes after its checksum")
    (stored,) = _CRC.unpack_from(frame, expected - _CRC.size)
    if crc32(frame[: expected - _CRC.size]) != stored:
        _fail("header frame checksum mismatch: the header is corrupt")
    if reserved != 0:
        _fail(f"header reserved field is {reserved}, expected 0")
    try:
        table = json.loads(
            bytes(frame[_HEADER.size : expected - _CRC.size]).decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        if isinstance(err, StateDecodeError):
            raise
        raise StateDecodeError(f"header tensor table is not valid UTF-8 JSON: {err}") from None
    if (
        type(table) is not dict
        or set(table) not in ({"tensors"}, {"tensors", "base"})
        or type(table["tensors"]) is not list
    ):
        _fail('header tensor table must be a JSON object {"tensors": [...]} (and "base": n)')
    base = table.get("base", 0)
    if "base" in table and not _is_int(base, 1, length):
        _fail(f"header base must be an integer in [1, L={length}], got {base!r:.40}")
    rows = table["tensors"]
    if len(rows) != count:
        _fail(f"header says {count} tensors but its table lists {len(rows)}")
    tensors = tuple(with_base(_parse_entry(tid, row), base) for tid, row in enumerate(rows))
    return StateHeader(version, digest.hex(), stream_id, length, tensors, base)


def with_base(entry: TensorEntry, base: int) -> TensorEntry:
    """``entry`` of a stream that leaves out the first ``base`` rows of every growing cache."""
    if not (base and entry.spec.kind.has_growing_state):
        return entry
    return dataclasses.replace(entry, skip_bytes=base * entry.unit_bytes)


@dataclasses.dataclass(frozen=True)
class DataFrame:
    stream_id: int  # the stream id of the header this data belongs to
    tensor_id: int
    offset: int  # byte offset of the payload in the tensor's canonical buffer
    payload: memoryview
    payload_crc: int  # crc32(payload): a tensor's CRC is its frames' combined


class FrameParts:
    """A data frame as its prefix and a view of its payload, for a sender that writes the two
    without joining them (`sendmsg`); ``bytes(parts)`` is the frame. ``len`` and slices
    within the prefix read no payload byte."""

    __slots__ = ("payload", "prefix")

    def __init__(self, prefix: bytes, payload: memoryview) -> None:
        self.prefix, self.payload = prefix, payload

    def __len__(self) -> int:
        return len(self.prefix) + self.payload.nbytes

    def __bytes__(self) -> bytes:
        return b"".join((self.prefix, self.payload))  # one copy of the payload

    def __getitem__(self, key: slice) -> bytes:
        start, stop, step = key.indices(len(self))
        if step == 1 and stop <= len(self.prefix):
            return self.prefix[start:stop]
        return bytes(self)[key]


def data_parts(
    stream_id: int,
    tensor_id: int,
    offset: int,
    payload: bytes | memoryview,
    payload_crc: int | None = None,
) -> FrameParts:
    """A data frame as `FrameParts`, its payload not copied; ``payload_crc`` is
    ``crc32(payload)`` when the caller has it already."""
    payload = memoryview(payload).cast("B")
    head = _DATA_HEAD.pack(DATA_MAGIC, stream_id, tensor_id, offset, len(payload))
    if payload_crc is None:
        payload_crc = crc32(payload)
    crc = crc32_combine(crc32(head), payload_crc, len(payload))
    return FrameParts(head + _CRC.pack(crc), payload)


def pack_data(
    stream_id: int,
    tensor_id: int,
    offset: int,
    payload: bytes | memoryview,
    payload_crc: int | None = None,
) -> bytes:
    """A data frame; ``payload_crc`` is ``crc32(payload)`` when the caller has it already."""
    return bytes(data_parts(stream_id, tensor_id, offset, payload, payload_crc))


def parse_data(frame: memoryview, index: int) -> DataFrame:
    """Parse and self-check data frame number ``index`` (structure and CRC)."""
    if bytes(frame[: len(HEADER_MAGIC)]) == HEADER_MAGIC:
        _fail(f"frame {index} is a second header frame; only frame 0 may be a header")
    if len(frame) < DATA_PREFIX_SIZE:
        _fail(
            f"data frame {index} truncated: {len(frame)} bytes, its prefix needs {DATA_PREFIX_SIZE}"
        )
    magic, stream_id, tensor_id, offset, size = _DATA_HEAD.unpack_from(frame)
    (stored,) = _CRC.unpack_from(frame, _DATA_HEAD.size)
    if magic != DATA_MAGIC:
        _fail(
            f"bad magic {magic!r} in frame {index}: expected a data frame ({DATA_MAGIC!r}) or "
            f"the trailer ({TRAILER_MAGIC!r})"
        )
    got = len(frame) - DATA_PREFIX_SIZE
    if got < size:
        _fail(f"data frame {index} truncated: payload has {got} of its {size} bytes")
    if got > size:
        _fail(f"data frame {index} has {got - size} trailing bytes after its {size}-byte payload")
    payload = frame[DATA_PREFIX_SIZE:]
    payload_crc = checked_payload_crc(frame, payload, stored, index)
    return DataFrame(stream_id, tensor_id, offset, payload, payload_crc)


def data_prefix(prefix: memoryview) -> tuple[int, int, int, int, int] | None:
    """The fields of a data frame's prefix — stream id, tensor id, offset, payload size and the
    frame's stored CRC — or None when ``prefix`` does not start with a data frame's magic and a
    whole prefix. Nothing else is checked."""
    if len(prefix) < DATA_PREFIX_SIZE:
        return None
    magic, stream_id, tensor_id, offset, size = _DATA_HEAD.unpack_from(prefix)
    if magic != DATA_MAGIC:
        return None
    (stored,) = _CRC.unpack_from(prefix, _DATA_HEAD.size)
    return stream_id, tensor_id, offset, size, stored


def checked_payload_crc(prefix: memoryview, payload: object, stored: int, index: int) -> int:
    """``crc32(payload)``, once the frame's CRC (over its prefix's head and ``payload``) is
    found to be ``stored``; `StateDecodeError` otherwise."""
    payload_crc = crc32(payload)
    size = memoryview(payload).nbytes  # type: ignore[arg-type]
    if crc32_combine(crc32(prefix[: _DATA_HEAD.size]), payload_crc, size) != stored:
        _fail(f"data frame {index} checksum mismatch: the frame is corrupt")
    return payload_crc


@dataclasses.dataclass(frozen=True)
class StateTrailer:
    """The last frame of an encoded state: the CRC32 of every tensor's bytes the stream carries
    (its whole canonical buffer, less a base's rows)."""

    stream_id: int
    crc32s: tuple[int, ...]  # in tensor-table order


def trailer_nbytes(num_tensors: int) -> int:
    return _TRAILER_HEAD.size + (num_tensors + 1) * _CRC.size


def is_trailer(frame: memoryview) -> bool:
    return bytes(frame[: len(TRAILER_MAGIC)]) == TRAILER_MAGIC


def pack_trailer(trailer: StateTrailer) -> bytes:
    count = len(trailer.crc32s)
    body = _TRAILER_HEAD.pack(TRAILER_MAGIC, trailer.stream_id, count)
    body += struct.pack(f"<{count}I", *trailer.crc32s)
    return body + _CRC.pack(crc32(body))


def parse_trailer(frame: memoryview, index: int) -> StateTrailer:
    """Parse and self-check frame number ``index`` as the trailer (structure and CRC)."""
    where = f"trailer frame {index}"
    if not is_trailer(frame):
        _fail(f"frame {index} is not a trailer frame (no {TRAILER_MAGIC!r} magic)")
    if len(frame) < trailer_nbytes(0):
        _fail(f"{where} truncated: {len(frame)} bytes, a trailer needs ≥ {trailer_nbytes(0)}")
    _, stream_id, count = _TRAILER_HEAD.unpack_from(frame)
    expected = trailer_nbytes(count)
    if len(frame) < expected:
        _fail(f"{where} truncated: {len(frame)} bytes, its {count} tensor CRCs need {expected}")
    if len(frame) > expected:
        _fail(f"{where} has {len(frame) - expected} trailing bytes after its checksum")
    (stored,) = _CRC.unpack_from(frame, expected - _CRC.size)
    if crc32(frame[: expected - _CRC.size]) != stored:
        _fail(f"{where} checksum mismatch: the trailer is corrupt")
    crc32s = struct.unpack_from(f"<{count}I", frame, _TRAILER_HEAD.size)
    return StateTrailer(stream_id, crc32s)
