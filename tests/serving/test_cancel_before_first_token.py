"""A client that cancels its `Generate` before the first token: nothing of the request is left.

In process (serving_support.serve_in_process): the router and its workers — PrfaaS prefill
(prfaas-0, behind a `LinkShaper` that records every byte put on the link), PD prefill (pd-0), PD
decode (pd-1) — each on a loopback server, over the fake engines. A prefill engine held at a
gate keeps the request before its first token for as long as the test needs; every step waits
for an observed condition (the engine entered, the decode worker's waiting call, a frame on the
link), never for a pause.

Proven, for a cancel while the prompt is in the engine, while it waits in the prefill queue
behind another, and while its state is on the link:

- the client's call ends CANCELLED; the router releases the request (none in flight, its
  per-instance counts of outstanding prefills and assigned decodes back to zero, counted once as
  cancelled), so the same request id is served again at once, with the right tokens;
- the decode worker drops the request's waiting call (`pending_states` back to 0, nothing held)
  and never keeps its state;
- the prefill worker stops: a request cancelled in the queue never reaches the engine, one
  cancelled in the engine puts no frame on the link after the cancel, one cancelled mid-transfer
  sends at most the frame already on its way; the worker ends with nothing queued or
  transferring.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import grpc
import pytest
from serving_support import InProcessCluster, fake_config, generate, serve_in_process, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, FakePrefillResult
from prfaas_jax.engine.fake import fake_tokens as expected
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transport.link import LinkProfile, LinkShaper

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
FRAME_BYTES = 4096
WAIT_S = 20.0  # every wait is for an event; this only bounds a broken run


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 37 * i) % VOCAB for i in range(n)]


class GatedPrefill(FakePrefillEngine):
    """The fake prefill engine, holding each prefill at `gate`; `started` lists the prompts it
    began, `entered` is set as one begins."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.started: list[list[int]] = []

    def prefill(self, tokens: Sequence[int], **options: object) -> FakePrefillResult:
        self.started.append(list(tokens))
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().prefill(tokens, **options)


class RecordingShaper(LinkShaper):
    """A link that also counts the bytes put on it (`admit`: a frame takes its place there)."""

    def __init__(self, profile: LinkProfile) -> None:
        super().__init__(profile)
        self._admitted_lock = threading.Lock()
        self.admitted = 0

    def admit(self, nbytes: int) -> float:
        with self._admitted_lock:
            self.admitted += nbytes
        return super().admit(nbytes)


def start_cluster(
    tmp_path, prfaas_engine, pd_engine, shaper
) -> contextlib.AbstractContextManager[InProcessCluster]:
    config = load_cluster_config(
        fake_config(tmp_path / "cluster.toml", engine={"frame_bytes": FRAME_BYTES})
    )
    instances = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prfaas_engine),
        "pd-0": (Role.PD_PREFILL, pd_engine),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=512)),
    }
    return serve_in_process(config, instances, shapers={"prfaas-0": shaper})


def start(cluster: InProcessCluster, request_id: str, tokens: list[int], n: int) -> grpc.Call:
    """A `Generate` call, under way; iterate it for its messages."""
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=tokens, max_new_tokens=n)
    return cluster.router.Generate(request, timeout=60)


def assert_cancelled(call) -> None:
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() is grpc.StatusCode.CANCELLED


def decode_idle(cluster: InProcessCluster) -> bool:
    decode = cluster.decode["pd-1"]
    stats = decode.stats()
    return not decode.busy and stats["pending_states"] == 0 and stats["active_slots"] == 0


def router_released(cluster: InProcessCluster) -> bool:
    """No request in flight, and no outstanding prefill or assigned decode on any instance."""
    core = cluster.core
    with core.lock:
        counts = {
            (w.outstanding_prefills, w.outstanding_tokens, w.assigned_decodes)
            for w in core.workers.values()
        }
        return not core.in_flight and counts == {(0, 0, 0)}


def assert_released(cluster: InProcessCluster) -> None:
    assert wait_for(lambda: router_released(cluster), WAIT_S), "the router still holds the request"
    assert wait_for(lambda: decode_idle(cluster), WAIT_S), cluster.decode["pd-1"].stats()
    assert cluster.stats().requests_in_flight == 0


