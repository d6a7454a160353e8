"""The prefill worker streams a state while it prefills: the first data frame reaches the decode
worker before the prefill engine has finished.

In process, on loopback: a `PrefillService` and a `DecodeService` (fake decode engine) on one
gRPC server. The prefill engine runs the fake engine's prompt in chunks and, before its second
chunk, waits until the decode worker has received a data frame (or gives up after a timeout),
so a worker that only sends after prefill fails this test instead of racing it.

The coupling holds both ways: a failed prefill cancels its push, and a failed push stops its
prefill at the next chunk.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import jax.numpy as jnp
import pytest
from serving_support import serve_workers

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.codec.format import DATA_MAGIC, HEADER_MAGIC, TRAILER_MAGIC
from prfaas_jax.engine.codec.handoff import HANDOFF_MAGIC
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.model import ModelState
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.link import LinkProfile, LinkShaper
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService

CFG = load_model_config("tiny")
CHUNK = 16
FRAME_BYTES = 1024  # 7 MLA c_kv rows per frame: the first chunk makes two frames final
WAIT_S = 10.0


class Timeline:
    """Timestamped events from both workers (monotonic clock)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []
        self.data_arrived = threading.Event()
        self._lock = threading.Lock()

    def add(self, what: str) -> None:
        with self._lock:
            self.events.append((time.monotonic(), what))

    def first(self, what: str) -> float:
        return next(t for t, w in self.events if w == what)


