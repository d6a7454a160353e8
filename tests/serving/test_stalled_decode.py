"""A decode worker that hangs mid-stream: the router's stall watchdog cancels the silent attempt
and resumes the request elsewhere, and the client sees each token once.

In process (serving_support.serve_in_process), fake engines: prefill workers prfaas-0 and pd-0,
decode workers pd-1 and pd-2, `stall_timeout_s = 1`. pd-1 behaves like a stopped process: after
a few decode steps its engine stops inside a step (the stream goes silent, its connection stays
open, no error ever comes) and its `WorkerControl.GetStats` stops answering, so the router's
liveness probe times out. Nothing is injected into the router: it must notice the silence itself
(serving/transport/watchdog.py).

Proven: the stream stalls with k tokens delivered; no sooner than `stall_timeout_s` later the
router cancels the attempt, takes pd-1 out of routing and resumes on pd-2 from token k; the
client's tokens equal the fake engines' uninterrupted output (`fake_tokens`: every token depends
on the whole sequence before it, so a token repeated, skipped or decoded from the wrong place
changes all that follow), with `attempts = 2`, `resumed_from = k`; once pd-1 wakes, it frees the
cancelled request's slot and holds nothing.
"""

from __future__ import annotations

import threading
import time

import grpc
from serving_support import fake_config, generate, serve_in_process, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine
from prfaas_jax.engine.fake import fake_tokens as expected
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
STALL_S = 1.0
STEPS_BEFORE_HANG = 5
WAIT_S = 30.0  # bounds a broken run only


class HangingDecode(FakeDecodeEngine):
    """The fake decode engine; its step after `STEPS_BEFORE_HANG` sets `hung` and blocks until
    `wake` is set."""

    def __init__(self) -> None:
        super().__init__(CFG, max_slots=4, max_len=512, step_s=0.01)
        self.hung, self.wake = threading.Event(), threading.Event()
        self.steps = 0

    def step(self) -> list[tuple[int, int]]:
        self.steps += 1
        if self.steps > STEPS_BEFORE_HANG and not self.wake.is_set():
            self.hung.set()
            assert self.wake.wait(WAIT_S), "the test never woke the engine"
        return super().step()


class FrozenControl(pb_grpc.WorkerControlServicer):
    """`GetStats` of a hung process: no answer while the engine hangs."""

    def __init__(self, engine: HangingDecode) -> None:
        self.engine = engine

    def GetStats(self, request, context):  # noqa: N802
        if self.engine.hung.is_set():
            self.engine.wake.wait(WAIT_S)
        return pb.WorkerStats(name="pd-1")


def test_a_hung_decode_worker_is_bypassed_and_the_stream_resumes(tmp_path):
    path = fake_config(
        tmp_path / "cluster.toml",
        instances={"pd_decode": 2},
        router={"stall_timeout_s": STALL_S},
    )
    config = load_cluster_config(path)
    hanging = HangingDecode()
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(CFG)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(CFG)),
        "pd-1": (Role.PD_DECODE, hanging),  # first: it takes the first request
        "pd-2": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=512, step_s=0.01)),
    }
    prompt, n = [(3 + 17 * i) % VOCAB for i in range(30)], 40
    with serve_in_process(config, engines, controls={"pd-1": FrozenControl(hanging)}) as cluster:
        call = cluster.router.Generate(
            pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n), timeout=WAIT_S
        )
        arrivals: list[tuple[float, list[int]]] = []
        reports: list[pb.RequestReport] = []
        errors: list[grpc.RpcError] = []

        def read() -> None:
            try:
                for message in call:
                    arrivals.append((time.monotonic(), list(message.token_ids)))
                    if message.finished:
                        reports.append(message.report)
            except grpc.RpcError as err:
                errors.append(err)

        reader = threading.Thread(target=read)
        reader.start()
        assert hanging.hung.wait(WAIT_S), "the decode engine never reached its hang"
        assert cluster.decode["pd-1"].stats()["active_slots"] == 1  # the request was there
        try:
            reader.join(WAIT_S)
            assert not reader.is_alive() and not errors, errors
        finally:
            hanging.wake.set()
        tokens = [t for _, batch in arrivals for t in batch]
        assert tokens == expected(prompt, n, VOCAB)
        (report,) = reports
        k = STEPS_BEFORE_HANG + 1  # the first token comes from prefill
        assert (report.attempts, report.resumed_from) == (2, k)
        assert report.decode_instance == "pd-2"
        # The silence lasted at least the stall limit: the token after the k-th came no sooner.
        times = [at for at, batch in arrivals for _ in batch]
        gap = times[k] - times[k - 1]
        assert STALL_S <= gap < STALL_S + 15.0, gap
        assert cluster.core.workers["pd-1"].down
        assert (cluster.core.retries, cluster.core.resumed) == (1, 1)
        # Awake again, pd-1 drops the cancelled request and frees its slot.
        pd_1 = cluster.decode["pd-1"]
        assert wait_for(lambda: not pd_1.busy and not hanging.active_slots, WAIT_S)
        assert hanging.free_slots == list(range(4))
        assert pd_1.stats()["completed"] == 0
        # The same request, uninterrupted (pd-1 is out of routing): the same tokens.
        assert generate(cluster.router, prompt, n).tokens == tokens