def test_cancel_while_the_prompt_is_in_the_engine(tmp_path):
    engine = GatedPrefill()
    shaper = RecordingShaper(LinkProfile(bandwidth_bytes_per_s=1e9, burst_bytes=1e9))
    long = prompt(100)  # > t = 64: PrfaaS, through the shaper
    with start_cluster(tmp_path, engine, FakePrefillEngine(CFG), shaper) as cluster:
        call = start(cluster, "gone", long, 8)
        assert engine.entered.wait(WAIT_S), "the prefill never began"
        decode = cluster.decode["pd-1"]
        assert wait_for(lambda: decode.stats()["pending_states"] == 1, WAIT_S)
        on_link = shaper.admitted  # the state header, put on the link as the prefill began
        call.cancel()
        assert_cancelled(call)
        # Both sides let go while the engine is still busy with the prompt.
        assert_released(cluster)
        engine.gate.set()
        prefill = cluster.prefill["prfaas-0"]
        assert wait_for(lambda: not prefill.busy, WAIT_S), "the prefill worker still holds it"
        assert shaper.admitted == on_link, "frames went on the link after the cancel"
        assert prefill.completed == 0
        assert decode.stats()["state_bytes_received"] == 0 and decode_idle(cluster)
        assert cluster.core.finished == {("prfaas", "cancelled"): 1}
        # The id is free again, and served in full.
        reply = generate(cluster.router, long, 8, request_id="gone")
        assert reply.tokens == expected(long, 8, VOCAB) and reply.report.attempts == 1


def test_cancel_while_waiting_for_the_engine(tmp_path):
    engine = GatedPrefill()
    shaper = RecordingShaper(LinkProfile(bandwidth_bytes_per_s=1e9, burst_bytes=1e9))
    first, second = prompt(20, 1), prompt(30, 2)  # ≤ t: both on pd-0, one engine
    with start_cluster(tmp_path, FakePrefillEngine(CFG), engine, shaper) as cluster:
        prefill, decode = cluster.prefill["pd-0"], cluster.decode["pd-1"]
        held = start(cluster, "first", first, 5)
        assert engine.entered.wait(WAIT_S)
        queued = start(cluster, "second", second, 5)
        assert wait_for(lambda: prefill.queued == 2, WAIT_S), "the second never queued"
        assert wait_for(lambda: decode.stats()["pending_states"] == 2, WAIT_S)
        queued.cancel()
        assert_cancelled(queued)
        assert wait_for(lambda: cluster.core.in_flight == {"first"}, WAIT_S)
        assert wait_for(lambda: decode.stats()["pending_states"] == 1, WAIT_S)
        engine.gate.set()
        tokens = [t for message in held for t in message.token_ids]
        assert tokens == expected(first, 5, VOCAB)
        assert wait_for(lambda: not prefill.busy, WAIT_S), "the prefill worker still holds it"
        assert engine.started == [first], "the cancelled prompt still took the engine"
        assert prefill.completed == 1
        assert_released(cluster)
        assert cluster.core.finished == {("pd", "ok"): 1, ("pd", "cancelled"): 1}
        reply = generate(cluster.router, second, 5, request_id="second")
        assert reply.tokens == expected(second, 5, VOCAB) and reply.report.attempts == 1


def test_cancel_while_the_state_is_on_the_link(tmp_path):
    # One 4 KiB frame at a time at 10 kB/s: the 300-token state (57.6 KB) needs about 6 s.
    shaper = RecordingShaper(
        LinkProfile(bandwidth_bytes_per_s=10_000, burst_bytes=FRAME_BYTES, latency_s=0.0)
    )
    long = prompt(300, 3)
    state = FakePrefillEngine(CFG).prefill(long, max_len=512).state
    frames = len(list(codec.encode(state, CFG, max_frame_bytes=FRAME_BYTES))) + 1  # + handoff
    with start_cluster(tmp_path, FakePrefillEngine(CFG), FakePrefillEngine(CFG), shaper) as cluster:
        call = start(cluster, "mid-transfer", long, 8)
        assert wait_for(lambda: shaper.sent_frames >= 2, WAIT_S), "no frame left"
        sent = shaper.sent_frames
        call.cancel()
        assert_cancelled(call)
        assert_released(cluster)
        prefill, decode = cluster.prefill["prfaas-0"], cluster.decode["pd-1"]
        assert wait_for(lambda: not prefill.busy, WAIT_S), "the transfer goes on"
        # At most the frame already on its way when the client left.
        assert shaper.sent_frames <= sent + 1 < frames
        assert prefill.completed == 0
        assert decode.stats()["state_bytes_received"] == 0 and decode_idle(cluster)
        reply = generate(cluster.router, prompt(10), 4, request_id="mid-transfer")
        assert reply.tokens == expected(prompt(10), 4, VOCAB)
