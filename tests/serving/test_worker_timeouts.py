"""The workers' own deadlines: the decode worker's `state_timeout_s` and the prefill worker's
`push_timeout_s` (in a cluster both are `router.request_timeout_s`, serving/worker/main.py).

In process, fake engines, services on loopback servers, timeouts of 1 s:

- a state that no `Generate` claims is dropped, no sooner than `state_timeout_s` after it
  arrived: the worker then holds nothing, and a `Generate` for that request finds no state;
- a `Generate` whose state never comes waits (`pending_states` = 1) and fails
  DEADLINE_EXCEEDED no sooner than `state_timeout_s`, leaving nothing behind; one whose state
  comes in time is served;
- a prefill whose push the decode side accepts but never finishes fails DEADLINE_EXCEEDED no
  sooner than `push_timeout_s`, and frees the worker: nothing queued or transferring, and the
  next prefill runs at once.

Each lower bound is measured from before the event that starts the clock; upper bounds are
generous deadlines only.
"""

from __future__ import annotations

import threading
import time
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
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService

CFG = load_model_config("tiny")
TIMEOUT_S = 1.0
WAIT_S = 20.0  # bounds a broken run only
PROMPT = [(7 * i + 2) % CFG.vocab_size for i in range(24)]


@pytest.fixture
def decode() -> Iterator[tuple[DecodeService, pb_grpc.DecodeWorkerStub]]:
    service = DecodeService(
        engine=lambda: FakeDecodeEngine(CFG, max_slots=2, max_len=512),
        cfg=CFG,
        max_len=512,
        admit=lambda context: None,
        state_timeout_s=TIMEOUT_S,
    )
    server = serve_workers(decode=service)
    with grpc.insecure_channel(server.address) as channel:
        yield service, pb_grpc.DecodeWorkerStub(channel)
    service.stop()
    server.stop(grace_s=0.5)


def push(stub: pb_grpc.DecodeWorkerStub, request_id: str) -> None:
    result = FakePrefillEngine(CFG).prefill(PROMPT)
    frames = list(codec.encode(result.state, CFG))
    frames.append(pack_handoff(Handoff(result.first_token, GREEDY), frames[0]))
    chunks = [pb.StateChunk(request_id=request_id), *(pb.StateChunk(frame=f) for f in frames)]
    stub.PushState(iter(chunks), timeout=WAIT_S)


def generate(stub: pb_grpc.DecodeWorkerStub, request_id: str, n: int = 4) -> list[int]:
    request = pb.DecodeRequest(request_id=request_id, prompt_len=len(PROMPT), max_new_tokens=n)
    return [t for message in stub.Generate(request, timeout=WAIT_S) for t in message.token_ids]


def assert_no_state_comes(stub: pb_grpc.DecodeWorkerStub, request_id: str) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, request_id)
    waited = time.monotonic() - started
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.details() == f"{request_id}: no state or token within 1 s"
    assert TIMEOUT_S <= waited < TIMEOUT_S + 10.0, waited


def test_an_unclaimed_state_is_dropped_after_state_timeout(decode):
    service, stub = decode
    pushed = time.monotonic()
    push(stub, "orphan")
    assert service.busy  # parked, waiting for its Generate
    assert wait_for(lambda: not service.busy, WAIT_S), "the state was never dropped"
    assert time.monotonic() - pushed >= TIMEOUT_S
    assert service.stats()["state_bytes_received"] > 0  # it did arrive
    # Gone for good: a late Generate waits for a state that no longer exists.
    assert_no_state_comes(stub, "orphan")
    assert not service.busy


def test_a_generate_whose_state_never_comes_is_deadline_exceeded(decode):
    service, stub = decode
    waiter = threading.Thread(target=assert_no_state_comes, args=(stub, "no-state"))
    waiter.start()
    assert wait_for(lambda: service.stats()["pending_states"] == 1, WAIT_S)
    waiter.join(WAIT_S)
    assert not waiter.is_alive()
    assert service.stats()["pending_states"] == 0 and not service.busy
    # A state claimed in time is served.
    push(stub, "in-time")
    assert generate(stub, "in-time") == fake_tokens(PROMPT, 4, CFG.vocab_size)
    assert not service.busy


class BlackHole(pb_grpc.DecodeWorkerServicer):
    """A decode worker that accepts a push and never finishes it."""

    def __init__(self) -> None:
        self.release, self.opened = threading.Event(), threading.Event()

    def PushState(self, request_iterator, context):  # noqa: N802
        next(request_iterator)
        self.opened.set()
        self.release.wait(WAIT_S)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")


def test_a_push_that_never_finishes_fails_the_prefill_after_push_timeout():
    hole = BlackHole()
    good = DecodeService(
        engine=lambda: FakeDecodeEngine(CFG, max_slots=2, max_len=512),
        cfg=CFG,
        max_len=512,
        admit=lambda context: None,
    )
    prefill = PrefillService(
        engine=lambda: FakePrefillEngine(CFG),
        cfg=CFG,
        max_len=512,
        frame_bytes=4096,
        shaper=None,
        admit=lambda context: None,
        push_timeout_s=TIMEOUT_S,
    )
    servers = [serve_workers(decode=hole), serve_workers(prefill=prefill, decode=good)]
    hole_address, address = (server.address for server in servers)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.PrefillWorkerStub(channel)

            def request(request_id: str, decode_address: str) -> pb.PrefillRequest:
                return pb.PrefillRequest(
                    request_id=request_id, prompt_token_ids=PROMPT, decode_address=decode_address
                )

            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(request("lost", hole_address), timeout=WAIT_S)
            waited = time.monotonic() - started
            assert hole.opened.is_set()
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
            assert err.value.details().startswith(f"pushing the state to {hole_address}: ")
            assert TIMEOUT_S <= waited < TIMEOUT_S + 10.0, waited
            assert wait_for(lambda: not prefill.busy, WAIT_S)
            assert (prefill.queued, prefill.transferring, prefill.completed) == (0, 0, 0)
            # The engine is free: the next prefill, to a decode worker that reads, goes through.
            reply = stub.Prefill(request("next", address), timeout=WAIT_S)
            assert reply.first_token == fake_tokens(PROMPT, 1, CFG.vocab_size)[0]
            assert prefill.completed == 1
    finally:
        hole.release.set()
        good.stop()
        for server in servers:
            server.stop(grace_s=0.5)
