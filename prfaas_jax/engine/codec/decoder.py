"""``StreamDecoder``: a state rebuilt from its frames as they arrive (docs/wire-format.md).

``feed`` takes the frames one at a time, in stream order: the header first, data frames in any
order, the trailer last. Each data frame is checked and its payload copied at once into the
state field that keeps it (``layout.StateBuffers``) — or, for a tensor sent in a narrower
encoding (``precision``), into a buffer of its wire bytes — so a receiver need not hold the
frames: the buffer a frame arrived in can be reused for the next. ``finish`` checks completeness
and every tensor's CRC32 (combined from its payloads' CRCs), lays in the receiver's base rows of
an increment, restores narrower tensors to the model's dtype (refusing bad scales), and returns
the state. ``codec.decode`` is this decoder fed a whole stream.

Nothing is trusted: magic, version, checksums, fingerprint, L against ``max_len``, the tensor
table against the config, every frame's stream id, tensor, offset, length and slot, the trailer
last, completeness. Any failure raises ``StateDecodeError`` naming the problem.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.codec import precision
from prfaas_jax.engine.codec.checksum import crc32_combine
from prfaas_jax.engine.codec.format import (
    DATA_PREFIX_SIZE,
    StateDecodeError,
    StateHeader,
    StateTrailer,
    TensorEntry,
    checked_payload_crc,
    data_prefix,
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
    wire_view,
)
from prfaas_jax.model.state import ModelState


class StreamDecoder:
    """One state stream's frames in, its ``ModelState`` out (module docstring).

    Growing caches get capacity ``max_len`` (default: L, at least 1), zeros beyond L; SWA rings
    get ``window_capacity(W, max_len)`` slots with position p in slot p mod ring size. A state
    longer than ``max_len`` (default: the model's ``cfg.max_len``) is rejected at its header,
    before any buffer is allocated.
    """

    def __init__(self, cfg: ModelConfig, *, max_len: int | None = None) -> None:
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be ≥ 1, got {max_len}")
        self.cfg, self.max_len = cfg, max_len
        self.header: StateHeader | None = None
        self.frames = 0  # fed so far
        self._trailer: StateTrailer | None = None
        self._trailer_index = 0

    def feed(self, frame: object) -> None:
        """Check frame number ``self.frames`` of the stream and place what it carries (a
        `PlacedFrame`: check the payload already received where `target` said)."""
        index, self.frames = self.frames, self.frames + 1
        if isinstance(frame, PlacedFrame):
            self._placed(frame, index)
            return
        view = frame_view(frame, index)
        if self.header is None:
            self._start(parse_header(view))
            return
        if self._trailer is not None:
            raise StateDecodeError(
                f"frame {index} follows the trailer (frame {self._trailer_index}), which ends "
                "a state stream: trailing garbage"
            )
        if is_trailer(view):
            self._trailer, self._trailer_index = trailer_of(self.header, view, index), index
            return
        self._place(view, index)

    def _start(self, header: StateHeader) -> None:
        check_header(header, self.cfg, self.max_len)
        self.header = header
        length = header.length
        capacity = max(length, 1) if self.max_len is None else self.max_len
        self._buffers = StateBuffers(self.cfg, length, capacity)
        # Where each tensor's payloads go: the state's own buffer, or (an encoding other than
        # native) its wire bytes, turned into the tensor at ``finish``.
        self._targets = [
            _bytes_of(self._buffers.canonical(t))
            if entry.wire == precision.NATIVE
            else np.empty(entry.nbytes, np.uint8)
            for t, entry in enumerate(header.tensors)
        ]
        # Per tensor, the CRC32 of each data frame's payload, by frame number.
        self._crcs: list[list[int | None]] = [[None] * e.num_frames for e in header.tensors]
        self._pending: set[tuple[int, int]] = set()  # (tensor, slot) given out by `target`

    def _place(self, view: memoryview, index: int) -> None:
        assert self.header is not None
        entries = self.header.tensors
        data = parse_data(view, index)
        check_stream(self.header, data.stream_id, f"data frame {index}")
        if data.tensor_id >= len(entries):
            raise StateDecodeError(
                f"data frame {index} names tensor {data.tensor_id}; the header has {len(entries)}"
            )
        slot = self._slot(data.tensor_id, data.offset, len(data.payload), index)
        self._crcs[data.tensor_id][slot] = data.payload_crc
        # numpy copies without the GIL: a decode worker's engine thread runs meanwhile.
        target = self._targets[data.tensor_id][data.offset : data.offset + len(data.payload)]
        np.copyto(target, _u8(data.payload))

    def _slot(self, tid: int, offset: int, size: int, index: int) -> int:
        """The chunk slot a ``size``-byte payload at ``offset`` of tensor ``tid`` fills (the
        tensor's entry checked, `StateDecodeError` if it is out of range, off the grid, of
        another size, or already filled)."""
        assert self.header is not None
        entry = self.header.tensors[tid]
        where = f"data frame {index} (tensor {tid}, offset {offset})"
        skip = entry.skip_bytes
        if not skip <= offset < entry.nbytes or (offset - skip) % entry.chunk_bytes:
            raise StateDecodeError(
                f"{where} is out of range or off the {entry.chunk_bytes}-byte chunk grid of a "
                f"{entry.nbytes}-byte tensor" + (f" from byte {skip}" if skip else "")
            )
        expected = min(entry.chunk_bytes, entry.nbytes - offset)
        if size != expected:
            raise StateDecodeError(f"{where} carries {size} bytes, expected {expected}")
        slot = (offset - skip) // entry.chunk_bytes
        if self._crcs[tid][slot] is not None or (tid, slot) in self._pending:
            raise StateDecodeError(f"{where} is a duplicate: that chunk already arrived")
        return slot

    def target(self, prefix: memoryview, frame_bytes: int) -> PlacedFrame | None:
        """Where the payload of the next frame — ``frame_bytes`` long, ``prefix`` its first
        bytes — can be received straight into, before it arrives: the part of the state field
        (or wire buffer) that keeps it, its slot then taken; the frame is `feed`'s next
        `PlacedFrame`, checked there. None, and the frame goes to `feed` whole, unless the header
        is in and the trailer is not, and ``prefix`` is a data frame of this stream whose
        payload fits ``frame_bytes`` and an empty slot of its tensor: every frame that could
        be refused comes whole, so it is refused exactly as ever."""
        header = self.header
        fields = data_prefix(prefix)
        if header is None or self._trailer is not None or fields is None:
            return None
        stream_id, tid, offset, size, stored = fields
        if stream_id != header.stream_id or tid >= len(header.tensors):
            return None
        if size != frame_bytes - DATA_PREFIX_SIZE:
            return None
        try:
            slot = self._slot(tid, offset, size, self.frames)
        except StateDecodeError:
            return None
        self._pending.add((tid, slot))
        payload = self._targets[tid][offset : offset + size]
        return PlacedFrame(bytes(prefix[:DATA_PREFIX_SIZE]), stored, tid, slot, payload)

    def _placed(self, placement: PlacedFrame, index: int) -> None:
        if (placement.tensor_id, placement.slot) not in self._pending:
            raise StateDecodeError(f"frame {index} was not placed by this decoder")
        self._pending.discard((placement.tensor_id, placement.slot))
        prefix = memoryview(placement.prefix)
        crc = checked_payload_crc(prefix, placement.payload, placement.stored, index)
        self._crcs[placement.tensor_id][placement.slot] = crc

    def check_base(self, base: KvPrefix | None) -> None:
        """That the receiver holds the positions the stream leaves out (its header's base)."""
        if self.header is None:
            raise StateDecodeError("no frames: a state stream starts with a header frame")
        held = 0 if base is None else base.length
        if self.header.base != held:
            raise StateDecodeError(
                f"the stream leaves out the first {self.header.base} positions of its KV "
                f"caches, but the receiver holds {held} of them"
            )

    def finish(self, base: KvPrefix | None = None) -> ModelState:
        """The state, once every frame is in; ``base``: the receiver's rows of the positions an
        increment leaves out (exactly the header's base)."""
        self.check_base(base)
        assert self.header is not None
        entries = self.header.tensors
        for tid, entry in enumerate(entries):
            spec, arrived = entry.spec, sum(crc is not None for crc in self._crcs[tid])
            if arrived != entry.num_frames:
                raise StateDecodeError(
                    f"stream ended early: tensor {tid} (layer {spec.layer} {spec.name}) has "
                    f"{arrived} of its {entry.num_frames} data frames"
                )
        if self._trailer is None:
            raise StateDecodeError(
                "stream ended early: no trailer frame (it follows the last data frame)"
            )
        for tid, entry in enumerate(entries):
            if _tensor_crc(entry, self._crcs[tid]) != self._trailer.crc32s[tid]:
                spec = entry.spec
                raise StateDecodeError(
                    f"tensor {tid} (layer {spec.layer} {spec.name}) fails its CRC32"
                )
            if entry.wire != precision.NATIVE:
                self._restore(tid, entry, base)
                continue
            if entry.skip_bytes:
                self._targets[tid][: entry.skip_bytes] = wire_view(_base_rows(entry.spec, base))
            if sys.byteorder == "big":  # the wire is little-endian
                raw = self._buffers.canonical(tid).view(f"u{entry.spec.itemsize}")
                raw.byteswap(inplace=True)
        return self._buffers.state()

    def _restore(self, tid: int, entry: TensorEntry, base: KvPrefix | None) -> None:
        """Tensor ``tid`` from its wire bytes (an encoding other than native), the receiver's
        base rows first."""
        tensor, first = self._buffers.canonical(tid), entry.first_row
        if entry.skip_bytes:
            tensor[:first] = _base_rows(entry.spec, base)
        rows = entry.spec.shape[0] - first if entry.spec.token_axis else 0
        data = np.frombuffer(self._targets[tid], np.uint8)[entry.skip_bytes :]
        try:
            tensor[first:] = precision.from_wire(data, entry.spec, rows, entry.wire)
        except ValueError as err:
            spec = entry.spec
            raise StateDecodeError(
                f"tensor {tid} (layer {spec.layer} {spec.name}, {entry.wire}): {err}"
            ) from None


@dataclasses.dataclass(frozen=True)
class PlacedFrame:
    """A data frame received into the state by way of `StreamDecoder.target`: its prefix, the
    CRC the prefix stores, its tensor and slot, and the payload where it now lies."""

    prefix: bytes
    stored: int
    tensor_id: int
    slot: int
    payload: np.ndarray

    def __len__(self) -> int:
        return len(self.prefix) + self.payload.nbytes


def frame_view(frame: object, index: int) -> memoryview:
    """Frame number ``index`` as bytes, or ``StateDecodeError`` if it is not bytes-like."""
    try:
        return memoryview(frame).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise StateDecodeError(
            f"frame {index} is a {type(frame).__name__}, not a contiguous bytes-like object"
        ) from None


def check_header(header: StateHeader, cfg: ModelConfig, max_len: int | None) -> None:
    """That a parsed header fits ``cfg`` (fingerprint, L within ``max_len``, tensor table)."""
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


def check_stream(header: StateHeader, stream_id: int, where: str) -> None:
    if stream_id != header.stream_id:
        raise StateDecodeError(
            f"{where} belongs to another state stream (stream id {stream_id:016x}, this "
            f"header's is {header.stream_id:016x})"
        )


def trailer_of(header: StateHeader, view: memoryview, index: int) -> StateTrailer:
    """Frame ``index`` parsed as the trailer of ``header``'s stream."""
    trailer = parse_trailer(view, index)
    check_stream(header, trailer.stream_id, f"trailer frame {index}")
    if len(trailer.crc32s) != len(header.tensors):
        raise StateDecodeError(
            f"trailer frame {index} lists {len(trailer.crc32s)} tensor CRCs; the header has "
            f"{len(header.tensors)} tensors"
        )
    return trailer


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes, as a writable flat uint8 array viewing it."""
    return array.view(np.uint8).reshape(-1)


def _u8(payload: memoryview) -> np.ndarray:
    return np.frombuffer(payload, np.uint8)


def _tensor_crc(entry: TensorEntry, frame_crcs: list[int | None]) -> int:
    """CRC32 of the bytes a tensor's frames carry, combined from their payloads' CRCs."""
    crc, remaining = 0, entry.nbytes - entry.skip_bytes
    for frame_crc in frame_crcs:
        size = min(entry.chunk_bytes, remaining)
        crc, remaining = crc32_combine(crc, frame_crc, size), remaining - size
    return crc


def _base_rows(spec: TensorSpec, base: KvPrefix | None) -> np.ndarray:
    """The receiver's rows of the positions a stream left out of tensor ``spec``."""
    assert base is not None  # finish checked that the receiver holds the header's base
    rows = base.rows.get((spec.layer, spec.name))
    expected = (base.length, *spec.shape[1:])
    if rows is None or rows.shape != expected or rows.dtype.name != spec.dtype:
        got = "nothing" if rows is None else f"{rows.dtype.name}{list(rows.shape)}"
        raise StateDecodeError(
            f"the receiver's rows of layer {spec.layer} {spec.name} are {got}, the stream "
            f"needs {spec.dtype}{list(expected)}"
        )
    return rows