class ChunkedEngine:
    """The fake prefill engine's result, reached chunk by chunk with an `on_chunk` per chunk.

    Before its second chunk it waits for the decode worker's first data frame."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.waits: list[bool] = []

    def prefill(
        self,
        tokens: Sequence[int],
        *,
        sampling: SamplingParams,
        max_len: int,
        on_chunk: Callable[[ModelState, int], None] | None = None,
        on_layers: object = None,  # a whole-chunk engine: never called
    ) -> object:
        result = FakePrefillEngine(CFG).prefill(tokens, sampling=sampling, max_len=max_len)
        self.timeline.add("prefill started")
        for done in range(CHUNK, len(tokens) + CHUNK, CHUNK):
            done = min(done, len(tokens))
            if done == 2 * CHUNK:  # once: a worker that sends after prefill costs WAIT_S, not 6×
                self.waits.append(self.timeline.data_arrived.wait(WAIT_S))
            # The working state after `done` tokens: positions ≥ done are not final yet.
            working = ModelState(lengths=jnp.array([done], jnp.int32), layers=result.state.layers)
            assert on_chunk is not None
            on_chunk(working, done)
            self.timeline.add(f"chunk {done}")
        self.timeline.add("prefill finished")
        return result


class RecordingDecode(DecodeService):
    """The real decode service, noting when each kind of frame arrives."""

    def __init__(self, timeline: Timeline, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.timeline = timeline
        self.kinds: list[bytes] = []

    def PushState(  # noqa: N802
        self, request_iterator: Iterator[pb.StateChunk], context: grpc.ServicerContext
    ) -> pb.PushStateReply:
        def watched() -> Iterator[pb.StateChunk]:
            for chunk in request_iterator:
                if not chunk.frame:  # the first message names the request
                    yield chunk
                    continue
                magic = bytes(chunk.frame[:4])
                self.kinds.append(magic)
                if magic == DATA_MAGIC and not self.timeline.data_arrived.is_set():
                    self.timeline.add("first data frame received")
                    self.timeline.data_arrived.set()
                yield chunk

        return super().PushState(watched(), context)


@pytest.fixture(params=["unshaped", "shaped"])
def workers(request):
    timeline = Timeline()
    engine = ChunkedEngine(timeline)
    shaper = None
    if request.param == "shaped":  # fast enough not to slow the test, but every frame admitted
        shaper = LinkShaper(LinkProfile(bandwidth_bytes_per_s=50e6, latency_s=0.002))
    prefill = PrefillService(
        engine=lambda: engine,
        cfg=CFG,
        max_len=512,
        frame_bytes=FRAME_BYTES,
        shaper=shaper,
        admit=lambda context: None,
    )
    decode = RecordingDecode(
        timeline,
        engine=lambda: FakeDecodeEngine(CFG, max_slots=2, max_len=512),
        cfg=CFG,
        max_len=512,
        admit=lambda context: None,
    )
    server = serve_workers(prefill, decode)
    yield server.address, timeline, engine, decode, shaper
    decode.stop()
    server.stop(grace_s=0.5)


def test_first_frame_leaves_before_prefill_finishes(workers) -> None:
    address, timeline, engine, decode, shaper = workers
    prompt = [(7 * i + 3) % CFG.vocab_size for i in range(100)]
    with grpc.insecure_channel(address) as channel:
        decode_stub, prefill_stub = (
            pb_grpc.DecodeWorkerStub(channel),
            pb_grpc.PrefillWorkerStub(channel),
        )
        tokens = decode_stub.Generate(
            pb.DecodeRequest(request_id="r", prompt_len=len(prompt), max_new_tokens=4), timeout=30
        )
        reply = prefill_stub.Prefill(
            pb.PrefillRequest(request_id="r", prompt_token_ids=prompt, decode_address=address),
            timeout=30,
        )
        out = [t for message in tokens for t in message.token_ids]
    # The engine waited for a data frame before its second chunk, and got it: frames left the
    # prefill worker (and crossed gRPC) while prefill still had 6 of its 7 chunks to run.
    assert engine.waits == [True]
    assert timeline.first("first data frame received") < timeline.first("chunk 32")
    assert timeline.first("first data frame received") < timeline.first("prefill finished")
    # The stream is whole and valid: header, data, trailer, handoff; decoded into right tokens.
    kinds = decode.kinds
    assert kinds[0] == HEADER_MAGIC[:4] and kinds[-2:] == [TRAILER_MAGIC, HANDOFF_MAGIC]
    assert set(kinds[1:-2]) == {DATA_MAGIC} and len(kinds) == reply.frames
    assert reply.state_bytes == state_nbytes(CFG, len(prompt))
    assert out == fake_tokens(prompt, 4, CFG.vocab_size)
    if shaper is not None:
        assert reply.shaped and shaper.sent_frames == reply.frames
        assert shaper.sent_bytes == reply.wire_bytes


def test_a_failed_prefill_cancels_the_push(workers) -> None:
    address, _, engine, decode, _ = workers

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("engine fell over")

    engine.prefill = broken
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.PrefillWorkerStub(channel).Prefill(
            pb.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3], decode_address=address),
            timeout=30,
        )
    assert err.value.code() == grpc.StatusCode.INTERNAL and "fell over" in err.value.details()
    assert decode.stats()["state_bytes_received"] == 0


class ChunkedFakeEngine:
    """The fake prefill, reported to `on_chunk` in `chunks` steps of `pause_s` each (as a real
    engine reports its chunks); counts the chunks it got to."""

    def __init__(self, chunks: int, pause_s: float) -> None:
        self.inner = FakePrefillEngine(CFG)
        self.chunks, self.pause_s, self.done = chunks, pause_s, 0

    def prefill(self, tokens, *, on_chunk=None, **options):
        result = self.inner.prefill(tokens, **options)
        for _ in range(self.chunks):
            time.sleep(self.pause_s)
            if on_chunk is not None:
                on_chunk(result.state, len(tokens))
            self.done += 1
        return result


def test_a_failed_push_stops_the_prefill():
    """The decode worker is unreachable: the push fails at once, and the prefill stops at its
    next chunk instead of computing a state nobody will receive. (The refusal takes a few
    milliseconds; half of the 2 s the prefill would take is room for a loaded machine.)"""
    engine = ChunkedFakeEngine(chunks=100, pause_s=0.02)
    service = PrefillService(
        engine=lambda: engine,
        cfg=CFG,
        max_len=512,
        frame_bytes=16384,
        shaper=None,
        admit=lambda context: None,
    )
    server = serve_workers(service)
    try:
        stub = pb_grpc.PrefillWorkerStub(grpc.insecure_channel(server.address))
        request = pb.PrefillRequest(
            request_id="r",
            prompt_token_ids=[(1 + 13 * i) % CFG.vocab_size for i in range(40)],
            decode_address="127.0.0.1:1",
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Prefill(request, timeout=30)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "pushing the state" in err.value.details()
        assert engine.done < 50, f"the prefill ran {engine.done} of 100 chunks"
        assert not service.busy
    finally:
        server.stop(0)
