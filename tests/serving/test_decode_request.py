"""The decode worker's request lifecycle (serving/worker/decode_request.py).

The table alone: every phase has an entry, the phases form no cycle, every path from NEW ends in
a final phase, and `move` follows every legal path and refuses every other change with
`IllegalTransitionError`. Then the decode service over the fake engine, in process: each way a
request can go records exactly the expected path, and `pending_states` counts only the requests
still waiting for their state.
"""

from __future__ import annotations

import itertools
import threading

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
from prfaas_jax.serving.worker.decode_request import (
    LEGAL_TRANSITIONS,
    DecodeRequest,
    IllegalTransitionError,
    Phase,
)

CFG = load_model_config("tiny")
FINAL = {Phase.FINISHED, Phase.FAILED, Phase.CANCELLED}
P = Phase


def legal_paths(start: Phase = Phase.NEW) -> list[tuple[Phase, ...]]:
    """Every path through the table from `start` to a phase with no way out."""
    if not LEGAL_TRANSITIONS[start]:
        return [(start,)]
    return [(start, *rest) for nxt in LEGAL_TRANSITIONS[start] for rest in legal_paths(nxt)]


# --- the table -------------------------------------------------------------------------------


def test_every_phase_has_an_entry_and_only_final_phases_are_dead_ends():
    assert set(LEGAL_TRANSITIONS) == set(Phase)
    assert {phase for phase, nexts in LEGAL_TRANSITIONS.items() if not nexts} == FINAL
    assert all(phase not in nexts for phase, nexts in LEGAL_TRANSITIONS.items())


def test_every_legal_path_ends_in_a_final_phase_and_move_follows_it():
    paths = legal_paths()  # recursion would not end on a cycle
    assert {path[-1] for path in paths} == FINAL
    for phase in Phase:
        assert any(phase in path for path in paths), f"{phase.name} is unreachable"
    for path in paths:
        request = DecodeRequest("r", 0.0)
        for phase in path[1:]:
            request.move(phase)
            assert request.phase is phase
        assert request.ended


def test_the_paths_the_worker_takes_are_legal():
    claimed = [
        (P.NEW, P.PARKED, P.READY, P.TAKEN, P.DECODING, P.FINISHED),  # state first
        (P.NEW, P.WAITING, P.READY, P.TAKEN, P.DECODING, P.FINISHED),  # Generate first
        (P.NEW, P.WAITING, P.READY, P.TAKEN, P.FINISHED),  # one token: no slot
        (P.NEW, P.WAITING, P.READY, P.TAKEN, P.FAILED),  # the engine refused the state
        (P.NEW, P.PARKED, P.READY, P.TAKEN, P.DECODING, P.FAILED),  # a step failed
        (P.NEW, P.WAITING, P.CANCELLED),  # the client left before its state came
        (P.NEW, P.PARKED, P.READY, P.CANCELLED),  # ... before a slot was free
        (P.NEW, P.WAITING, P.READY, P.TAKEN, P.DECODING, P.CANCELLED),  # ... mid-stream
    ]
    assert set(claimed) <= set(legal_paths())


def test_every_illegal_change_raises_and_changes_nothing():
    for source, target in itertools.product(Phase, Phase):
        if target in LEGAL_TRANSITIONS[source]:
            continue
        request = DecodeRequest("r", 0.0, phase=source)
        with pytest.raises(IllegalTransitionError, match=f"{source.name} → {target.name}"):
            request.move(target)
        assert request.phase is source


def test_claimed_and_ended():
    assert [p for p in Phase if not DecodeRequest("r", 0.0, phase=p).claimed] == [P.NEW, P.PARKED]
    assert {p for p in Phase if DecodeRequest("r", 0.0, phase=p).ended} == FINAL


# --- the decode service ----------------------------------------------------------------------


class Recorder:
    """Records every `DecodeRequest.move` by request id (patched in for one test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: dict[str, list[Phase]] = {}
        self._lock = threading.Lock()
        move = DecodeRequest.move

        def recording_move(request: DecodeRequest, to: Phase) -> None:
            with self._lock:
                self.paths.setdefault(request.request_id, [request.phase]).append(to)
            move(request, to)

        monkeypatch.setattr(DecodeRequest, "move", recording_move)


@pytest.fixture
def decode(monkeypatch):
    recorder = Recorder(monkeypatch)
    service = DecodeService(
        engine=lambda: FakeDecodeEngine(CFG, max_slots=2, max_len=64, step_s=0.02),
        cfg=CFG,
        max_len=64,
        admit=lambda context: None,
        state_timeout_s=10.0,
    )
    server = serve_workers(decode=service)
    channel = grpc.insecure_channel(server.address)
    yield service, pb_grpc.DecodeWorkerStub(channel), recorder
    channel.close()
    service.stop()
    server.stop(grace_s=0.5)


def state_chunks(request_id: str, prompt: list[int], *, frames: int | None = None):
    """The push of `prompt`'s state and handoff frame, or of its first `frames` frames."""
    result = FakePrefillEngine(CFG).prefill(prompt)
    stream = list(codec.encode(result.state, CFG))
    stream.append(pack_handoff(Handoff(result.first_token, GREEDY), stream[0]))
    chunks = (pb.StateChunk(frame=f) for f in stream[:frames])
    return [pb.StateChunk(request_id=request_id), *chunks]


