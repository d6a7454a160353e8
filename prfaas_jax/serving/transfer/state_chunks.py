"""`PushState`'s messages read and written without protobuf's copies of the frame they carry.

Nearly every byte of a state transfer is a `StateChunk` whose only fields are `frame` (a codec
frame of up to a few MiB) and `queued`. Protobuf's Python runtime copies such a frame twice on
each side (into and out of its message), which more than halves what one gRPC stream carries on
a loopback link (bench/codec.py). So those messages take a short path:

- `write_state_chunk`, the client's serializer: a `FrameChunk` becomes the exact bytes protobuf
  writes for `StateChunk(frame=…, queued=…)` (field 2, then field 3 when set), with one copy of
  the frame (of its parts, joined, for `FrameParts`); any `pb.StateChunk` is serialized by
  protobuf.
- `read_state_chunk`, the server's deserializer: a message that is exactly field 2 (a
  length-delimited frame), optionally followed by field 3 = true, is returned as a `FrameChunk`
  whose `frame` is a view of the received bytes; every other message — the first one, with the
  request id, a stripe's `last`, anything unusual — is parsed by protobuf, which also rejects
  what is malformed. Both paths give the servicer the same fields.

`DecodeWorkerStub` and `add_decode_worker_servicer` are the generated stub and registration with
`PushState` switched to these; the other methods are untouched. A push on the data path
(serving/transfer/data_path.py) sends only its first message on the stream.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from prfaas_jax.engine.codec.decoder import PlacedFrame
from prfaas_jax.engine.codec.format import FrameParts
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

SERVICE = "prfaas.v1.DecodeWorker"
PUSH_STATE = f"/{SERVICE}/PushState"
_FRAME_TAG = 0x12  # field 2 (frame), length-delimited
_QUEUED_TRUE = b"\x18\x01"  # field 3 (queued), varint 1
_MAX_VARINT_BYTES = 10


class FrameChunk(NamedTuple):
    """A `StateChunk` that carries one frame (and `queued`); the other fields at their proto3
    defaults, so the servicer reads it as it reads the message. A sender's frame may be
    `FrameParts`; a data connection's may be a `PlacedFrame`, already received into the state
    (serving/transfer/data_path.py)."""

    frame: bytes | memoryview | FrameParts | PlacedFrame
    queued: bool = False
    request_id: str = ""
    stripe: int = 0
    stripes: int = 0
    last: bool = False
    sender: str = ""
    data_ticket: bytes = b""


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def write_state_chunk(message: FrameChunk | pb.StateChunk) -> bytes:
    """The wire bytes of a `StateChunk` (module docstring)."""
    if not isinstance(message, FrameChunk):
        return message.SerializeToString()
    size = len(message.frame)
    if not size:  # proto3 leaves an empty field out
        return _QUEUED_TRUE if message.queued else b""
    tail = _QUEUED_TRUE if message.queued else b""
    frame = message.frame
    parts = (frame.prefix, frame.payload) if isinstance(frame, FrameParts) else (frame,)
    return b"".join((bytes((_FRAME_TAG,)), _varint(size), *parts, tail))


def read_state_chunk(raw: bytes) -> FrameChunk | pb.StateChunk:
    """A received `StateChunk`: a `FrameChunk` viewing ``raw`` when the message is a frame and
    at most `queued` = true, else protobuf's parse (whose errors are the call's)."""
    if len(raw) > 1 and raw[0] == _FRAME_TAG:
        size, shift, at = 0, 0, 1
        while at <= _MAX_VARINT_BYTES and at < len(raw):
            byte = raw[at]
            size |= (byte & 0x7F) << shift
            shift, at = shift + 7, at + 1
            if byte < 0x80:
                end = at + size
                if end == len(raw):
                    return FrameChunk(memoryview(raw)[at:end])
                if end + 2 == len(raw) and raw[end:] == _QUEUED_TRUE:
                    return FrameChunk(memoryview(raw)[at:end], queued=True)
                break
    return pb.StateChunk.FromString(raw)


class DecodeWorkerStub(pb_grpc.DecodeWorkerStub):
    """The generated stub, with `PushState` writing `FrameChunk`s without protobuf."""

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)
        self.PushState = channel.stream_unary(
            PUSH_STATE,
            request_serializer=write_state_chunk,
            response_deserializer=pb.PushStateReply.FromString,
            _registered_method=True,
        )


class _Handlers:
    """Stands in for a server to catch what a generated `add_…_to_server` registers."""

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service, self.handlers = service, handlers


def add_decode_worker_servicer(servicer: pb_grpc.DecodeWorkerServicer, server: grpc.Server) -> None:
    """`add_DecodeWorkerServicer_to_server` with `PushState` read by `read_state_chunk`."""
    caught = _Handlers()
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, caught)
    handlers = dict(caught.handlers)
    handlers["PushState"] = handlers["PushState"]._replace(request_deserializer=read_state_chunk)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(caught.service, handlers),)
    )
    server.add_registered_method_handlers(caught.service, handlers)
