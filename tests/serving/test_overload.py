"""Overload protection: bounded worker queues, and the router shedding a 10× burst.

Worker bounds run in process on loopback (fake engines): a prefill worker holds at most
`max_queue` requests, a decode worker at most `max_pending_states` states outside a slot and
`max_waiting` `Generate` calls waiting; anything beyond is RESOURCE_EXHAUSTED at once.

`test_router_sheds_a_10x_burst` runs a cluster of real processes and checks the router's
admission (`[router] max_in_flight`, `ttft_slo_s`; policy/admission.py) end to end.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling import GREEDY
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.prefill import PrefillService

from .serving_helpers import fake_config, serve_workers

CFG = load_model_config("tiny")
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
WAIT_S = 10.0


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * i) % CFG.vocab_size for i in range(length)]


def wait_for(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


# --- worker bounds, in process --------------------------------------------------------------


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


def push(channel: grpc.Channel, request_id: str, prompt: list[int]) -> pb.PushStateReply:
    chunks = [pb.StateChunk(request_id=request_id)]
    chunks += [pb.StateChunk(frame=frame) for frame in state_frames(prompt)]
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


# --- the router under a 10× burst (real processes) -------------------------------------------

MAX_IN_FLIGHT = 6
TTFT_SLO_S = 1.0
# Emulated hardware and the router's view of it agree: 4 ms per prefilled token on either
# cluster, 10 ms per decode step, 4 slots on the one decode node.
BURST_CLUSTER = {
    "engine": {"max_slots": 4},
    "fake": {"prefill_s_per_token": 0.004, "decode_step_s": 0.01},
    "router": {"max_in_flight": MAX_IN_FLIGHT, "ttft_slo_s": TTFT_SLO_S},
    "profile": {
        "prfaas_prefill_s": [0.0, 0.004],
        "pd_prefill_s": [0.0, 0.004],
        "decode_step_s": 0.01,
    },
}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        line = next(line for line in fh if line.startswith("VmRSS:"))
    return int(line.split()[1])


def burst(stub: pb_grpc.RouterStub, requests: list[tuple[list[int], int]]) -> list[tuple]:
    """Send every request at once; each outcome is ("ok", tokens, report, seconds) or
    (status code, details, seconds)."""
    barrier = threading.Barrier(len(requests))

    def call(prompt: list[int], n: int) -> tuple:
        tokens, report = [], None
        barrier.wait()
        start = time.monotonic()
        try:
            request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n)
            for message in stub.Generate(request, timeout=60):
                tokens.extend(message.token_ids)
                report = message.report if message.finished else report
        except grpc.RpcError as err:
            return err.code(), err.details(), time.monotonic() - start
        return "ok", tokens, report, time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(call, prompt, n) for prompt, n in requests]
        return [future.result(timeout=90) for future in futures]


class InFlightWatch:
    """Polls the router's `requests_in_flight` until stopped; keeps the highest."""

    def __init__(self, stub: pb_grpc.RouterStub) -> None:
        self.stub, self.highest, self.polls = stub, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            stats = self.stub.GetStats(pb.GetStatsRequest(), timeout=5)
            self.highest = max(self.highest, stats.requests_in_flight)
            self.polls += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def check_outcomes(outcomes: list[tuple], requests: list[tuple[list[int], int]]) -> list[str]:
    """Every call completed with its own tokens, within the SLO (with room for the emulation's
    overheads), or was refused at once for one of the two reasons; the refusals' details."""
    refusals = []
    for outcome, (prompt, n) in zip(outcomes, requests, strict=True):
        if outcome[0] == "ok":
            assert outcome[1] == fake_tokens(prompt, n, CFG.vocab_size)
            assert outcome[2] is not None and outcome[2].ttft_s <= 2 * TTFT_SLO_S
        else:
            code, details, seconds = outcome
            assert code == EXHAUSTED, (code, details)
            assert "in flight" in details or "SLO" in details, details
            assert seconds < TTFT_SLO_S / 2, f"refused after {seconds:.2f} s: {details}"
            refusals.append(details)
    return refusals


def test_router_sheds_a_10x_burst(tmp_path):
    """10 × max_in_flight requests at once, twice: short prompts with long outputs (the
    in-flight bound sheds them), then long prompts that queue for the PrfaaS prefill (the
    TTFT SLO sheds them). Nothing is lost, every accepted request is right, memory holds."""
    config = fake_config(tmp_path / "cluster.toml", **BURST_CLUSTER)
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as cluster:
        ready = cluster.start()
        pids = [ready["router_pid"], *(w["pid"] for w in ready["workers"].values())]
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            warm = [(prompt_of(1, 16), 4), (prompt_of(2, 200), 4)]  # both routes, once each
            assert check_outcomes(burst(stub, warm[:1]) + burst(stub, warm[1:]), warm) == []
            rss_before = {pid: rss_kib(pid) for pid in pids}

            watch = InFlightWatch(stub)
            try:
                # 16-token prompts (PD, 64 ms) decoding 40 tokens (0.4 s): the in-flight
                # bound fills long before the predicted TTFT nears the SLO.
                short = [(prompt_of(100 + i, 16), 40) for i in range(10 * MAX_IN_FLIGHT)]
                refused_short = check_outcomes(burst(stub, short), short)
                assert len(short) // 2 <= len(refused_short) < len(short)
                assert sum("in flight" in d for d in refused_short) >= len(short) // 2
                assert stub.GetStats(pb.GetStatsRequest()).rejected == len(refused_short)
                # 200-token prompts (PrfaaS, 0.8 s each): a second one in the queue already
                # predicts 1.6 s > 1 s.
                long = [(prompt_of(200 + i, 200), 4) for i in range(10 * MAX_IN_FLIGHT)]
                refused_long = check_outcomes(burst(stub, long), long)
                assert len(long) // 2 <= len(refused_long) < len(long)
                assert sum("SLO" in d for d in refused_long) >= len(long) // 2
            finally:
                watch.stop()
            assert wait_for(
                lambda: stub.GetStats(pb.GetStatsRequest()).requests_in_flight == 0, 5.0
            )
            stats = stub.GetStats(pb.GetStatsRequest())
            # Refusals are counted as such, not as failed requests.
            assert stats.rejected == len(refused_short) + len(refused_long)
            assert stats.requests_failed == 0
            assert watch.polls > 10 and 1 <= watch.highest <= MAX_IN_FLIGHT
            # Still serving after the burst.
            after = [(prompt_of(3, 30), 5)]
            assert check_outcomes(burst(stub, after), after) == []
        for pid in pids:
            assert rss_kib(pid) <= 1.5 * rss_before[pid] + 64 * 1024, pid
