"""``StreamEncoder``: a state's frames (wire format: docs/wire-format.md) written as it is built.

The header needs only the model and the token count ``L``, so it goes out before prefill starts.
During a chunked prefill, ``ready_frames(state, tokens_done)`` emits the data frames of the
growing caches (MLA, GQA) whose positions are all below ``tokens_done``; in the last chunk of a
layer-wise prefill ``layer_frames(state, layers)`` emits everything left of layers whose states
are final; ``finish(state)`` emits
every frame not yet sent (recurrent states, conv tails, SWA windows, the last cache rows) and
the trailer. Frames of a token-axis tensor are cut on one fixed grid of ``frame_rows`` positions
(header ``chunk_bytes``), so early and late frames tile each tensor exactly and the stream's
frames are the same bytes in whatever chunks the state was produced — a one-shot ``encode``
with the same stream id yields the same set of frames.

With ``base = K`` the stream is an *increment*: the receiver already holds the first K positions
of every growing cache (a prefix it cached), so those rows are not sent; each growing cache's
frames are cut on the same grid from row K on, and the trailer's CRCs cover the bytes sent.
Everything else — recurrent states, conv tails, SWA windows — is sent whole as always.

Within a tensor, frames are emitted by increasing offset, so the whole-tensor CRC32 that the
trailer carries is combined frame by frame from the payloads' CRCs (engine/codec/checksum.py),
which also give the frames' own: each payload byte is read once for its checksums and copied
once, into its frame. ``finish`` cuts its frames from views of the state's host arrays (on a
CPU, the device buffers themselves), so a whole state is never copied before it is framed.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.codec.checksum import crc32, crc32_combine
from prfaas_jax.engine.codec.format import (
    DATA_PREFIX_SIZE,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_STREAM_ID,
    FrameParts,
    StateHeader,
    StateTrailer,
    TensorEntry,
    data_parts,
    pack_header,
    pack_trailer,
    trailer_nbytes,
    with_base,
)
from prfaas_jax.engine.codec.layout import (
    canonical_arrays,
    canonical_tensors,
    growing_rows,
    row_length,
)
from prfaas_jax.engine.codec.precision import (
    WIRE_NATIVE,
    WirePrecision,
    encoding_of,
    to_wire,
    unit_bytes,
)
from prfaas_jax.model.state import ModelState

DEFAULT_MAX_FRAME_BYTES = 4 * 2**20  # gRPC's default message limit


class StreamEncoder:
    """Frames of one sequence of ``length`` tokens: ``header``, ``ready_frames``\\*, ``finish``.

    Every frame is at most ``max_frame_bytes`` long. ``stream_id`` defaults to a fresh random
    u64 (tests and reproducible files pass one). ``precision`` picks each kind of tensor's
    encoding on the wire (engine/codec/precision.py; all native, exact, by default). ValueError
    when the frame limit cannot hold the header, the trailer or one row/element of some tensor
    after the data-frame prefix.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        length: int,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        stream_id: int | None = None,
        base: int = 0,
        precision: WirePrecision = WIRE_NATIVE,
    ) -> None:
        if length < 0:
            raise ValueError(f"a state holds ≥ 0 tokens, got L={length}")
        if not 0 <= base <= length:
            raise ValueError(f"base must be in [0, L={length}], got {base}")
        stream_id = secrets.randbits(64) if stream_id is None else stream_id
        if not 0 <= stream_id <= MAX_STREAM_ID:
            raise ValueError(f"stream_id must be a u64, got {stream_id}")
        room = min(max_frame_bytes - DATA_PREFIX_SIZE, MAX_CHUNK_BYTES)
        entries = []
        for spec in canonical_tensors(cfg, length):
            wire = encoding_of(precision, spec)
            unit = unit_bytes(spec, wire)
            chunk = room // unit * unit if unit else room
            if chunk < 1:
                raise ValueError(
                    f"max_frame_bytes={max_frame_bytes} cannot fit one {unit}-byte "
                    f"unit of layer {spec.layer} {spec.name} after the {DATA_PREFIX_SIZE}-byte "
                    "frame prefix"
                )
            entries.append(with_base(TensorEntry(spec, chunk, wire=wire), base))
        self.cfg, self.length, self.stream_id = cfg, length, stream_id
        self.state_header = StateHeader(
            FORMAT_VERSION, cfg.fingerprint(), stream_id, length, tuple(entries), base
        )
        self._header = pack_header(self.state_header)
        longest = max(len(self._header), trailer_nbytes(len(entries)))
        if longest > max_frame_bytes:
            raise ValueError(
                f"max_frame_bytes={max_frame_bytes} is smaller than the {longest}-byte header "
                "or trailer"
            )
        self._sent = [0] * len(entries)  # data frames emitted per tensor: always a prefix
        self._crcs = [0] * len(entries)  # CRC32 of each tensor's bytes emitted so far
        self._finished = False
        self._tids = {(e.spec.layer, e.spec.name): tid for tid, e in enumerate(entries)}

    @property
    def entries(self) -> tuple[TensorEntry, ...]:
        return self.state_header.tensors

    def header(self) -> bytes:
        """Frame 0; it depends on nothing but the model, L and the stream id."""
        return self._header

    def _frames(
        self, tid: int, data: memoryview, *, views: bool = False
    ) -> Iterator[bytes | FrameParts]:
        """Data frames of tensor ``tid`` carrying ``data``, which starts at its next unsent
        frame and ends on the frame grid or at the tensor's end. Each payload is read once for
        its CRC (the frame's and the tensor's are combined from it) and copied once into its
        frame — or, with ``views``, not at all: each frame is `FrameParts` viewing ``data``;
        the tensor's CRC is updated as the frames are made."""
        entry = self.entries[tid]
        chunk, first = entry.chunk_bytes, self._sent[tid]
        start = entry.skip_bytes + first * chunk
        for at in range(0, len(data), chunk):
            payload = data[at : at + chunk]
            payload_crc = crc32(payload)
            self._crcs[tid] = crc32_combine(self._crcs[tid], payload_crc, len(payload))
            self._sent[tid] += 1
            parts = data_parts(self.stream_id, tid, start + at, payload, payload_crc)
            yield parts if views else bytes(parts)

    def ready_frames(self, state: ModelState, tokens_done: int, *, row: int = 0) -> Iterator[bytes]:
        """Not-yet-sent data frames of the growing caches whose positions are all < ``tokens_done``.

        ``state`` (row ``row``) must hold at least ``tokens_done`` final positions. It is read
        before this returns — the frames are host bytes — so a prefill callback may pass its
        working state, whose buffers are donated to the next chunk.
        """
        if self._finished:
            raise ValueError("finish() already ran: the stream is complete")
        if not 0 <= tokens_done <= self.length:
            raise ValueError(f"tokens_done={tokens_done} is outside [0, L={self.length}]")
        _, held = row_length(state, row)
        if held < tokens_done:
            raise ValueError(f"the state holds {held} positions, fewer than {tokens_done}")
        frames: list[bytes] = []
        for tid, entry in enumerate(self.entries):
            if not entry.spec.kind.has_growing_state:
                continue
            rows, first = entry.frame_rows, entry.first_row
            # Frame k holds positions [first + k·rows, min(first + (k+1)·rows, L)): ready once
            # they are final.
            if tokens_done == self.length:
                ready = entry.num_frames
            else:
                ready = max(tokens_done - first, 0) // rows
            if ready <= self._sent[tid]:
                continue
            start, stop = first + self._sent[tid] * rows, min(first + ready * rows, self.length)
            host = growing_rows(state, self.cfg, entry.spec, row, start, stop)
            frames += self._frames(tid, to_wire(host, entry.wire))
        return iter(frames)

    def layer_frames(self, state: ModelState, layers: range, *, row: int = 0) -> Iterator[bytes]:
        """Every data frame not yet sent of ``layers``' tensors, whose states in ``state`` are
        final (a layer-wise prefill's last call: engine/prefill.py); the other layers are not
        read. Read before this returns, like ``ready_frames``."""
        if self._finished:
            raise ValueError("finish() already ran: the stream is complete")
        length, arrays = canonical_arrays(state, self.cfg, row, layers=layers)
        if length != self.length:
            raise ValueError(f"the state holds L={length} tokens, the header says {self.length}")
        frames: list[bytes] = []
        for spec, array in arrays:
            tid = self._tids[(spec.layer, spec.name)]
            entry, sent = self.entries[tid], self._sent[tid]
            if sent == entry.num_frames:
                continue
            frames += self._frames(tid, to_wire(_unsent(entry, sent, array), entry.wire))
        return iter(frames)

    def finish(
        self, state: ModelState, *, row: int = 0, views: bool = False
    ) -> Iterator[bytes | FrameParts]:
        """Every data frame not yet sent, then the trailer, from the final ``state``.

        The state is checked (ValueError if it does not fit the model or holds another L)
        before this returns; frames are built as iterated, from host views of its arrays (JAX
        arrays are immutable, and one with a host view is not donated, so the views stay valid).
        With ``views``, each data frame is `FrameParts` whose payload is such a view: a sender
        that writes the parts as they are (the data path's `sendmsg`) copies no payload byte.
        """
        if self._finished:
            raise ValueError("finish() already ran: the stream is complete")
        # Layers whose every tensor went out (layer_frames) are not read again.
        pending = {
            e.spec.layer for e, n in zip(self.entries, self._sent, strict=True) if n < e.num_frames
        }
        length, arrays = canonical_arrays(state, self.cfg, row, layers=pending)
        if length != self.length:
            raise ValueError(f"the state holds L={length} tokens, the header says {self.length}")
        rest: list[tuple[int, memoryview]] = []
        for spec, array in arrays:
            tid = self._tids[(spec.layer, spec.name)]
            if self._sent[tid] < self.entries[tid].num_frames:
                entry = self.entries[tid]
                rest.append((tid, to_wire(_unsent(entry, self._sent[tid], array), entry.wire)))
        self._finished = True
        return self._rest_frames(rest, views)

    def _rest_frames(
        self, rest: list[tuple[int, memoryview]], views: bool
    ) -> Iterator[bytes | FrameParts]:
        for tid, data in rest:
            yield from self._frames(tid, data, views=views)
        yield pack_trailer(StateTrailer(self.stream_id, tuple(self._crcs)))


def _unsent(entry: TensorEntry, sent: int, array: np.ndarray) -> np.ndarray:
    """The part of a tensor's canonical ``array`` after its first ``sent`` data frames (and its
    base rows). Only token-axis tensors can be partly sent; the rest start at frame 0."""
    if not entry.spec.token_axis:
        return array
    return array[entry.first_row + sent * entry.frame_rows :]