def push(stub: pb_grpc.DecodeWorkerStub, request_id: str, prompt: list[int]) -> None:
    stub.PushState(iter(state_chunks(request_id, prompt)), timeout=10)


def generate(stub: pb_grpc.DecodeWorkerStub, request_id: str, prompt: list[int], n: int):
    request = pb.DecodeRequest(request_id=request_id, prompt_len=len(prompt), max_new_tokens=n)
    return stub.Generate(request, timeout=10)


def tokens_of(call) -> list[int]:
    return [t for message in call for t in message.token_ids]


def test_each_way_through_the_service_takes_its_path(decode):
    service, stub, recorder = decode
    prompt = [3, 1, 4, 1, 5]
    want = fake_tokens(prompt, 4, CFG.vocab_size)

    push(stub, "state-first", prompt)
    assert tokens_of(generate(stub, "state-first", prompt, 4)) == want

    waiting = generate(stub, "generate-first", prompt, 4)
    assert wait_for(lambda: service.stats()["pending_states"] == 1)
    push(stub, "generate-first", prompt)
    assert tokens_of(waiting) == want

    push(stub, "one-token", prompt)
    assert tokens_of(generate(stub, "one-token", prompt, 1)) == want[:1]

    left = generate(stub, "left-waiting", prompt, 4)
    assert wait_for(lambda: service.stats()["pending_states"] == 1)
    left.cancel()

    push(stub, "left-mid-stream", prompt)
    streaming = generate(stub, "left-mid-stream", prompt, 40)
    next(streaming)  # the first token: it holds a slot now
    assert wait_for(lambda: service.stats()["active_slots"] == 1)
    assert service.stats()["pending_states"] == 0  # a decoding request waits for no state
    streaming.cancel()

    assert wait_for(lambda: not service.busy)
    assert recorder.paths == {
        "state-first": [P.NEW, P.PARKED, P.READY, P.TAKEN, P.DECODING, P.FINISHED],
        "generate-first": [P.NEW, P.WAITING, P.READY, P.TAKEN, P.DECODING, P.FINISHED],
        "one-token": [P.NEW, P.PARKED, P.READY, P.TAKEN, P.FINISHED],
        "left-waiting": [P.NEW, P.WAITING, P.CANCELLED],
        "left-mid-stream": [P.NEW, P.PARKED, P.READY, P.TAKEN, P.DECODING, P.CANCELLED],
    }
    assert service.stats()["completed"] == 3


class AbortedError(Exception):
    """`ServerContext.abort` ends the handler as gRPC's does."""


class ServerContext:
    """What `PushState` uses of a gRPC server context. `cancelled`: its client cancelled the call,
    so gRPC runs the call's callbacks (at once here, milliseconds later in gRPC)."""

    def __init__(self, *, cancelled: bool) -> None:
        self.cancelled = cancelled
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def add_callback(self, callback) -> bool:
        if self.cancelled:
            callback()
        return True

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"  # the sending connection

    def abort(self, code: grpc.StatusCode, details: str):
        self.code, self.details = code, details
        raise AbortedError(details)


def test_a_cut_push_fails_nothing_and_a_short_one_fails_its_request(decode):
    """gRPC's server can end a cancelled request stream like a complete one before it reports
    the cancel. Such a cut push is CANCELLED and leaves the waiting `Generate` to the next push;
    a stream that stops short while its sender is still there is malformed: INVALID_ARGUMENT,
    and the waiting `Generate` fails with it."""
    service, stub, recorder = decode
    prompt = [2, 7, 1, 8, 2]
    want = fake_tokens(prompt, 4, CFG.vocab_size)
    header_and_one = 2

    waiting = generate(stub, "cut", prompt, 4)
    assert wait_for(lambda: service.stats()["pending_states"] == 1)
    cut = ServerContext(cancelled=True)
    with pytest.raises(AbortedError):
        service.PushState(iter(state_chunks("cut", prompt, frames=header_and_one)), cut)
    assert cut.code is grpc.StatusCode.CANCELLED, cut.details
    assert service.stats()["pending_states"] == 1  # still waiting, for the retried push
    push(stub, "cut", prompt)
    assert tokens_of(waiting) == want

    waiting = generate(stub, "short", prompt, 4)
    assert wait_for(lambda: service.stats()["pending_states"] == 1)
    short = ServerContext(cancelled=False)
    with pytest.raises(AbortedError):
        service.PushState(iter(state_chunks("short", prompt, frames=header_and_one)), short)
    assert short.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "does not end with a handoff frame" in short.details
    with pytest.raises(grpc.RpcError) as failed:
        tokens_of(waiting)
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "short: its state was rejected" in failed.value.details()

    assert wait_for(lambda: not service.busy)
    assert recorder.paths == {
        "cut": [P.NEW, P.WAITING, P.READY, P.TAKEN, P.DECODING, P.FINISHED],
        "short": [P.NEW, P.WAITING, P.CANCELLED],  # its call ended on the rejected state
    }
