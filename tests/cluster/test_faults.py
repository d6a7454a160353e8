"""Worker faults on a fake-engine cluster of real processes: a PrfaaS prefill worker SIGKILLed
mid-transfer and a decode worker SIGKILLed mid-stream. Every request still completes, each token
exactly once, with the output of one uninterrupted run (`fake_tokens`: each fake token depends
on the whole sequence before it, so a skipped, repeated or misplaced token changes every token
after it; a seeded sampled request's depend on its seed and each token's index as well, so a
resumed request that restarts its key schedule changes too); the launcher replaces the dead
worker and the router routes to the replacement."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import grpc
import pytest
from serving_support import fake_config, generate

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
# 100 KB/s: the 57.6 KB state of a 300-token prompt is on the link for over half a second.
OVERRIDES = {
    "fake": {"prefill_s_per_token": 0.0005, "decode_step_s": 0.02},
    "link": {"bandwidth_mbps": 0.8, "latency_ms": 2.0},
    "router": {"retry_wait_s": 60.0, "stall_timeout_s": 4.0},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    path = fake_config(root / "cluster.toml", **OVERRIDES)
    with ClusterProcesses(path, log_dir=root / "logs", restart_workers=True) as cluster:
        ready = cluster.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            yield cluster, pb_grpc.RouterStub(channel)


def egress_bytes(cluster: ClusterProcesses, name: str) -> int:
    """Bytes `name` has put on the inter-cluster link (its current process: a replacement
    starts from 0)."""
    with grpc.insecure_channel(cluster.ready["workers"][name]["address"]) as channel:
        stats = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=5)
    return stats.egress_bytes


SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=2**33 + 5)


def knobs(sampling: SamplingParams) -> dict:
    """The `GenerateRequest` fields of `sampling`."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed}


def prompt(n: int, offset: int) -> list[int]:
    return [(offset + 13 * i) % VOCAB for i in range(n)]


def kill(cluster: ClusterProcesses, name: str) -> None:
    pid = cluster.worker_pid(name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGKILL)


def wait_replaced(cluster: ClusterProcesses, restarts: int) -> None:
    deadline = time.monotonic() + 60
    while cluster.restarts < restarts and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.restarts >= restarts, "the dead worker was not replaced"


def routed_to(stub: pb_grpc.RouterStub, length: int, instance: str) -> bool:
    """Whether a request of `length` tokens reaches `instance` within a few control periods
    (the router adopts a replacement at its next workers-file check)."""
    for k in range(40):
        reply = generate(stub, prompt(length, k), 2)
        assert reply.tokens == fake_tokens(prompt(length, k), 2, VOCAB)
        if instance in (reply.report.prefill_instance, reply.report.decode_instance):
            return True
        time.sleep(0.1)
    return False


def test_prefill_worker_killed_mid_transfer(cluster):
    cluster, stub = cluster
    prompts = [prompt(300, k) for k in range(4)]
    samplings = [GREEDY, SAMPLED, GREEDY, SAMPLED]
    restarts = cluster.restarts
    before = egress_bytes(cluster, "prfaas-0")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(generate, stub, p, 6, **knobs(s))
            for p, s in zip(prompts, samplings, strict=True)
        ]
        deadline = time.monotonic() + 60
        while egress_bytes(cluster, "prfaas-0") == before:
            assert time.monotonic() < deadline, "no state went on the link"
            time.sleep(0.02)
        kill(cluster, "prfaas-0")  # a state is on the link now (4 × 57.6 KB at 100 KB/s)
        replies = [f.result(timeout=120) for f in futures]
    for p, s, reply in zip(prompts, samplings, replies, strict=True):
        assert reply.tokens == fake_tokens(p, 6, VOCAB, s)
        assert reply.report.resumed_from == 0  # nothing had reached the client yet
    retried = [r for r in replies if r.report.attempts > 1]
    assert retried, "no request was on the killed worker"
    # While PrfaaS is down the retries prefill locally.
    assert all(r.report.prefill_instance == "pd-0" for r in retried)
    wait_replaced(cluster, restarts + 1)
    assert routed_to(stub, 100, "prfaas-0")


def test_decode_worker_killed_mid_stream(cluster):
    cluster, stub = cluster
    n = 120
    restarts = cluster.restarts
    prompts = [prompt(20 + 10 * k, 50 + k) for k in range(4)]
    # Half of them sampled: resumed, they continue their key schedule. Every token's
    # log-probability is asked: a resumed one's first comes from its new prefill.
    samplings = [GREEDY, SAMPLED, GREEDY, SAMPLED]
    streams = [
        stub.Generate(
            pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=n, logprobs=2, **knobs(s)),
            timeout=120,
        )
        for p, s in zip(prompts, samplings, strict=True)
    ]
    received: list[list[int]] = [[] for _ in prompts]
    scored: list[list[pb.TokenLogprob]] = [[] for _ in prompts]
    reports: list[pb.RequestReport | None] = [None] * len(prompts)

    def read(i: int) -> None:
        for message in streams[i]:
            received[i].extend(message.token_ids)
            scored[i].extend(message.logprobs)
            if message.finished:
                reports[i] = message.report

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while min(len(r) for r in received) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert min(len(r) for r in received) >= 5, "the streams did not start"
    kill(cluster, "pd-1")
    for thread in threads:
        thread.join(timeout=120)
    for p, s, tokens, report, got in zip(
        prompts, samplings, received, reports, scored, strict=True
    ):
        assert report is not None
        assert tokens == fake_tokens(p, n, VOCAB, s)
        want = FakePrefillEngine(CFG).score(p + tokens, top=2)[len(p) - 1 :]
        assert [(g.token_id, list(g.top_ids)) for g in got] == [
            (w.token, [t for t, _ in w.top]) for w in want
        ]
        assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-5)
        assert report.attempts >= 2 and report.resumed_from >= 5
    stats = stub.GetStats(pb.GetStatsRequest())
    assert stats.resumed >= len(prompts) and stats.retries >= len(prompts)
    wait_replaced(cluster, restarts + 1)
    assert routed_to(stub, 10, "pd-1")


def test_client_cancel_frees_the_request(cluster):
    cluster, stub = cluster
    call = stub.Generate(
        pb.GenerateRequest(request_id="gone", prompt_token_ids=prompt(30, 3), max_new_tokens=200),
        timeout=60,
    )
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = stub.GetStats(pb.GetStatsRequest())
        decode = {w.name: w for w in stats.workers}["pd-1"]
        if stats.requests_in_flight == 0 and decode.active_slots == 0:
            break
        time.sleep(0.1)
    assert stats.requests_in_flight == 0 and decode.active_slots == 0


def test_hung_prefill_worker_is_bypassed(cluster):
    """A stopped (SIGSTOP) PrfaaS worker keeps its connections open: no error ever comes. The
    router's stall watchdog cancels the silent attempt and the retry prefills locally."""
    cluster, stub = cluster
    pid = cluster.worker_pid("prfaas-0")
    assert pid is not None
    long_prompt = prompt(300, 77)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        reply = generate(stub, long_prompt, 4)
        waited = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert reply.tokens == fake_tokens(long_prompt, 4, VOCAB)
    assert reply.report.attempts == 2 and reply.report.prefill_instance == "pd-0"
    # The attempt ends on the stall watchdog, not sooner; the upper bound only catches a hang.
    stall_s = OVERRIDES["router"]["stall_timeout_s"]
    assert stall_s <= waited < stall_s + 30.0
    assert routed_to(stub, 100, "prfaas-0")  # back in routing once it answers again
