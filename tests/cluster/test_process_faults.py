"""Process faults on one fake-engine cluster of real processes, its timeouts read from its config
file by the router's and the workers' own mains (nothing set in a test): `stall_timeout_s = 4`,
`request_timeout_s = 8` (the router's per-attempt deadline, and the workers' state and push
deadlines, serving/worker/main.py).

- A decode process stopped (SIGSTOP) for less than the stall timeout and continued (SIGCONT):
  its stream pauses and finishes where it was, in one attempt.
- One left stopped: no sooner than the stall timeout after the stop, and well before the
  request deadline, the router resumes the stream on the other decode worker from the tokens
  already sent; once continued, the stopped worker frees the cancelled request's slot.
- Two prompts of 2.4 s of prefill each, queued together on the PrfaaS worker: the later one's
  decode stream is silent for longer than the stall timeout while its workers answer, and both
  finish in one attempt (the watch counts silence from the last sign of life, not from the
  attempt's start).
- A decode worker's wait for a state that never comes, and a PrfaaS prefill worker's push to
  an address that takes the connection and never answers (calls made as the cluster starts, so
  the waits overlap the other tests), each end DEADLINE_EXCEEDED after the configured
  `request_timeout_s`, not their built-in defaults.
- SIGTERM to the PrfaaS prefill worker with two prefills in flight: the one that needs less
  than the grace (`STOP_GRACE_S`) finishes there, in one attempt; the one that needs more is cut
  at the end of the grace and the router prefills it again (locally: no PrfaaS worker is left);
  the worker exits 0.
- The rebalancer's drain timing out: a PD-prefill queue makes it drain a decode node to switch
  it to prefill, but the node's stream outlasts `drain_timeout_s`; the change is abandoned once
  the timeout expires (the stream still running), the node keeps its role, and every request
  finishes with its tokens.
- SIGTERM to the HTTP front door (`prfaas openai`, its own process) with a streamed completion
  in flight: the stream ends with every token and ``[DONE]``, a new connection is refused, the
  process exits 0.

Oracle: the fake engines' tokens (`fake_tokens`: each depends on the whole sequence before it,
so a token repeated, skipped or decoded from the wrong place changes all that follow).
Decode steps take 20 ms, prefill 5 ms per token.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import openai
import pytest
from serving_support import Stream, child, fake_config, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.server import STOP_GRACE_S

VOCAB = load_model_config("tiny").vocab_size  # fake_config's preset
STALL_S, REQUEST_TIMEOUT_S, DRAIN_TIMEOUT_S = 4.0, 8.0, 1.0
PREFILL_S_PER_TOKEN, DECODE_STEP_S = 0.005, 0.02
DECODERS = ("pd-1", "pd-2")
WAIT_S = 60.0  # bounds a broken run only


def prompt(n: int, offset: int) -> list[int]:
    return [(offset + 13 * i) % VOCAB for i in range(n)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(cluster, ready, router stub, {decode worker: control stub}, the unclaimed wait: when it
    began and its future)."""
    root = tmp_path_factory.mktemp("process-faults")
    path = fake_config(
        root / "cluster.toml",
        fake={"decode_step_s": DECODE_STEP_S, "prefill_s_per_token": PREFILL_S_PER_TOKEN},
        instances={"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": len(DECODERS)},
        router={"stall_timeout_s": STALL_S, "request_timeout_s": REQUEST_TIMEOUT_S},
        # Moves a decode node to prefill only under a PD-prefill queue (the drain test makes
        # one); its drain gives up after `DRAIN_TIMEOUT_S`.
        rebalancer={
            "enabled": True,
            "period_s": 0.25,
            "consecutive": 2,
            "min_samples": 8,
            "drain_timeout_s": DRAIN_TIMEOUT_S,
        },
        profile={
            "prfaas_prefill_s": [0.0, PREFILL_S_PER_TOKEN],
            "pd_prefill_s": [0.0, PREFILL_S_PER_TOKEN],
            "decode_step_s": DECODE_STEP_S,
        },
    )
    with (
        ClusterProcesses(path, log_dir=root / "logs") as cluster,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
        socket.create_server(("127.0.0.1", 0)) as silent,  # listens, never accepts
    ):
        ready = cluster.start()
        channels = {n: grpc.insecure_channel(ready["workers"][n]["address"]) for n in DECODERS}
        prfaas = grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"])
        silent_address = f"127.0.0.1:{silent.getsockname()[1]}"
        began = time.monotonic()
        waits = {
            "state": (began, pool.submit(wait_for_a_state, channels[DECODERS[0]])),
            "push": (began, pool.submit(push_to_a_silent_decode_side, prfaas, silent_address)),
        }
        with grpc.insecure_channel(ready["router"]) as channel:
            controls = {n: pb_grpc.WorkerControlStub(c) for n, c in channels.items()}
            yield cluster, ready, pb_grpc.RouterStub(channel), controls, waits
            for _, future in waits.values():
                future.result(timeout=WAIT_S)
        for c in [*channels.values(), prfaas]:
            c.close()


