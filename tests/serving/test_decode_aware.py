"""Decode-aware routing in process (`[router] decode_aware`): fake engines that check every
state byte, a real prefix pool per node, the decode node's included (prfaas-0, pd-0 prefill,
pd-1 decode; t = 64, the scarce rule).

A 100-token prompt goes to PrfaaS (100 > 64) and its state to pd-1, which keeps it, checkpoint
included, in its node's pool and publishes the events. The next turn extends it to 124 tokens:
no prefill instance of the PD cluster holds any of it (124 > 64 against their caches alone), but
pd-1 holds 100, so its effective uncached length is 24 ≤ 64 — prefilled on pd-0 from pd-1's
prefix, fetched inside the cluster (the report's tier: decode), and counted as kept off the
link. Without the option the same turn crosses the link, reusing prfaas-0's own copy (host).
Outputs are the fake engine's exact answer either way.
"""

from __future__ import annotations

from serving_support import fake_config, fake_instances, generate, serve_in_process, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb

CFG = load_model_config("tiny")
REPLY = 4


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 17 * i + i * i) % CFG.vocab_size for i in range(n)]


def second_turn(tmp_path, decode_aware: bool):
    path = fake_config(
        tmp_path / f"cluster-{decode_aware}.toml",
        prefix_cache={"enabled": True, "capacity_mib": 16.0, "block_size": 8},
        router={"cache_rule": "scarce", "decode_aware": decode_aware},
    )
    config = load_cluster_config(path)
    with serve_in_process(config, fake_instances(CFG), prefix_caches=True) as running:
        first = tokens(100, 1)
        reply = generate(running.router, first, REPLY)
        assert reply.report.route == "prfaas"
        second = first + reply.tokens + tokens(20, 2)
        feed = running.core.cache_feed
        if decode_aware:
            # The decode worker's events reach the index (no race in this test).
            assert wait_for(lambda: feed.index.cached_lengths(second).get("pd-1") == 100)
        reply = generate(running.router, second, REPLY)
        assert reply.tokens == fake_tokens(second, REPLY, CFG.vocab_size)
        assert reply.report.attempts == 1
        counted = running.core.decode_cache_local
        stats = running.router.GetStats(pb.GetStatsRequest(), timeout=10)
        assert stats.decode_cache_local == counted  # as GetStats reports it
    return reply.report, counted


def test_a_prefix_held_only_by_the_decode_worker_keeps_the_next_turn_local(tmp_path):
    report, counted = second_turn(tmp_path, decode_aware=True)
    assert (report.route, report.prefill_instance) == ("pd", "pd-0")
    assert (report.cached_len, report.uncached_len) == (100, 24)
    assert report.cache_tier == pb.CACHE_TIER_DECODE
    assert counted == 1
    report, counted = second_turn(tmp_path, decode_aware=False)
    assert (report.route, report.prefill_instance, counted) == ("prfaas", "prfaas-0", 0)
    # prfaas-0 prefilled the first turn: its own host memory holds it.
    assert (report.cached_len, report.cache_tier) == (100, pb.CACHE_TIER_HOST)
