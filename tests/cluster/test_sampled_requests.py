"""Seeded sampling through a fake-engine cluster of real processes, on every path a state takes:
both routes, prefix hits, increments across the link, states striped over three connections
and emitted layer group by layer group.

The fake engines sample as a deterministic function of the request's key (engine/fake.py:
`fake_draw` moves each greedy token by a hash of the seed and the token's index), so the oracle
is `fake_tokens` with the request's settings; a worker that drops the seed, a knob or the
resumed index makes other tokens. Every sampled reply is also held against the greedy tokens
and another seed's, so a cluster that ignores sampling fails here.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from serving_support import fake_config, generate

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

VOCAB = load_model_config("tiny").vocab_size
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=2**40 + 7)
KNOBS = {"temperature": SAMPLED.temperature, "top_p": SAMPLED.top_p}


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled")
    config = fake_config(
        root / "cluster.toml",
        engine={"layer_groups": 4},
        prefix_cache={"enabled": True, "capacity_mib": 8.0, "block_size": 16},
        link={"bandwidth_mbps": 400.0, "latency_ms": 0.0, "streams": 3},
        router={"cache_rule": "scarce"},  # a conversation's turns stay on PrfaaS: increments
    )
    with ClusterProcesses(config, log_dir=root / "logs") as processes:
        ready = processes.start()
        with grpc.insecure_channel(ready["router"]) as channel:
            yield pb_grpc.RouterStub(channel)


def expected(prompt: list[int], n: int, sampling: SamplingParams = SAMPLED) -> list[int]:
    return fake_tokens(prompt, n, VOCAB, sampling)


def test_seeded_tokens_on_both_routes_and_across_turns(router):
    """Two conversations, one on each route: from the second turn each prompt hits the prefix
    cache, and the PrfaaS one ships increments; every turn is the seed's tokens."""
    other = dataclasses.replace(SAMPLED, seed=SAMPLED.seed + 1)
    for length, route in ((20, "pd"), (100, "prfaas")):
        prompt = [(5 * i + length) % 250 + 1 for i in range(length)]
        reports = []
        for turn in range(3):
            reply = generate(router, prompt, 8, seed=SAMPLED.seed, **KNOBS)
            assert reply.tokens == expected(prompt, 8), (route, turn)
            assert reply.tokens != expected(prompt, 8, other)
            assert reply.tokens != fake_tokens(prompt, 8, VOCAB)
            reports.append(reply.report)
            prompt = prompt + reply.tokens + [(3 * i) % 250 + 1 for i in range(24 + turn)]
        assert [r.route for r in reports] == [route] * 3
        assert all(r.seed == SAMPLED.seed for r in reports)
        assert all(r.cached_len > 0 for r in reports[1:])
        if route == "prfaas":
            assert all(r.decode_cached_len > 0 for r in reports[1:])


def test_top_k_one_is_greedy_through_the_cluster(router):
    prompt = [(9 * i) % 250 + 1 for i in range(90)]
    reply = generate(router, prompt, 6, seed=3, top_k=1, **KNOBS)
    assert reply.tokens == fake_tokens(prompt, 6, VOCAB)


def test_a_request_without_a_seed_gets_a_fresh_one_that_replays_it(router):
    prompt = [(11 * i) % 250 + 1 for i in range(30)]
    first, second = (generate(router, prompt, 10, **KNOBS) for _ in range(2))
    assert first.report.seed != second.report.seed
    for reply in (first, second):
        replay = dataclasses.replace(SAMPLED, seed=reply.report.seed)
        assert reply.tokens == expected(prompt, 10, replay)
        again = generate(router, prompt, 10, seed=reply.report.seed, **KNOBS)
        assert again.tokens == reply.tokens
    # Seed 0 is a seed like any other, not "none".
    zero = dataclasses.replace(SAMPLED, seed=0)
    assert generate(router, prompt, 10, seed=0, **KNOBS).tokens == expected(prompt, 10, zero)
