"""A state striped over several TCP connections (`[link] streams = 3`; fake engines, real
processes): the decode worker gathers the stripes into the state the prefill made — the fake
engines check every value of it — increments included, and the link's capacity is still learned
from the stripes together."""

from __future__ import annotations

import grpc
from serving_support import fake_config, generate

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")
# bytes/s: the first state (106 KB) takes 0.4 s, so a stall of the loaded 2-core machine while
# it is timed (the later half: 0.2 s) moves its sample by a fraction, not a factor.
RATE = 250_000.0


def test_striped_states_decode_to_their_tokens_and_teach_the_link(tmp_path):
    config = fake_config(
        tmp_path / "cluster.toml",
        link={"bandwidth_mbps": RATE * 8 / 1e6, "latency_ms": 2.0, "streams": 3},
        engine={"max_len": 1024, "max_slots": 4},
        prefix_cache={"enabled": True, "block_size": 16},
        router={"cache_rule": "scarce"},  # every turn on PrfaaS: increments over the stripes
    )
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as processes:
        ready = processes.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            prompt, reports = [(11 * i) % 250 + 1 for i in range(600)], []
            for _ in range(3):
                reply = generate(router, prompt, 4)
                assert reply.tokens == fake_tokens(prompt, 4, CFG.vocab_size)
                reports.append(reply.report)
                prompt = prompt + reply.tokens + [3] * 40
        # The worker's own stats: the router's copy is up to a control period old.
        with grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"]) as channel:
            worker = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest())
    assert [r.route for r in reports] == ["prfaas"] * 3 and all(r.attempts == 1 for r in reports)
    assert reports[0].state_bytes == state_nbytes(CFG, 600)
    assert reports[1].decode_cached_len == 592 and reports[1].saved_bytes > 0
    assert worker.link.learned_samples >= 1
    assert 0.5 * RATE < worker.link.learned_bytes_per_s < 1.5 * RATE
