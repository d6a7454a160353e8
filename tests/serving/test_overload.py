"""Overload protection in the workers: bounded queues.

In process on loopback (fake engines): a prefill worker holds at most `max_queue` requests, a
decode worker at most `max_pending_states` states outside a slot and `max_waiting` `Generate`
calls waiting; anything beyond is RESOURCE_EXHAUSTED at once. The router's shedding of a burst
runs on a cluster of real processes: tests/cluster/test_burst.py.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Iterator

import grpc
import pytest
from serving_support import serve_workers, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling import GREEDY
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.worker import decode as decode_worker
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService

CFG = load_model_config("tiny")
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
WAIT_S = 10.0


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * i) % CFG.vocab_size for i in range(length)]


class GatedEngine(FakePrefillEngine):
    """The fake prefill engine, holding every prefill until `gate` opens."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(CFG, seconds_per_token=1.0, sleep=lambda _: gate.wait(WAIT_S))


@pytest.fixture
def workers():
    """A prefill worker (queue of 2, gated engine) and a decode worker (2 pending states,
    3 waiting calls, 1 slot) on one server."""
    gate = threading.Event()
    engine = GatedEngine(gate)
    prefill = PrefillService(
        engine=lambda: engine,
        cfg=CFG,
        max_len=512,
        frame_bytes=4096,
        shaper=None,
        admit=lambda context: None,
        max_queue=2,
    )
    decode = DecodeService(
        engine=lambda: FakeDecodeEngine(CFG, max_slots=1, max_len=512),
        cfg=CFG,
        max_len=512,
        admit=lambda context: None,
        max_pending_states=2,
        max_waiting=3,
    )
    server = serve_workers(prefill, decode)
    channel = grpc.insecure_channel(server.address)
    yield server.address, channel, gate, prefill, decode
    gate.set()
    channel.close()
    decode.stop()
    server.stop(grace_s=0.5)


def test_a_full_prefill_queue_refuses_at_once(workers):
    address, channel, gate, prefill, _ = workers
    stub = pb_grpc.PrefillWorkerStub(channel)
    extra = 4
    start = time.monotonic()
    calls = [
        stub.Prefill.future(
            pb.PrefillRequest(
                request_id=f"r{i}", prompt_token_ids=prompt_of(i, 8), decode_address=address
            ),
            timeout=30,
        )
        for i in range(prefill.max_queue + extra)
    ]
    # One prefill holds the engine, one waits for it; the other four are refused while the
    # engine is still held, without waiting for it.
    assert wait_for(lambda: sum(call.done() for call in calls) == extra)
    refused_after = time.monotonic() - start
    time.sleep(0.2)
    refused = [call for call in calls if call.done()]
    assert len(refused) == extra and prefill.queued == prefill.max_queue
    for call in refused:
        assert call.exception().code() == EXHAUSTED
        assert call.exception().details() == "prefill queue full (2 requests)"
    assert refused_after < 2.0
    gate.set()
    for call in calls:
        if call not in refused:
            assert call.result(timeout=WAIT_S).state_bytes > 0
    assert prefill.queued == 0 and prefill.completed == prefill.max_queue


def state_frames(prompt: list[int]) -> list[bytes]:
    """What a prefill worker pushes for `prompt`: the codec frames and the handoff frame."""
    result = FakePrefillEngine(CFG).prefill(prompt)
    frames = list(codec.encode(result.state, CFG, max_frame_bytes=4096))
    return [*frames, pack_handoff(Handoff(result.first_token, GREEDY), frames[0])]


def state_chunks(request_id: str, prompt: list[int]) -> list[pb.StateChunk]:
    """A whole `PushState` stream: the request's name, then its frames."""
    chunks = [pb.StateChunk(request_id=request_id)]
    return chunks + [pb.StateChunk(frame=frame) for frame in state_frames(prompt)]


def push(channel: grpc.Channel, request_id: str, prompt: list[int]) -> pb.PushStateReply:
    chunks = state_chunks(request_id, prompt)
    return pb_grpc.DecodeWorkerStub(channel).PushState(iter(chunks), timeout=WAIT_S)


def decode_call(channel: grpc.Channel, request_id: str, prompt: list[int], n: int):
    request = pb.DecodeRequest(request_id=request_id, prompt_len=len(prompt), max_new_tokens=n)
    return pb_grpc.DecodeWorkerStub(channel).Generate(request, timeout=WAIT_S)


def tokens_of(call) -> list[int]:
    return [t for message in call for t in message.token_ids]


class AbortedError(Exception):
    pass


