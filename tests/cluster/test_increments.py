"""Increments across the link (fake engines, real processes): a conversation routed to PrfaaS
ships, from its second turn, only what the decode worker does not hold — the new positions' KV
and the fixed-size states — and the decode worker stitches the rest from its cache.

Oracles: the bytes per position of the growing caches, computed from the config by hand (an
increment is ``state_nbytes(L)`` less K of them, K the blocks of the previous prompt); the
PrfaaS worker's egress counter (what crossed the link); and the fake engines, which check every
value of every state they decode against the state the tokens make — so a stitched row from
anything but these tokens' prefix fails the turn — and whose outputs are computable by hand.
"""

from __future__ import annotations

import grpc
import pytest
from serving_support import fake_config, generate

from prfaas_jax.config import LayerKind, load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")  # KDA, KDA, KDA, MLA
BLOCK, REPLY, NEW = 16, 8, 24
# One position of MLA cache: the latent and the rope key, in the model's dtype.
ROW_BYTES = (CFG.mla.kv_lora_rank + CFG.mla.qk_rope_head_dim) * {"float32": 4, "bfloat16": 2}[
    CFG.dtype
]


def test_a_conversation_ships_only_the_increment_from_its_second_turn(tmp_path):
    """…and a prefill refuses a base outside its prompt."""
    assert [kind for kind in CFG.layers].count(LayerKind.MLA) == 1
    config = fake_config(
        tmp_path / "cluster.toml",
        prefix_cache={"enabled": True, "capacity_mib": 8.0, "block_size": BLOCK},
        link={"bandwidth_mbps": 400.0, "latency_ms": 0.0},
        # Each turn stays on PrfaaS with its own cached prefix (the auto rule would move it
        # to PD over this fast link).
        router={"cache_rule": "scarce"},
    )
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as processes:
        ready = processes.start()
        prfaas = pb_grpc.WorkerControlStub(
            grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"])
        )
        rows = []
        with grpc.insecure_channel(ready["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            prompt = [(7 * i) % 250 + 1 for i in range(100)]
            for _ in range(4):
                before = prfaas.GetStats(pb.GetStatsRequest()).egress_bytes
                reply = generate(router, prompt, REPLY)
                egress = prfaas.GetStats(pb.GetStatsRequest()).egress_bytes - before
                assert reply.tokens == fake_tokens(prompt, REPLY, CFG.vocab_size)
                rows.append((len(prompt), reply.report, egress))
                prompt = prompt + reply.tokens + [(3 * i) % 250 + 1 for i in range(NEW)]
            stats = router.GetStats(pb.GetStatsRequest())
        # A base outside the prompt is refused: the last prompt position always travels.
        with grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"]) as channel:
            prefill = pb_grpc.PrefillWorkerStub(channel)
            for held in (-1, 100):
                request = pb.PrefillRequest(
                    request_id=f"bad-{held}",
                    prompt_token_ids=list(range(1, 101)),
                    decode_address=ready["workers"]["pd-1"]["address"],
                    decode_cached_len=held,
                )
                with pytest.raises(grpc.RpcError) as err:
                    prefill.Prefill(request, timeout=30)
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "decode_cached_len" in err.value.details()
    previous = 0
    for length, report, egress in rows:
        held = previous // BLOCK * BLOCK  # the previous prompt's full blocks
        print(
            f"L={length}: decode held {report.decode_cached_len}, shipped {report.state_bytes} "
            f"of {state_nbytes(CFG, length)} state bytes ({egress} on the link)"
        )
        assert report.route == "prfaas" and report.attempts == 1
        assert report.decode_cached_len == held
        assert report.state_bytes == state_nbytes(CFG, length) - held * ROW_BYTES
        assert report.saved_bytes == held * ROW_BYTES
        # The link carried the increment and the frames' headers, never the held rows.
        assert report.state_bytes <= egress <= report.state_bytes + 4096
        previous = length
    assert rows[-1][1].decode_cached_len > 0
    assert stats.saved_bytes == sum(report.saved_bytes for _, report, _ in rows)


def test_without_a_cache_every_state_comes_whole(tmp_path):
    config = fake_config(tmp_path / "cluster.toml", prefix_cache={"enabled": False})
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as processes:
        ready = processes.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            prompt = list(range(1, 101))
            first = generate(router, prompt, REPLY)
            second = generate(router, prompt + first.tokens + [5] * NEW, REPLY)
    for reply, length in ((first, 100), (second, 100 + REPLY + NEW)):
        assert reply.report.decode_cached_len == 0 and reply.report.saved_bytes == 0
        assert reply.report.state_bytes == state_nbytes(CFG, length)