def ended_how(call: Callable[[], object]) -> tuple[float, grpc.RpcError | None]:
    """When `call` ended, and its error if it failed."""
    try:
        call()
    except grpc.RpcError as err:
        return time.monotonic(), err
    return time.monotonic(), None


def wait_for_a_state(channel: grpc.Channel) -> tuple[float, grpc.RpcError | None]:
    """A decode call for a state nobody pushes: when it ended, and how."""
    request = pb.DecodeRequest(request_id="never-pushed", prompt_len=24, max_new_tokens=4)
    stub = pb_grpc.DecodeWorkerStub(channel)
    return ended_how(lambda: list(stub.Generate(request, timeout=REQUEST_TIMEOUT_S + 15)))


def push_to_a_silent_decode_side(
    channel: grpc.Channel, address: str
) -> tuple[float, grpc.RpcError | None]:
    """A prefill on the PrfaaS worker whose state goes to `address`, where the connection is
    taken and nothing ever answers: when the call ended, and how."""
    request = pb.PrefillRequest(
        request_id="never-accepted", prompt_token_ids=prompt(24, 9), decode_address=address
    )
    stub = pb_grpc.PrefillWorkerStub(channel)
    return ended_how(lambda: stub.Prefill(request, timeout=REQUEST_TIMEOUT_S + 15))


def holder(controls: dict[str, pb_grpc.WorkerControlStub]) -> str:
    """The decode worker with a stream under way (the tests run one at a time)."""
    busy = [
        n for n, c in controls.items() if c.GetStats(pb.GetStatsRequest(), timeout=5).active_slots
    ]
    assert len(busy) == 1, busy
    return busy[0]


def stop_the_holder(
    cluster: ClusterProcesses, controls: dict[str, pb_grpc.WorkerControlStub]
) -> tuple[str, int]:
    """SIGSTOP the decode worker with the stream under way: its name and pid."""
    name = holder(controls)
    pid = cluster.worker_pid(name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGSTOP)
    return name, pid


def start(stub: pb_grpc.RouterStub, tokens: list[int], n: int) -> Stream:
    stream = Stream(stub, tokens, n, WAIT_S)
    assert wait_for(lambda: len(stream.tokens) >= 3 or stream.error, WAIT_S), "no tokens"
    assert stream.error is None, stream.error
    return stream


def test_a_decode_process_stopped_briefly_finishes_its_stream_in_place(served):
    cluster, _, stub, controls, _ = served
    stream = start(stub, prompt(24, 1), 50)
    name, pid = stop_the_holder(cluster, controls)
    try:
        time.sleep(0.3)  # what was already on the wire arrives
        frozen = len(stream.tokens)
        time.sleep(0.5)
        assert len(stream.tokens) == frozen < stream.n, "the process did not stop"
    finally:
        os.kill(pid, signal.SIGCONT)
    stream.join()
    assert stream.error is None, stream.error
    assert stream.tokens == stream.expected
    assert (stream.report.attempts, stream.report.decode_instance) == (1, name)


