"""The router sheds a 10× burst: admission control (`[router] max_in_flight`, `ttft_slo_s`;
policy/admission.py) end to end, on a fake-engine cluster of real processes. The workers' own
bounded queues are tested in process: tests/serving/test_overload.py."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
from serving_support import fake_config, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * i) % CFG.vocab_size for i in range(length)]


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
    overheads), or was refused for one of the two reasons without waiting in a queue: before
    the quickest accepted call of the same burst had finished (a bound relative to the burst,
    so a loaded machine stretches both sides). Returns the refusals' details."""
    refusals, refusal_s = [], []
    accepted_s = [outcome[3] for outcome in outcomes if outcome[0] == "ok"]
    for outcome, (prompt, n) in zip(outcomes, requests, strict=True):
        if outcome[0] == "ok":
            assert outcome[1] == fake_tokens(prompt, n, CFG.vocab_size)
            assert outcome[2] is not None and outcome[2].ttft_s <= 2 * TTFT_SLO_S
        else:
            code, details, seconds = outcome
            assert code == EXHAUSTED, (code, details)
            assert "in flight" in details or "SLO" in details, details
            refusals.append(details)
            refusal_s.append(seconds)
    if refusal_s and accepted_s:
        assert max(refusal_s) < min(accepted_s), (
            f"a refusal took {max(refusal_s):.2f} s; an accepted call finished in "
            f"{min(accepted_s):.2f} s"
        )
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
