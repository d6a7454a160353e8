"""The router's adaptive wire precision (serving/router/wire_rule.py, `[wire]`): which precision
each attempt's state is sent in as the egress the control loop observes crosses the levels, on
a fake clock; and, over fake-engine workers in this process, that a narrowed request's state
arrives in exactly the bytes the formula gives for that precision, is reported and counted."""

from __future__ import annotations

import grpc
import pytest
from serving_support import fake_config, fake_instances, generate, serve_in_process

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.errors import ConfigError
from prfaas_jax.policy.routing import ClusterKind
from prfaas_jax.policy.threshold_controller import LinkObservation
from prfaas_jax.policy.wire_choice import AdaptiveWireConfig, WireOption
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.router.control import RouterControl
from prfaas_jax.serving.router.metrics import render_metrics
from prfaas_jax.serving.router.wire_rule import WireRule
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision

CFG = load_model_config("tiny")
INT8 = WireOption("int8", byte_ratio=0.49, recall_loss=0.001)
FP8 = WireOption("fp8_e4m3", byte_ratio=0.49, recall_loss=0.03)
WIRE = {
    "recall_budget": 0.01,
    "high_utilization": 0.8,
    "low_utilization": 0.5,
    "window_s": 2.0,
    "options": [{"precision": "int8", "byte_ratio": 0.49, "recall_loss": 0.001}],
}
# bf16 carries the fake engines' values (a 1/64 grid in [−2, 2), token ids below 256) exactly,
# so the narrowed request's state is the native one in half the bytes.
WIRE_BF16 = {**WIRE, "options": [{"precision": "bf16", "byte_ratio": 0.5, "recall_loss": 0.0}]}


def observe(rule: WireRule, now: float, sent: int, capacity: float = 1000.0) -> None:
    rule.observe(LinkObservation(now, sent, capacity, prfaas_queue_depth=0))


def test_offloaded_requests_narrow_while_the_link_runs_hot():
    """1000 B/s of capacity, a 2 s window: 900 B in the first second is u = 0.9 ≥ 0.8, so
    offloaded requests go int8 (fp8 loses more than the budget); PD requests never cross the
    link and stay as they are; at 0.6 (between the levels) int8 holds; at 0.25 ≤ 0.5 native."""
    rule = WireRule(
        AdaptiveWireConfig(
            options=(FP8, INT8), recall_budget=0.01, high_utilization=0.8, low_utilization=0.5
        ),
        WIRE_NATIVE,
    )
    seen = []
    for now, sent in ((0.0, 0), (1.0, 900), (2.0, 1200), (3.0, 1400)):
        observe(rule, now, sent)
        seen.append((rule.choose(ClusterKind.PRFAAS), rule.choose(ClusterKind.PD)))
    # u: 0 (one sample), 0.9, 0.6 (1200 B over 2 s), 0.25 (500 B over 2 s)
    assert seen == [("", ""), ("int8", ""), ("int8", ""), ("", "")]
    assert rule.narrowed == {"int8": 2}
    assert rule.utilization == pytest.approx(0.25)
    assert rule.precision("int8") == WirePrecision.parse("int8")
    assert rule.state_nbytes(CFG, 100, "int8") == state_nbytes(
        CFG, 100, WirePrecision.parse("int8")
    )


def test_no_capacity_yet_is_not_observed_and_no_section_never_narrows():
    rule = WireRule(
        AdaptiveWireConfig(options=(INT8,), high_utilization=0.8, low_utilization=0.5), WIRE_NATIVE
    )
    observe(rule, 0.0, 0, capacity=0.0)
    observe(rule, 1.0, 10**6, capacity=0.0)  # before the link has a capacity: nothing to judge
    assert rule.choose(ClusterKind.PRFAAS) == "" and rule.utilization == 0.0
    link_bf16 = WirePrecision.parse("bf16")
    off = WireRule(None, link_bf16)
    observe(off, 0.0, 0)
    observe(off, 1.0, 10**6)
    assert off.choose(ClusterKind.PRFAAS) == "" and off.narrowed == {}
    # Not narrowed: the cluster's own [link] precision prices the state.
    assert off.state_nbytes(CFG, 64, "") == state_nbytes(CFG, 64, link_bf16)


def test_the_section_is_the_simulators_vocabulary(tmp_path):
    config = load_cluster_config(fake_config(tmp_path / "a.toml", wire=WIRE))
    assert config.wire == AdaptiveWireConfig(
        options=(INT8,),
        recall_budget=0.01,
        high_utilization=0.8,
        low_utilization=0.5,
        window_s=2.0,
    )
    assert load_cluster_config(fake_config(tmp_path / "b.toml")).wire is None
    bad = {**WIRE, "options": [{"precision": "int4", "byte_ratio": 0.3, "recall_loss": 0.0}]}
    with pytest.raises(ConfigError, match=r"wire.options\[0\]"):
        load_cluster_config(fake_config(tmp_path / "c.toml", wire=bad))


