"""Prompts past `tiny`'s 4096 tokens through worker processes, on a cluster whose `[engine]
max_len` lifts the preset's limit.

A two-turn conversation at the paper's lengths (fake engines): a 16K-token prompt, then the
conversation so far plus 2K new tokens, both routed to PrfaaS.

The second turn reuses the first prompt from the PrfaaS worker's prefix cache (its blocks and the
linear-state checkpoint at the prompt's end) and ships only an increment: the decode worker holds
the first prompt's full KV blocks from the first state, so the link carries the positions after
them and the fixed-size states. Oracles: the fake engines' hand-computable tokens (and their
bit-for-bit check of every state they decode, so a stitched row from anything but this prefix
fails the turn), the byte formula (`state_nbytes`) less the held rows' bytes computed from the
config, and the PrfaaS worker's egress counter.

The JAX engines (slow): a 4300-token prompt through a PrfaaS worker process, prefilled in
512-token chunks whose finished rows stream to the decode worker process as they are made, then
decoded there. Oracle: `prfaas generate --max-len 4608` in this process (`generate_from_preset`:
the same seeded weights, the model's own prefill and decode), token for token; the state's
bytes are the byte formula's.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
from serving_support import fake_config, generate

from prfaas_jax.cli.generation import GenerateRequest, generate_from_preset
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")  # KDA, KDA, KDA, MLA
FIRST, FOLLOW_UP, REPLY, BLOCK = 16384, 2048, 8, 16
LIMIT = FIRST + REPLY + FOLLOW_UP + REPLY
ROW_BYTES = (CFG.mla.kv_lora_rank + CFG.mla.qk_rope_head_dim) * 4  # one MLA position, float32


def test_a_16k_conversation_reuses_its_prefix_and_ships_an_increment(tmp_path):
    assert CFG.max_len < LIMIT and CFG.dtype == "float32"
    config = fake_config(
        tmp_path / "cluster.toml",
        engine={"max_len": LIMIT},
        prefix_cache={"enabled": True, "capacity_mib": 64.0, "block_size": BLOCK},
        link={"bandwidth_mbps": 400.0, "latency_ms": 0.0},
        # Both turns stay on PrfaaS (the auto rule would move the reuse to PD over this link).
        router={"cache_rule": "scarce"},
    )
    rng = np.random.default_rng(0)
    first = rng.integers(0, CFG.vocab_size, FIRST).tolist()
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as processes:
        ready = processes.start()
        prfaas = pb_grpc.WorkerControlStub(
            grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"])
        )
        with grpc.insecure_channel(ready["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            assert router.GetStats(pb.GetStatsRequest()).max_len == LIMIT
            turns = []
            prompt = first
            for _ in range(2):
                before = prfaas.GetStats(pb.GetStatsRequest()).egress_bytes
                reply = generate(router, prompt, REPLY)
                egress = prfaas.GetStats(pb.GetStatsRequest()).egress_bytes - before
                turns.append((prompt, reply, egress))
                follow_up = rng.integers(0, CFG.vocab_size, FOLLOW_UP).tolist()
                prompt = prompt + reply.tokens + follow_up
    (_, r1, egress1), (p2, r2, egress2) = turns
    assert len(p2) == FIRST + REPLY + FOLLOW_UP
    for prompt, reply, _ in turns:
        assert reply.tokens == fake_tokens(prompt, REPLY, CFG.vocab_size)
        assert (reply.report.route, reply.report.attempts) == ("prfaas", 1)
    # Turn 1: computed whole, shipped whole.
    assert (r1.report.cached_len, r1.report.decode_cached_len) == (0, 0)
    assert r1.report.state_bytes == state_nbytes(CFG, FIRST)
    assert r1.report.state_bytes <= egress1 <= r1.report.state_bytes * 1.01
    # Turn 2: the first prompt reused from the prefix cache, its KV blocks held by the decode
    # worker; only the rest crossed the link.
    assert r2.report.cached_len == FIRST
    assert r2.report.uncached_len == REPLY + FOLLOW_UP
    held = FIRST // BLOCK * BLOCK
    assert r2.report.decode_cached_len == held
    assert r2.report.state_bytes == state_nbytes(CFG, len(p2)) - held * ROW_BYTES
    assert r2.report.saved_bytes == held * ROW_BYTES
    assert r2.report.state_bytes <= egress2 <= r2.report.state_bytes + 64 * 1024
    assert egress2 < egress1 / 5


@pytest.mark.slow
def test_the_jax_engines_prefill_ship_and_decode_past_4k_tokens(tmp_path):
    limit, length, new, chunk = 4608, 4300, 6, 512
    assert CFG.max_len < length < limit and length > 8 * chunk  # nine chunks
    config = fake_config(
        tmp_path / "cluster.toml",
        model={"engine": "jax"},
        engine={
            "max_len": limit,
            "chunk_len": chunk,
            "buckets": [32, chunk],
            "max_slots": 2,
            "prefill_batch_rows": 1,  # one prompt: no batched calls to warm up
        },
        instances={"prfaas_prefill": 1, "pd_prefill": 0, "pd_decode": 1},
        link={"bandwidth_mbps": 400.0, "latency_ms": 0.0},
    )
    ids = np.random.default_rng(4).integers(0, CFG.vocab_size, length).tolist()
    compile_cache = os.environ["JAX_COMPILATION_CACHE_DIR"]  # the session's (tests/conftest.py)
    with ClusterProcesses(config, log_dir=tmp_path / "logs", compile_cache=compile_cache) as run:
        ready = run.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            reply = generate(pb_grpc.RouterStub(channel), ids, new)
    alone = generate_from_preset(
        GenerateRequest(model="tiny", prompt_ids=ids, max_new_tokens=new, max_len=limit)
    )
    assert reply.tokens == alone.tokens
    assert (reply.report.route, reply.report.attempts) == ("prfaas", 1)
    assert reply.report.state_bytes == state_nbytes(CFG, length)