@pytest.mark.slow  # the module's processes run ~25 s on 2 cores: started with the long files
def test_a_decode_process_left_stopped_is_bypassed_after_the_stall_timeout(served):
    cluster, _, stub, controls, _ = served
    stream = start(stub, prompt(24, 2), 30)
    name, pid = stop_the_holder(cluster, controls)
    stopped = time.monotonic()
    try:
        stream.join()
        time.sleep(0.2)
        delivered = len(stream.tokens)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stream.error is None, stream.error
    assert stream.tokens == stream.expected and delivered == stream.n  # each token once
    report = stream.report
    assert report.attempts == 2 and report.decode_instance != name
    assert 3 <= report.resumed_from < stream.n
    # The router's stall watchdog cut the attempt (not the request deadline): its timeout is
    # the config file's.
    assert STALL_S <= stream.ended_at - stopped < REQUEST_TIMEOUT_S - 1.0
    # Continued, the worker frees the slot of the attempt the router cancelled.
    control = controls[name]

    def idle() -> bool:
        return control.GetStats(pb.GetStatsRequest(), timeout=5).active_slots == 0

    assert wait_for(idle, WAIT_S), f"{name} still holds the cancelled stream"


def test_prefills_longer_than_the_stall_timeout_finish_in_one_attempt(served):
    _, _, stub, *_ = served
    # Two prompts of 2.4 s each on the one PrfaaS worker: the decode stream of the one that
    # waits for the other is silent for 4.8 s, while both of its workers answer.
    n = 480
    assert n * PREFILL_S_PER_TOKEN < STALL_S < 2 * n * PREFILL_S_PER_TOKEN
    streams = [Stream(stub, prompt(n, 20 + k), 4, WAIT_S) for k in range(2)]
    for stream in streams:
        stream.join()
        assert stream.error is None, stream.error
        assert stream.tokens == stream.expected
        assert (stream.report.route, stream.report.attempts) == ("prfaas", 1)
    assert max(stream.report.ttft_s for stream in streams) > STALL_S


def test_sigterm_to_the_prfaas_prefill_worker_with_prefills_in_flight(served):
    cluster, ready, stub, *_, waits = served
    waits["push"][1].result(timeout=WAIT_S)  # the worker holds no other call when stopped
    # 100 tokens need 0.5 s of prefill, 480 tokens 2.4 s: more than the grace on their own.
    short_len, long_len = 100, 480
    assert short_len * PREFILL_S_PER_TOKEN < STOP_GRACE_S < long_len * PREFILL_S_PER_TOKEN
    with grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"]) as channel:
        control = pb_grpc.WorkerControlStub(channel)

        def arrived(n: int) -> bool:
            return control.GetStats(pb.GetStatsRequest(), timeout=5).queue_depth >= n

        # The short one first, so that it is the one on the engine when the signal comes.
        short = Stream(stub, prompt(short_len, 3), 10, WAIT_S)
        assert wait_for(lambda: arrived(1), WAIT_S), "the short prefill never reached the worker"
        long = Stream(stub, prompt(long_len, 4), 10, WAIT_S)
        assert wait_for(lambda: arrived(2), WAIT_S), "the long prefill never reached the worker"
    worker = child(cluster, "prfaas-0")
    worker.send_signal(signal.SIGTERM)
    short.join()
    long.join()
    for stream in (short, long):
        assert stream.error is None, stream.error
        assert stream.tokens == stream.expected
    assert (short.report.route, short.report.attempts) == ("prfaas", 1)
    assert long.report.attempts == 2 and long.report.prefill_instance == "pd-0"
    assert worker.wait(timeout=WAIT_S) == 0