def test_a_narrowed_request_ships_the_bytes_of_its_precision(tmp_path):
    """Fake-engine workers in this process, `[wire]` on, the router's control loop stepped on a
    fake clock over the PrfaaS worker's egress counter (its capacity the configured 2 MB/s):
    1.9 MB in a second is u = 0.95, so a long prompt's state then crosses in bf16 — exactly
    state_nbytes(…, bf16) bytes, half of native's, the tokens unchanged — and the report,
    `GetStats` and the metric say so; a short prompt (PD) ships native bytes, and so does a long
    one once 50 KB over 1.5 s (u ≈ 0.02) has cooled the link. A precision the codec does not
    know is the worker's INVALID_ARGUMENT."""
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml", wire=WIRE_BF16))
    long, short = [(3 + 7 * i) % CFG.vocab_size for i in range(200)], [5] * 20
    bf16 = WirePrecision.parse("bf16")
    with serve_in_process(config, fake_instances(CFG)) as cluster:
        control, prfaas = RouterControl(cluster.core), cluster.core.workers["prfaas-0"]

        def step(now: float, sent: int) -> None:
            # What a poll of the worker would bring (the in-process workers serve no
            # WorkerControl, so the loop keeps the stats set here).
            prfaas.stats = pb.WorkerStats(egress_bytes=sent)
            control.step(now)

        step(0.0, 0)
        step(1.0, 1_900_000)
        hot = [generate(cluster.router, p, 4) for p in (long, short)]
        step(2.5, 1_950_000)
        cool = generate(cluster.router, long, 4)
        stats = cluster.stats()
        text = render_metrics(control.snapshot())
        bad = pb.PrefillRequest(
            request_id="x",
            prompt_token_ids=long,
            decode_address="127.0.0.1:1",
            wire_precision="int4",
        )
        address = cluster.servers["prfaas-0"].address
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.PrefillWorkerStub(channel).Prefill(bad, timeout=10)
    narrowed, local = hot
    assert (narrowed.report.route, narrowed.report.wire_precision) == ("prfaas", "bf16")
    assert (
        narrowed.report.state_bytes == state_nbytes(CFG, 200, bf16) == state_nbytes(CFG, 200) // 2
    )
    assert narrowed.tokens == fake_tokens(long, 4, CFG.vocab_size)
    assert (local.report.route, local.report.wire_precision) == ("pd", "")
    assert local.report.state_bytes == state_nbytes(CFG, 20)
    assert (cool.report.route, cool.report.wire_precision) == ("prfaas", "")
    assert cool.report.state_bytes == state_nbytes(CFG, 200)
    assert dict(stats.wire_narrowed) == {"bf16": 1}
    assert stats.wire_utilization == pytest.approx(50_000 / 1.5 / 2e6)
    assert 'prfaas_wire_narrowed_total{precision="bf16"} 1.0' in text.splitlines()
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "wire_precision" in refused.value.details()


def test_a_request_asks_its_own_precision(tmp_path):
    """Without `[wire]`, over fake-engine workers in this process: a long prompt asking int8 or
    fp8_e4m3 crosses in exactly that precision's bytes, the decode side takes the rounded state
    and the tokens are right, and the report says so, nothing counted as narrowed; a short one
    (PD) ships native whatever it asks; a precision the codec does not know is the router's
    INVALID_ARGUMENT."""
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml"))
    long, short = [(3 + 7 * i) % CFG.vocab_size for i in range(200)], [5] * 20
    with serve_in_process(config, fake_instances(CFG)) as cluster:
        asked = {
            p: generate(cluster.router, long, 4, wire_precision=p) for p in ("int8", "fp8_e4m3")
        }
        local = generate(cluster.router, short, 4, wire_precision="int8")
        stats = cluster.stats()
        with pytest.raises(grpc.RpcError) as refused:
            generate(cluster.router, long, 4, wire_precision="int4")
    for precision, reply in asked.items():
        assert (reply.report.route, reply.report.wire_precision) == ("prfaas", precision)
        nbytes = state_nbytes(CFG, 200, WirePrecision.parse(precision))
        assert reply.report.state_bytes == nbytes < state_nbytes(CFG, 200) // 2
        assert reply.tokens == fake_tokens(long, 4, CFG.vocab_size)
    assert (local.report.route, local.report.wire_precision) == ("pd", "")
    assert local.report.state_bytes == state_nbytes(CFG, 20)
    assert dict(stats.wire_narrowed) == {}
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "wire_precision" in refused.value.details()
