"""SIGTERM with requests in flight, on fake-engine clusters of real processes: what the router
and the workers promise when they stop (serving/router/main.py, serving/worker/main.py,
`ServingServer.stop` in serving/transport/server.py).

The promise: the port closes at once, so a new call is refused (UNAVAILABLE); the calls in
flight get `STOP_GRACE_S` (2 s) to finish; whatever still runs then is cancelled (UNAVAILABLE);
the process exits 0. There is no longer drain.

- The router: a stream that needs under a second more finishes with every token and its report;
  one that needs many seconds more ends UNAVAILABLE no sooner than the grace after the signal,
  having streamed only correct tokens; new requests are refused UNAVAILABLE once the client port
  closes (every request accepted before that is served in full); the router exits 0, and the
  decode worker frees the slots of the requests it cancelled.
- A decode worker: its short stream finishes within the grace in one attempt; its long stream is
  cut at the end of the grace, and the router resumes it on the worker's replacement (started
  by the launcher, as `prfaas serve` does), so the client still gets every token once; the
  stopped worker exits 0.

Decode steps take 20 ms: 20 tokens need 0.4 s (a fifth of the grace), 400 tokens 8 s.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from serving_support import Stream, child, fake_config, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.server import STOP_GRACE_S

VOCAB = load_model_config("tiny").vocab_size
SHORT, LONG = 20, 400
WAIT_S = 120.0  # bounds a broken run only


def prompt(n: int, offset: int) -> list[int]:
    return [(offset + 11 * i) % VOCAB for i in range(n)]


def start_streams(stub: pb_grpc.RouterStub) -> tuple[Stream, Stream]:
    """A long stream, then a short one, both under way on the decode worker."""
    long = Stream(stub, prompt(24, 1), LONG, WAIT_S)
    assert wait_for(lambda: len(long.tokens) >= 5, WAIT_S), "the long stream never started"
    short = Stream(stub, prompt(24, 2), SHORT, WAIT_S)
    assert wait_for(lambda: len(short.tokens) >= 1, WAIT_S), "the short stream never started"
    return long, short


def test_sigterm_to_the_router(tmp_path):
    path = fake_config(tmp_path / "cluster.toml", fake={"decode_step_s": 0.02})
    with ClusterProcesses(path, log_dir=tmp_path / "logs") as cluster:
        ready = cluster.start()
        router = child(cluster, "router")
        decode_address = ready["workers"]["pd-1"]["address"]
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            long, short = start_streams(stub)
            router.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            # New requests: served until the client port closes, then refused.
            refusal = None
            for k in range(1000):
                tokens = prompt(8, 100 + k)
                try:
                    request = pb.GenerateRequest(prompt_token_ids=tokens, max_new_tokens=1)
                    replies = list(stub.Generate(request, timeout=WAIT_S))
                except grpc.RpcError as err:
                    refusal = err
                    break
                assert [t for r in replies for t in r.token_ids] == fake_tokens(tokens, 1, VOCAB)
            assert refusal is not None and refusal.code() is grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - signalled < 10.0, "the client port stayed open"
            short.join()
            assert short.error is None and short.report is not None
            assert short.tokens == short.expected
            long.join()
            assert long.error is not None and long.error.code() is grpc.StatusCode.UNAVAILABLE
            assert long.tokens == long.expected[: len(long.tokens)] and len(long.tokens) < LONG
            assert long.ended_at - signalled >= STOP_GRACE_S
        assert router.wait(timeout=WAIT_S) == 0
        # The decode worker (still up) freed the slot of the stream the router cancelled.
        with grpc.insecure_channel(decode_address) as channel:
            control = pb_grpc.WorkerControlStub(channel)

            def idle() -> bool:
                stats = control.GetStats(pb.GetStatsRequest(), timeout=10)
                return stats.active_slots == 0 and stats.pending_states == 0

            assert wait_for(idle, WAIT_S), "the decode worker still holds the cancelled stream"


@pytest.mark.slow  # a worker restart: about 20 s on 2 shared cores
def test_sigterm_to_a_decode_worker(tmp_path):
    path = fake_config(
        tmp_path / "cluster.toml",
        fake={"decode_step_s": 0.02},
        router={"retry_wait_s": WAIT_S},
    )
    with ClusterProcesses(path, log_dir=tmp_path / "logs", restart_workers=True) as cluster:
        ready = cluster.start()
        worker = child(cluster, "pd-1")
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            long, short = start_streams(stub)
            worker.send_signal(signal.SIGTERM)
            streamed = len(long.tokens)
            short.join()
            assert short.error is None and short.tokens == short.expected
            assert short.report.attempts == 1  # finished within the grace, where it was
            long.join()
            assert long.error is None, long.error
            assert long.tokens == long.expected  # every token once, across the restart
            assert long.report.attempts == 2 and long.report.resumed_from >= streamed
            assert worker.wait(timeout=WAIT_S) == 0
            assert cluster.restarts == 1
            assert stub.GetStats(pb.GetStatsRequest(), timeout=10).resumed == 1
        assert os.path.exists(tmp_path / "logs" / "pd-1.restart-1.log")
