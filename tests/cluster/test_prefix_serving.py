"""The prefix cache in a fake-engine cluster of real processes: lookups, cache-affine routing,
the two bandwidth cases, cross-cluster prefix transfer, stats and metrics.

The fake engines read a prefix's tokens back *from the state the cache serves* and check every
bit of it against the state those tokens make (decode does the same with the state it
receives), so a wrong prefix state — from the local cache or fetched across clusters — fails
its attempt; every turn here must succeed at its first.

The conversation: turn 1 is 100 tokens (> t = 64: PrfaaS, cold); turn 2 = turn 1 + its reply
(4 tokens) + 12 new = 116 tokens, 100 of them cached on prfaas-0. Each rule is fixed by
`[router] cache_rule`; the default, "auto", picks the abundant rule here (the link is fast).
  scarce:    l_total − l_pd = 116 − 0 > 64 → PrfaaS, reusing its own 100 (computes 16);
  abundant:  l_total − max(100, 0) = 16 ≤ 64 → PD, the 100-token prefix moves from prfaas-0
             to pd-0 over the link; turn 3 then hits pd-0's own copy.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import grpc
import pytest
from serving_support import fake_config, generate, parse_metrics, sample, scrape_metrics

from prfaas_jax.cli import main as prfaas
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")
REPLY = 4


@contextlib.contextmanager
def cluster(tmp_path, link=None, **router) -> Iterator[tuple[pb_grpc.RouterStub, dict]]:
    config = fake_config(
        tmp_path / "cluster.toml",
        prefix_cache={"enabled": True, "capacity_mib": 4.0, "block_size": 8},
        router=router,
        link=link or {},
    )
    with (
        ClusterProcesses(config, log_dir=tmp_path / "logs") as processes,
        grpc.insecure_channel(processes.start()["router"]) as channel,
    ):
        yield pb_grpc.RouterStub(channel), processes.ready


def worker_stats(ready: dict, name: str) -> pb.WorkerStats:
    address = ready["workers"][name]["address"]
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def turn(router, prompt: list[int]) -> tuple[pb.RequestReport, list[int]]:
    reply = generate(router, prompt, REPLY)
    assert reply.tokens == fake_tokens(prompt, REPLY, CFG.vocab_size)
    assert reply.report.attempts == 1  # no attempt failed (the router would have retried it)
    return reply.report, reply.tokens


def conversation(router) -> tuple[list[int], list[int]]:
    """Turn 1 (100 tokens, served cold by PrfaaS) and the 116-token prompt of turn 2."""
    first = [(7 * i + 3) % CFG.vocab_size for i in range(100)]
    report, tokens = turn(router, first)
    assert (report.route, report.cached_len, report.prefill_instance) == ("prfaas", 0, "prfaas-0")
    return first, first + tokens + [(5 * i) % CFG.vocab_size for i in range(12)]


def test_bandwidth_scarce_reuses_the_prefix_where_it_is(tmp_path):
    with cluster(tmp_path, cache_rule="scarce") as (router, ready):
        _, second = conversation(router)
        report, _ = turn(router, second)
        assert (report.route, report.prefill_instance) == ("prfaas", "prfaas-0")
        assert (report.cached_len, report.uncached_len) == (100, 16)
        prfaas = worker_stats(ready, "prfaas-0").prefix_cache
        assert prfaas.enabled and (prfaas.lookups, prfaas.hits) == (2, 1)
        assert (prfaas.prompt_tokens, prfaas.reused_tokens, prfaas.computed_tokens) == (
            216,
            100,
            116,
        )
        assert 0 < prfaas.used_bytes <= prfaas.capacity_bytes == 4 * 2**20
        assert prfaas.exports == 0 and prfaas.block_size == 8
        # A prompt the cache has never seen is routed and computed in full.
        cold, _ = turn(router, [9] * 30)
        assert (cold.route, cold.cached_len) == ("pd", 0)


def test_bandwidth_abundant_moves_the_prefix_across_clusters(tmp_path):
    with cluster(tmp_path, cache_rule="abundant") as (router, ready):
        _, second = conversation(router)
        egress_before = worker_stats(ready, "prfaas-0").egress_bytes
        report, _ = turn(router, second)
        assert (report.route, report.prefill_instance) == ("pd", "pd-0")
        assert (report.cached_len, report.uncached_len) == (100, 16)
        prfaas = worker_stats(ready, "prfaas-0")
        pd = worker_stats(ready, "pd-0").prefix_cache
        assert (prfaas.prefix_cache.exports, pd.imports, pd.import_failures) == (1, 1, 0)
        assert prfaas.prefix_cache.export_bytes == pd.import_bytes == state_nbytes(CFG, 100)
        # The prefix crossed the shaped link (turn 2's own state went PD-internal, unshaped).
        assert (
            state_nbytes(CFG, 100)
            < prfaas.egress_bytes - egress_before
            < 1.1 * state_nbytes(CFG, 100)
        )
        assert (pd.reused_tokens, pd.computed_tokens) == (100, 16)
        stats = router.GetStats(pb.GetStatsRequest())
        assert (stats.prefix_moves, stats.prompt_tokens, stats.cached_tokens) == (1, 216, 100)

        # Turn 3 hits pd-0's own copy of turn 2: no move.
        third = [*second, 1, 2, 3]
        report, _ = turn(router, third)
        assert (report.route, report.prefill_instance, report.cached_len) == ("pd", "pd-0", 116)
        assert router.GetStats(pb.GetStatsRequest()).prefix_moves == 1
        samples = parse_metrics(scrape_metrics(ready["metrics"])[1])[1]
        assert sample(samples, "prfaas_cached_tokens_total") == 216
        assert sample(samples, "prfaas_prefix_moves_total") == 1
        # The router's cache index follows all three workers (the decode one's cache too) and
        # gave or asked both prefill instances' lengths for each of the three turns.
        index = router.GetStats(pb.GetStatsRequest()).cache_index
        assert index.enabled and (index.instances, index.current) == (3, 3)
        assert index.answered + index.asked == 2 * 3 and index.overestimates == 0
        assert index.snapshots >= 3 and index.events > 0 and index.block_entries > 0
        assert sample(samples, "prfaas_cache_index_lookups_total", source="index") == index.answered
        # One timed lookup per turn; the router's CPU time is its own process's.
        stats = router.GetStats(pb.GetStatsRequest())
        assert stats.lookups == 3 and 0 < stats.lookup_s < 3.0 and stats.router_cpu_s > 0
        assert sample(samples, "prfaas_router_lookup_seconds_count") == 3


def test_the_auto_rule_moves_the_prefix_when_the_link_beats_recomputing_it(tmp_path):
    """The default rule: the 100-token prefix's 25.6 KB cross an 8 MB/s link in 3.2 ms (6.4 ms
    should the learned capacity read half of it), less than the 25 ms PD would prefill them
    (tests/serving/test_cache_rule.py), so turn 2 goes local with the prefix moved, as under
    the abundant rule."""
    with cluster(tmp_path, link={"bandwidth_mbps": 64.0, "latency_ms": 0.0}) as (router, ready):
        _, second = conversation(router)
        report, _ = turn(router, second)
        assert (report.route, report.cached_len, report.uncached_len) == ("pd", 100, 16)
        stats = router.GetStats(pb.GetStatsRequest())
        assert stats.prefix_moves == 1 and dict(stats.cache_rules) == {"abundant": 1, "scarce": 0}
        samples = parse_metrics(scrape_metrics(ready["metrics"])[1])[1]
        assert sample(samples, "prfaas_cache_rule_total", rule="abundant") == 1


def test_disabled_cache_computes_everything(tmp_path):
    config = fake_config(tmp_path / "cluster.toml", prefix_cache={"enabled": False})
    with (
        ClusterProcesses(config, log_dir=tmp_path / "logs") as processes,
        grpc.insecure_channel(processes.start()["router"]) as channel,
    ):
        router = pb_grpc.RouterStub(channel)
        _, second = conversation(router)
        report, _ = turn(router, second)
        assert (report.cached_len, report.uncached_len, report.route) == (0, 116, "prfaas")
        stats = worker_stats(processes.ready, "prfaas-0").prefix_cache
        assert not stats.enabled and (stats.prompt_tokens, stats.computed_tokens) == (216, 216)


def test_bench_with_a_shared_prefix_reports_the_routers_side(tmp_path, capsys):
    """`prfaas bench --prefix-len 64` one request at a time, the fake engines handing over
    their state every 8 tokens: the first 72-token prompt computes everything (> t: PrfaaS) and
    leaves a checkpoint at 64, so each of the other 11 reuses exactly the 64-token prefix,
    704 of 864 prompt tokens; the index answers for both prefill instances each time."""
    config = fake_config(
        tmp_path / "cluster.toml",
        prefix_cache={"enabled": True, "capacity_mib": 4.0, "block_size": 8},
        fake={"chunk_len": 8},
    )
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as processes:
        argv = ["bench", "--router", processes.start()["router"], "--num-prompts", "12"]
        argv += ["--max-concurrency", "1", "--input-dist", "fixed", "--input-len", "8"]
        argv += ["--prefix-len", "64", "--output-len", "4", "--json"]
        code = prfaas(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    router = json.loads(out)["router"]
    assert router["token_hit_rate"] == pytest.approx(704 / 864)
    assert router["cache_index"] and router["index_answered"] + router["index_asked"] == 24
    assert router["cpu_ms_per_request"] > 0 and router["lookup_mean_ms"] > 0
