"""A prefill-heavy phase moves a decode node to prefill, a decode-heavy phase moves one back;
every request finishes exactly once with the right tokens (fake engines, real processes)."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
from serving_support import fake_config, generate

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

# Emulated hardware, and the throughput model's view of it: PD prefill 4 ms/token, decode
# 20 ms/step with 4 slots per node. Prompts stay ≤ t = 64, so all prefill is local.
OVERRIDES = {
    "engine": {"max_slots": 4},
    "fake": {"prefill_s_per_token": 0.004, "decode_step_s": 0.02},
    "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 2},
    "controller": {"enabled": False, "window": 16},
    "rebalancer": {
        "enabled": True,
        "period_s": 0.5,
        "consecutive": 2,
        "cooldown_s": 2.0,
        "min_samples": 8,
        "drain_timeout_s": 30.0,
    },
    "profile": {"prfaas_prefill_s": [0.0, 0.0016], "pd_prefill_s": [0.0, 0.004]},
}
VOCAB = load_model_config("tiny").vocab_size  # fake_config's preset


def roles(stub: pb_grpc.RouterStub) -> dict[str, str]:
    stats = stub.GetStats(pb.GetStatsRequest())
    return {w.name: pb.Role.Name(w.role) for w in stats.workers}


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_rebalancer_moves_a_node_to_prefill_and_back(tmp_path):
    config = fake_config(tmp_path / "cluster.toml", **OVERRIDES)
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as cluster:
        ready = cluster.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            sent: dict[str, list[int]] = {}
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                futures = {}

                def send(request_id: str, prompt: list[int], n: int, gap_s: float) -> None:
                    sent[request_id] = fake_tokens(prompt, n, VOCAB)
                    futures[request_id] = pool.submit(
                        generate, stub, prompt, n, request_id=request_id
                    )
                    time.sleep(gap_s)

                # Prefill-heavy: 48-token prompts, 2 new tokens, 10 per second; one PD prefill
                # node serves ~5 per second, decode idles.
                for i in range(30):
                    send(f"p{i}", [(i + j) % VOCAB for j in range(48)], 2, 0.1)
                assert wait_for(lambda: stub.GetStats(pb.GetStatsRequest()).role_changes >= 1, 30)
                after_first = roles(stub)
                assert sorted(after_first.values()).count("ROLE_PD_PREFILL") == 2
                # Decode-heavy: 16-token prompts, 60 new tokens, 8 per second; one decode node
                # (4 slots, 1.2 s per request) finishes ~3.4 per second.
                for i in range(30):
                    send(f"d{i}", [(3 * i + j) % VOCAB for j in range(16)], 60, 0.125)
                assert wait_for(lambda: stub.GetStats(pb.GetStatsRequest()).role_changes >= 2, 60)
                replies = {rid: future.result(timeout=120) for rid, future in futures.items()}
            final = roles(stub)
            stats = stub.GetStats(pb.GetStatsRequest())
    # Every request finished once, with its own tokens.
    assert sorted(replies) == sorted(sent) and len(replies) == 60
    for rid, reply in replies.items():
        assert reply.tokens == sent[rid], rid
    assert stats.requests_pd == 60 and stats.requests_failed == 0
    # At least the two moves; scheduler noise may add a flip and its undo, never a lost request.
    assert stats.role_changes >= 2
    # Back to one prefill and two decode nodes.
    assert sorted(final.values()) == sorted(
        ["ROLE_PRFAAS_PREFILL", "ROLE_PD_PREFILL", "ROLE_PD_DECODE", "ROLE_PD_DECODE"]
    )
    assert after_first != final