class Context:
    """Just enough of a servicer context for a direct `PushState` call."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise AbortedError(details)

    def add_callback(self, callback) -> bool:
        return True  # a direct call is never cancelled

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"  # the sending connection


def test_the_decode_worker_holds_a_bounded_number_of_states(workers):
    _, channel, _, _, decode = workers
    prompts = {rid: prompt_of(i, 12) for i, rid in enumerate("abc")}
    for rid in "ab":  # no Generate claims them yet: both are held
        push(channel, rid, prompts[rid])
    with pytest.raises(grpc.RpcError) as err:
        push(channel, "c", prompts["c"])
    assert err.value.code() == EXHAUSTED and "2 states already wait here" in err.value.details()

    # Refused before a frame is read: the stream is consumed up to its first message only.
    pulled = []

    def chunks() -> Iterator[pb.StateChunk]:
        yield pb.StateChunk(request_id="c")
        for frame in state_frames(prompts["c"]):
            pulled.append(frame)
            yield pb.StateChunk(frame=frame)

    context = Context()
    with pytest.raises(AbortedError):
        decode.PushState(chunks(), context)
    assert context.code == EXHAUSTED and pulled == []
    assert "c" not in decode._requests

    # A Generate claims "a", its slot takes the state: room for one more.
    assert tokens_of(decode_call(channel, "a", prompts["a"], 3)) == fake_tokens(
        prompts["a"], 3, CFG.vocab_size
    )
    push(channel, "c", prompts["c"])
    for rid in "bc":
        want = fake_tokens(prompts[rid], 2, CFG.vocab_size)
        assert tokens_of(decode_call(channel, rid, prompts[rid], 2)) == want


def test_a_state_kept_while_its_push_returns_counts_once(workers, monkeypatch):
    """A push that comes while another push's state is already kept but its call has not yet
    returned sees one state held, not two (a prefill worker opens its next push as soon as the
    engine is free, before the previous push's reply is back)."""
    _, channel, _, _, decode = workers
    prompts = {rid: prompt_of(20 + i, 10) for i, rid in enumerate("abc")}
    pushed = []
    reply = pb.PushStateReply

    def reply_and_push_another(**fields):
        if not pushed:  # "a" is kept, its handler not returned: "b" comes now
            pushed.append("b")
            decode.PushState(iter(state_chunks("b", prompts["b"])), Context())  # or AbortedError
        return reply(**fields)

    # The decode worker builds its reply through this module view; the wire sees the real one.
    hooked = types.SimpleNamespace(**{**vars(pb), "PushStateReply": reply_and_push_another})
    monkeypatch.setattr(decode_worker, "pb", hooked)
    push(channel, "a", prompts["a"])
    assert pushed == ["b"]
    with pytest.raises(grpc.RpcError) as err:  # two states held now: the limit
        push(channel, "c", prompts["c"])
    assert err.value.code() == EXHAUSTED and "2 states already wait here" in err.value.details()
    for rid in "ab":
        want = fake_tokens(prompts[rid], 2, CFG.vocab_size)
        assert tokens_of(decode_call(channel, rid, prompts[rid], 2)) == want


def test_the_decode_worker_bounds_waiting_generate_calls(workers):
    _, channel, _, _, decode = workers
    prompts = {rid: prompt_of(10 + i, 9) for i, rid in enumerate("wxyzv")}
    push(channel, "v", prompts["v"])  # a state that comes before its Generate
    waiting = [decode_call(channel, rid, prompts[rid], 2) for rid in "wxy"]
    assert wait_for(lambda: decode.stats()["pending_states"] == 3)
    refused = decode_call(channel, "z", prompts["z"], 2)
    with pytest.raises(grpc.RpcError) as err:
        tokens_of(refused)
    assert err.value.code() == EXHAUSTED and "3 requests already wait here" in err.value.details()
    # A refused Generate whose state came first drops that state: no call will claim it.
    with pytest.raises(grpc.RpcError) as err:
        tokens_of(decode_call(channel, "v", prompts["v"], 2))
    assert err.value.code() == EXHAUSTED and "v" not in decode._requests
    # Once a state comes, its request decodes and finishes, and a new call is taken.
    push(channel, "w", prompts["w"])
    assert tokens_of(waiting[0]) == fake_tokens(prompts["w"], 2, CFG.vocab_size)
    later = decode_call(channel, "z", prompts["z"], 2)
    for rid, call in zip("xyz", [*waiting[1:], later], strict=True):
        push(channel, rid, prompts[rid])
        assert tokens_of(call) == fake_tokens(prompts[rid], 2, CFG.vocab_size)
