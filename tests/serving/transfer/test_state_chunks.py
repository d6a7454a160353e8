"""`PushState`'s short path (serving/transfer/state_chunks.py) held against protobuf itself:
the bytes it writes are protobuf's, what it reads is what protobuf reads, and anything else is
left to protobuf."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from prfaas_jax.engine.codec.format import data_parts, pack_data
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer.state_chunks import (
    DecodeWorkerStub,
    FrameChunk,
    add_decode_worker_servicer,
    read_state_chunk,
    write_state_chunk,
)

FIELDS = ("request_id", "frame", "queued", "stripe", "stripes", "last", "sender", "data_ticket")

chunks = st.builds(
    pb.StateChunk,
    request_id=st.text(max_size=8),
    frame=st.binary(max_size=300),
    queued=st.booleans(),
    stripe=st.integers(0, 2**32 - 1),
    stripes=st.integers(0, 2**32 - 1),
    last=st.booleans(),
    sender=st.text(max_size=8),
    data_ticket=st.binary(max_size=16),
)
frame_chunks = st.builds(
    pb.StateChunk, frame=st.binary(min_size=1, max_size=300), queued=st.booleans()
)


def fields(message: object) -> tuple:
    return tuple(
        bytes(v) if k == "frame" else v
        for k, v in zip(FIELDS, map(message.__getattribute__, FIELDS), strict=True)
    )


@given(frame=st.binary(max_size=300), queued=st.booleans())
def test_a_frame_chunk_is_written_as_protobuf_writes_it(frame, queued):
    expected = pb.StateChunk(frame=frame, queued=queued).SerializeToString()
    assert write_state_chunk(FrameChunk(frame, queued)) == expected
    assert write_state_chunk(FrameChunk(memoryview(frame), queued)) == expected


def test_frame_parts_are_written_as_their_joined_frame():
    """A prefill worker's last frames view the state (`FrameParts`): the message is protobuf's
    bytes of the frame they make."""
    payload = np.arange(5000, dtype=np.uint16)
    parts = data_parts(7, 3, 128, memoryview(payload).cast("B"))
    frame = bytes(parts)
    assert frame == pack_data(7, 3, 128, payload.tobytes()) and len(parts) == len(frame)
    assert parts[:4] == frame[:4] and parts[30:40] == frame[30:40]
    for queued in (False, True):
        expected = pb.StateChunk(frame=frame, queued=queued).SerializeToString()
        assert write_state_chunk(FrameChunk(parts, queued)) == expected


def test_a_long_frame_has_a_multi_byte_length():
    frame = bytes(range(256)) * 4096  # 1 MiB: a three-byte varint
    message = pb.StateChunk(frame=frame, queued=True)
    assert write_state_chunk(FrameChunk(frame, True)) == message.SerializeToString()
    read = read_state_chunk(message.SerializeToString())
    assert isinstance(read, FrameChunk) and read.queued and read.frame == frame


@given(chunks)
def test_what_is_read_is_what_protobuf_reads(message):
    raw = message.SerializeToString()
    assert fields(read_state_chunk(raw)) == fields(pb.StateChunk.FromString(raw))
    assert write_state_chunk(message) == raw


@given(frame_chunks)
def test_a_frame_message_is_a_view_of_the_received_bytes(message):
    raw = message.SerializeToString()
    read = read_state_chunk(raw)
    assert isinstance(read, FrameChunk)
    assert isinstance(read.frame, memoryview) and read.frame.obj is raw  # no copy
    assert fields(read) == fields(message)


def assert_read_as_protobuf_reads(raw: bytes) -> None:
    """The same fields, or the same refusal."""
    try:
        expected = fields(pb.StateChunk.FromString(raw))
    except DecodeError:
        with pytest.raises(DecodeError):
            read_state_chunk(raw)
    else:
        assert fields(read_state_chunk(raw)) == expected


@given(st.binary(max_size=40))
def test_any_bytes_read_as_protobuf_reads_them(raw):
    assert_read_as_protobuf_reads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"\x12\x03abc\x18\x00",  # queued written as false: protobuf's reading
        b"\x12\x03abc\x18\x02",  # queued as 2: true to protobuf, not the short form
        b"\x12\x83\x00abc",  # a length varint with a redundant byte
        b"\x12\x03abc\x12\x01d",  # a repeated frame field: protobuf keeps the last
        b"\x12\x05abc",  # shorter than its length says
        b"\x12\x03abcd",  # a stray byte after the frame
        b"\x12" + b"\xff" * 11,  # a varint that never ends
    ],
)
def test_edge_cases_follow_protobuf(raw):
    assert_read_as_protobuf_reads(raw)


class _Echo(pb_grpc.DecodeWorkerServicer):
    """PushState sums what it read; the other methods are the generated ones."""

    def PushState(self, request_iterator, context):  # noqa: N802
        first = next(request_iterator)
        rest = list(request_iterator)
        kinds = {type(chunk).__name__ for chunk in rest}
        return pb.PushStateReply(
            state_bytes=sum(len(chunk.frame) for chunk in rest),
            frames=len(rest) + (first.request_id == "r" and kinds == {"FrameChunk"}),
        )


@pytest.mark.parametrize("stub_class", [DecodeWorkerStub, pb_grpc.DecodeWorkerStub])
def test_push_state_over_grpc_either_stub(stub_class):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    add_decode_worker_servicer(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            frames = [bytes([i]) * (1000 + i) for i in range(5)]
            if stub_class is DecodeWorkerStub:
                rest = [FrameChunk(f, queued=i % 2 == 1) for i, f in enumerate(frames)]
            else:  # the generated stub sends protobuf's messages; they read the same
                rest = [pb.StateChunk(frame=f) for f in frames]
            messages = [pb.StateChunk(request_id="r"), *rest]
            reply = stub_class(channel).PushState(iter(messages), timeout=10)
            # Each frame message arrives as a FrameChunk (+1), the first as protobuf's.
            assert reply.state_bytes == sum(map(len, frames)) and reply.frames == len(frames) + 1
            with pytest.raises(grpc.RpcError) as err:
                stub_class(channel).ReserveKv(pb.KvReserveRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # registered as generated
    finally:
        server.stop(None)
