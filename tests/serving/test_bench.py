"""`prfaas bench`: arrivals, length distributions and metrics on literal numbers (a run through
the CLI against a cluster of real processes is in tests/cluster/test_fake_cluster.py)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from prfaas_jax.errors import UserError
from prfaas_jax.serving.loadgen.bench import (
    BenchOptions,
    BenchResult,
    LinkDevice,
    _router_costs,
    arrival_times,
    input_lengths,
    make_prompts,
)
from prfaas_jax.serving.loadgen.bench_report import format_summary, summarize
from prfaas_jax.serving.proto import prfaas_pb2 as pb


def test_arrivals_span_n_over_rate_and_burstiness_shapes_the_gaps():
    rng = np.random.default_rng(0)
    times = arrival_times(1000, 4.0, 1.0, rng)
    assert times[0] == 0 and times[-1] == pytest.approx(999 / 4.0)
    assert np.all(np.diff(times) >= 0)
    cv = {}
    for burstiness in (0.2, 1.0, 10.0):
        gaps = np.diff(arrival_times(2000, 4.0, burstiness, np.random.default_rng(1)))
        cv[burstiness] = gaps.std() / gaps.mean()
    # Gamma(k) gaps have CV = 1/√k: ≈ 2.24, 1 (Poisson), 0.32.
    assert cv[0.2] > 1.8 and 0.9 < cv[1.0] < 1.1 and cv[10.0] < 0.4
    assert np.all(arrival_times(5, math.inf, 1.0, rng) == 0)


def test_input_lengths():
    rng = np.random.default_rng(0)
    fixed = input_lengths(
        BenchOptions("x", num_prompts=5, input_dist="fixed", input_len=9), 512, rng
    )
    assert fixed.tolist() == [9] * 5
    uniform = input_lengths(
        BenchOptions("x", num_prompts=500, input_dist="uniform", input_len=100, range_ratio=0.2),
        512,
        rng,
    )
    assert uniform.min() >= 80 and uniform.max() <= 120
    # The paper's log-normal (μ 9.90, σ 1, [128, 131072]) scaled by 1/256: μ' = 9.90 − ln 256
    # = 4.355 (median ≈ 78 before truncation), on [0.5 → 1, 512].
    paper = input_lengths(
        BenchOptions("x", num_prompts=4000, input_dist="paper", length_scale=1 / 256), 512, rng
    )
    assert paper.min() >= 1 and paper.max() <= 512
    assert 70 < np.median(paper) < 90
    default_scale = input_lengths(BenchOptions("x", num_prompts=2000), 497, rng)
    assert default_scale.max() <= 497


def test_shared_prefixes_open_the_prompts():
    lengths = np.array([3, 5, 1, 4] * 50)
    plain = make_prompts(BenchOptions("x"), lengths, 1000, np.random.default_rng(7))
    assert [len(p) for p in plain] == lengths.tolist()
    opts = BenchOptions("x", prefix_len=6, num_prefixes=3)
    shared = make_prompts(opts, lengths, 1000, np.random.default_rng(7))
    # The suffixes are the plain workload's draws (same seed, drawn first), after a prefix.
    assert [p[6:] for p in shared] == plain
    heads = {tuple(p[:6]) for p in shared}
    assert len(heads) == 3 and all(len(h) == 6 for h in heads)
    # Picked uniformly: each of the 3 opens a third of 200 prompts, give or take.
    counts = [sum(tuple(p[:6]) == h for p in shared) for h in heads]
    assert sum(counts) == 200 and min(counts) > 40


def test_options_are_validated():
    with pytest.raises(UserError):
        BenchOptions("x", num_prompts=0)
    with pytest.raises(UserError):
        BenchOptions("x", goodput={"itl": 5.0})
    with pytest.raises(UserError):
        BenchOptions("x", request_rate=0.0)
    with pytest.raises(UserError):
        BenchOptions("x", prefix_len=-1)
    with pytest.raises(UserError):
        BenchOptions("x", prefix_len=8, num_prefixes=0)


def test_metrics_on_literal_records():
    records = [
        BenchResult(
            10,
            ttft=0.1,
            e2el=0.5,
            itl=[0.1] * 4,
            output_tokens=5,
            route="pd",
            exposed_transfer=0.01,
        ),
        BenchResult(
            90,
            ttft=0.3,
            e2el=1.1,
            itl=[0.2] * 4,
            output_tokens=5,
            route="prfaas",
            exposed_transfer=0.12,
        ),
        BenchResult(50, error="UNAVAILABLE: gone"),
    ]
    opts = BenchOptions("x", percentiles=(50.0, 90.0), goodput={"ttft": 200.0, "tpot": 150.0})
    context = {"duration_s": 2.0, "egress_bytes": 25_000_000, "model": "tiny"}
    context.update(threshold_start=64.0, threshold_end=80.0)
    s = summarize(records, context, opts)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["errors"] == ["UNAVAILABLE: gone"]
    assert s["ttft"]["mean_ms"] == pytest.approx(200.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(200.0)
    # TPOT = (E2EL − TTFT) / (n − 1): 100 ms and 200 ms.
    assert s["tpot"]["mean_ms"] == pytest.approx(150.0)
    assert s["itl"]["median_ms"] == pytest.approx(150.0)
    assert s["e2el"]["p90_ms"] == pytest.approx(500 + 0.9 * 600)
    # Only the first meets TTFT ≤ 200 ms and TPOT ≤ 150 ms: 1 request / 2 s.
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["offload_fraction"] == pytest.approx(0.5)
    assert s["egress_gbps"] == pytest.approx(0.1)
    assert s["exposed_transfer"]["prfaas"]["mean_ms"] == pytest.approx(120.0)
    assert s["exposed_transfer"]["pd"]["p90_ms"] == pytest.approx(10.0)
    text = format_summary(s, opts)
    assert "Serving Benchmark Result" in text and "P90 E2EL (ms)" in text
    assert "Request goodput (req/s)" in text and "64 → 80" in text
    assert "Exposed Transfer" in text and "Mean PrfaaS (ms)" in text and "P90 PD (ms)" in text
    assert s["link_kernel_bytes"] is None and "link device" not in text
    # With the link's device: the kernel's count, and how far above the router's it is.
    s = summarize(records, {**context, "link_kernel_bytes": 26_250_000}, opts)
    assert s["link_kernel_bytes"] == 26_250_000
    text = format_summary(s, opts)
    assert "Egress on the link device (bytes)" in text and "26250000" in text
    assert "+5.0%" in text
    assert "router" not in s and "Router CPU" not in text
    assert s["wire_narrowed"] == {} and "Sent narrowed" not in text
    # One of the two completed requests crossed narrowed ([wire]), by the router's counters.
    s = summarize(records, {**context, "wire_narrowed": {"int8": 1}}, opts)
    assert s["narrowed_fraction"] == pytest.approx(0.5)
    line = "Sent narrowed ([wire])".ljust(40) + "50.0% (int8 1)".rjust(16)
    assert line in format_summary(s, opts).splitlines()


def test_router_costs_from_the_routers_counters():
    """The bench's router rows are differences of the router's counters over the run."""
    before = pb.RouterStats(prompt_tokens=1_000, cached_tokens=100, lookups=5, lookup_s=0.01)
    before.router_cpu_s = 2.0
    before.cache_index.CopyFrom(pb.CacheIndexStats(enabled=True, answered=8, asked=2))
    after = pb.RouterStats(prompt_tokens=5_000, cached_tokens=3_100, lookups=45, lookup_s=0.03)
    after.router_cpu_s = 2.5
    after.cache_index.CopyFrom(
        pb.CacheIndexStats(
            enabled=True, answered=88, asked=2, block_entries=300, checkpoint_entries=20
        )
    )
    costs = _router_costs(before, after)
    assert costs["cpu_s"] == pytest.approx(0.5) and costs["lookups"] == 40
    assert (costs["index_answered"], costs["index_asked"], costs["index_entries"]) == (80, 0, 320)
    assert costs["hit_rate"] == pytest.approx(3_000 / 4_000)
    records = [BenchResult(10, ttft=0.1, e2el=0.2, itl=[0.1], output_tokens=2, route="pd")] * 40
    context = {"duration_s": 4.0, "egress_bytes": 0, "model": "tiny", "router": costs}
    context.update(threshold_start=64.0, threshold_end=64.0)
    opts = BenchOptions("x")
    s = summarize(records, context, opts)
    # 0.5 CPU-s over 40 requests; 20 ms of lookups over 40.
    assert s["router"]["cpu_ms_per_request"] == pytest.approx(12.5)
    assert s["router"]["lookup_mean_ms"] == pytest.approx(0.5)
    text = format_summary(s, opts)
    assert "Router CPU per request (ms)" in text and "12.50" in text
    assert "Cache index: answered / asked" in text and "80 / 0" in text
    assert "Prompt tokens reused from a cache" in text and "75.0%" in text


def test_link_device_names():
    assert LinkDevice.parse("link0") == LinkDevice("link0")
    assert LinkDevice.parse("prfaas-1-0-pf/link0") == LinkDevice("link0", "prfaas-1-0-pf")
    assert str(LinkDevice("link0", "ns")) == "ns/link0"
    for bad in ("", "ns/"):
        with pytest.raises(UserError, match="expected DEV or NAMESPACE/DEV"):
            LinkDevice.parse(bad)
    with pytest.raises(UserError, match="cannot read the link device's counters"):
        LinkDevice("no-such-device0").tx_bytes()


def test_ctrl_c_ends_a_run_without_waiting_for_its_requests(tmp_path):
    """Ctrl-C (KeyboardInterrupt in the sending thread) drops the requests not sent and
    cancels those in flight: the run ends in moments, not when its last request would."""
    import _thread
    import threading

    from serving_support import fake_config, serve_in_process

    from prfaas_jax.config import load_model_config
    from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine
    from prfaas_jax.policy.routing import Role
    from prfaas_jax.serving.cluster_config import load_cluster_config
    from prfaas_jax.serving.loadgen.bench import InputDist, run_bench

    config = load_cluster_config(fake_config(tmp_path / "cluster.toml"))
    cfg = load_model_config("tiny")
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(cfg)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(cfg)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(cfg, max_slots=4, max_len=512, step_s=0.05)),
    }
    with serve_in_process(config, engines) as cluster:
        # The whole run: 64 requests, 2 at a time, 16 decode steps of 50 ms each ≈ 26 s.
        opts = BenchOptions(
            router=cluster.servers["router"].address,
            num_prompts=64,
            max_concurrency=2,
            input_dist=InputDist.FIXED,
            input_len=8,
            output_len=16,
        )
        timer = threading.Timer(1.5, _thread.interrupt_main)
        timer.start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_bench(opts)
        assert time.monotonic() - start < 6.0