def test_sigterm_to_the_front_door_with_a_stream_in_flight(served, tmp_path):
    _, ready, *_ = served
    address_file = tmp_path / "front-door.json"
    command = [sys.executable, "-m", "prfaas_jax.cli", "openai", "--router", ready["router"]]
    command += ["--port", "0", "--address-file", str(address_file)]
    door = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: address_file.exists() or door.poll() is not None, WAIT_S)
        assert door.poll() is None, door.stderr.read().decode()[-3000:]
        base_url = json.loads(address_file.read_text())["base_url"]
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        text, n = "Stop me, gently.", 60  # under t: the PD route
        knobs = {"max_tokens": n, "temperature": 0, "extra_body": {"ignore_eos": True}}
        stream = client.completions.create(model=model, prompt=text, stream=True, **knobs)
        pieces = [next(stream).choices[0].text]
        door.send_signal(signal.SIGTERM)
        pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
        tokenizer = ByteTokenizer()
        assert "".join(pieces) == tokenizer.decode(fake_tokens(tokenizer.encode(text), n, VOCAB))
        assert door.wait(timeout=WAIT_S) == 0
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    finally:
        if door.poll() is None:
            door.kill()
            door.wait()


def test_a_drain_that_outlasts_its_timeout_is_abandoned(served):
    _, _, stub, controls, _ = served
    # A stream on each decode node (the router fills the emptier one): 150 steps, 3 s.
    streams = [Stream(stub, prompt(24, 10 + k), 150, WAIT_S) for k in range(len(DECODERS))]
    assert wait_for(lambda: all(len(s.tokens) >= 3 for s in streams), WAIT_S), "no tokens"
    for name, control in controls.items():
        assert control.GetStats(pb.GetStatsRequest(), timeout=5).active_slots == 1, name
    # PD prefill (48 tokens: 0.24 s each on the one PD prefill node) at 8 per second.
    burst: list[Stream] = []
    for k in range(24):
        burst.append(Stream(stub, prompt(48, 100 + k), 2, WAIT_S))
        if stub.GetStats(pb.GetStatsRequest(), timeout=5).draining:
            break
        time.sleep(0.125)
    assert wait_for(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=5).draining, WAIT_S)
    began = time.monotonic()
    (node,) = stub.GetStats(pb.GetStatsRequest(), timeout=5).draining
    assert wait_for(lambda: not stub.GetStats(pb.GetStatsRequest(), timeout=5).draining, WAIT_S)
    drained_s = time.monotonic() - began
    assert not any(s.ended_at for s in streams), "a stream ended before the drain gave up"
    assert controls[node].GetStats(pb.GetStatsRequest(), timeout=5).active_slots >= 1
    assert drained_s <= DRAIN_TIMEOUT_S + 1.0  # gave up on its timeout, not on the stream
    stats = stub.GetStats(pb.GetStatsRequest(), timeout=5)
    assert stats.role_changes == 0
    assert {w.name: w.role for w in stats.workers if w.name in DECODERS} == dict.fromkeys(
        DECODERS, pb.ROLE_PD_DECODE
    )
    for stream in streams + burst:
        stream.join()
        assert stream.error is None, stream.error
        assert stream.tokens == stream.expected


def test_a_decode_worker_waits_for_a_state_as_long_as_its_config_says(served):
    *_, waits = served
    began, future = waits["state"]
    ended, error = future.result(timeout=WAIT_S)
    assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no state or token within 8 s" in error.details()  # the worker's own deadline
    assert REQUEST_TIMEOUT_S <= ended - began < REQUEST_TIMEOUT_S + 5


def test_a_prefill_worker_pushes_for_as_long_as_its_config_says(served):
    *_, waits = served
    began, future = waits["push"]
    ended, error = future.result(timeout=WAIT_S)
    assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # The push's own deadline, not the call's (REQUEST_TIMEOUT_S + 15 s).
    assert error.details().endswith("no answer within the push deadline of 8 s"), error.details()
    assert REQUEST_TIMEOUT_S <= ended - began < REQUEST_TIMEOUT_S + 5
