"""A fake-engine cluster of real processes: routing, outputs, status codes, health, metrics, and
`prfaas bench` (in process) against it. The tests share one cluster: each assertion holds
whatever traffic came before it."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from serving_support import MALFORMED_REQUESTS, generate, parse_metrics, sample, scrape_metrics

from prfaas_jax.cli import main as prfaas
from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.codec.handoff import Handoff, pack_handoff
from prfaas_jax.engine.fake import FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling import SamplingParams
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 31 * i) % CFG.vocab_size for i in range(n)]


def test_routes_outputs_and_state_bytes(router):
    lengths = [1, 10, 63, 64, 65, 100, 300, 64, 200, 5]
    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        replies = list(pool.map(lambda n: generate(router, prompt(n, n), 6), lengths))
    for n, reply in zip(lengths, replies, strict=True):
        report = reply.report
        assert report.route == ("prfaas" if n > 64 else "pd"), n
        assert report.prefill_instance == ("prfaas-0" if n > 64 else "pd-0")
        assert report.decode_instance == "pd-1"
        assert (report.prompt_len, report.cached_len, report.uncached_len) == (n, 0, n)
        assert report.threshold == 64 and report.ttft_s > 0
        assert report.state_bytes == state_nbytes(CFG, n)
        assert reply.tokens == fake_tokens(prompt(n, n), 6, CFG.vocab_size)
    stats = router.GetStats(pb.GetStatsRequest())
    assert stats.requests_prfaas >= 4 and stats.requests_pd >= 6
    assert (stats.model, stats.vocab_size, stats.max_len) == ("tiny", CFG.vocab_size, 512)


def test_every_push_takes_the_data_path(fake_cluster, router):
    """Both routes' states reach the decode worker on its data port (`[link] data_path`, on by
    default), one data connection per push."""
    address = fake_cluster["workers"]["pd-1"]["address"]
    with grpc.insecure_channel(address) as channel:
        decode = pb_grpc.WorkerControlStub(channel)
        before = decode.GetStats(pb.GetStatsRequest()).data_path_pushes
        for n in (5, 100, 64, 65):  # PD, PrfaaS, PD, PrfaaS
            reply = generate(router, prompt(n, 7), 3)
            assert reply.tokens == fake_tokens(prompt(n, 7), 3, CFG.vocab_size)
        assert decode.GetStats(pb.GetStatsRequest()).data_path_pushes == before + 4


def test_one_token_and_longest_requests(router):
    assert generate(router, prompt(7), 1).tokens == fake_tokens(prompt(7), 1, CFG.vocab_size)
    longest = prompt(500)
    assert generate(router, longest, 13).tokens == fake_tokens(longest, 13, CFG.vocab_size)


@pytest.mark.parametrize(("fields", "message"), MALFORMED_REQUESTS)
def test_bad_requests_are_invalid_argument(router, fields, message):
    with pytest.raises(grpc.RpcError) as err:
        list(router.Generate(pb.GenerateRequest(**fields), timeout=30))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    # The cluster keeps serving.
    assert generate(router, [5, 6], 2).tokens == fake_tokens([5, 6], 2, CFG.vocab_size)


def test_oversized_request_is_refused_unparsed(router):
    # Far more than any valid request for max_len 512: gRPC refuses it before the router parses.
    huge = pb.GenerateRequest(prompt_token_ids=[1] * 100_000, max_new_tokens=1)
    with pytest.raises(grpc.RpcError) as err:
        list(router.Generate(huge, timeout=30))
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate(router, [5, 6], 2).tokens == fake_tokens([5, 6], 2, CFG.vocab_size)


def test_duplicate_request_id_in_flight(router):
    slow = router.Generate(
        pb.GenerateRequest(request_id="dup", prompt_token_ids=[1, 2], max_new_tokens=60),
        timeout=60,
    )
    next(slow)  # the first token: the request is in flight
    with pytest.raises(grpc.RpcError) as err:
        generate(router, [3], 2, request_id="dup")
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
    slow.cancel()
    # Once finished (here: cancelled), the id is free again.
    expected = fake_tokens([3], 2, CFG.vocab_size)
    deadline = time.monotonic() + 10.0
    while True:
        try:
            assert generate(router, [3], 2, request_id="dup").tokens == expected
            break
        except grpc.RpcError as retry:
            assert retry.code() is grpc.StatusCode.ALREADY_EXISTS
        if time.monotonic() > deadline:
            pytest.fail("the id of a cancelled request was not released within 10 s")
        time.sleep(0.05)


def test_health_and_reflection_on_every_server(fake_cluster):
    addresses = [fake_cluster["router"], *(w["address"] for w in fake_cluster["workers"].values())]
    for address in addresses:
        with grpc.insecure_channel(address) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
            if address == fake_cluster["router"]:
                assert "prfaas.v1.Router" in services
            else:
                assert {"prfaas.v1.WorkerControl", "prfaas.v1.DecodeWorker"} <= services


def frames_for(n: int, preset: str = "tiny") -> list[bytes]:
    cfg = load_model_config(preset)
    result = FakePrefillEngine(cfg).prefill(prompt(n)) if preset == "tiny" else None
    if result is None:  # a state of another model: only its header matters here
        from prfaas_jax.model import init_state

        state = init_state(cfg, 1, n)
        state = type(state)(lengths=state.lengths + n, layers=state.layers)
        frames = list(codec.encode(state, cfg))
        first = 0
    else:
        frames, first = list(codec.encode(result.state, CFG)), result.first_token
    return [*frames, pack_handoff(Handoff(first, SamplingParams()), frames[0])]


def push(address: str, request_id: str, frames: list[bytes]) -> pb.PushStateReply:
    with grpc.insecure_channel(address) as channel:
        chunks = [pb.StateChunk(request_id=request_id), *(pb.StateChunk(frame=f) for f in frames)]
        return pb_grpc.DecodeWorkerStub(channel).PushState(iter(chunks), timeout=30)


def test_decode_worker_validates_frames(fake_cluster):
    decode = fake_cluster["workers"]["pd-1"]["address"]
    good = frames_for(20)
    reply = push(decode, "ok-state", good)
    assert reply.state_bytes == state_nbytes(CFG, 20) and reply.frames == len(good)
    bad = {
        "garbage": [b"not a frame", good[-1]],
        "truncated": [*good[:1], good[1][:-3], *good[2:]],
        "no handoff": good[:-1],
        "other model": frames_for(8, "tiny-gdn"),
        "duplicate": [*good[:2], good[1], *good[2:]],
        "no trailer": [*good[:-2], good[-1]],
        "another stream's frame": [good[0], frames_for(20)[1], *good[2:]],
    }
    for name, frames in bad.items():
        with pytest.raises(grpc.RpcError) as err:
            push(decode, f"bad-{name}", frames)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, name
    with pytest.raises(grpc.RpcError) as err:
        push(decode, "ok-state", good)
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS


def test_worker_status_codes(fake_cluster):
    workers = fake_cluster["workers"]

    def control(name: str) -> pb_grpc.WorkerControlStub:
        return pb_grpc.WorkerControlStub(grpc.insecure_channel(workers[name]["address"]))

    def code(call) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:
            call()
        return err.value.code()

    prefill_on_decode = pb_grpc.PrefillWorkerStub(grpc.insecure_channel(workers["pd-1"]["address"]))
    request = pb.PrefillRequest(request_id="x", prompt_token_ids=[1], decode_address="a:1")
    assert code(lambda: prefill_on_decode.Prefill(request)) is grpc.StatusCode.FAILED_PRECONDITION
    prefill = pb_grpc.PrefillWorkerStub(grpc.insecure_channel(workers["pd-0"]["address"]))
    empty = pb.PrefillRequest(request_id="x", decode_address="a:1")
    assert code(lambda: prefill.Prefill(empty)) is grpc.StatusCode.INVALID_ARGUMENT
    to_decode = pb.SetRoleRequest(role=pb.ROLE_PD_DECODE)
    assert (
        code(lambda: control("prfaas-0").SetRole(to_decode)) is grpc.StatusCode.FAILED_PRECONDITION
    )
    unspecified = pb.SetRoleRequest(role=pb.ROLE_UNSPECIFIED)
    assert code(lambda: control("pd-0").SetRole(unspecified)) is grpc.StatusCode.INVALID_ARGUMENT
    link = pb.SetLinkRequest(bandwidth_bytes_per_s=1e6)
    assert code(lambda: control("pd-0").SetLink(link)) is grpc.StatusCode.FAILED_PRECONDITION
    zero = pb.SetLinkRequest(bandwidth_bytes_per_s=0)
    assert code(lambda: control("prfaas-0").SetLink(zero)) is grpc.StatusCode.INVALID_ARGUMENT
    assert control("prfaas-0").GetStats(pb.GetStatsRequest()).link.bandwidth_bytes_per_s == 2e6


def test_metrics_endpoint(fake_cluster, router):
    address = fake_cluster["metrics"]
    content_type, text = scrape_metrics(address)
    assert content_type.startswith("text/plain; version=0.0.4")
    before = parse_metrics(text)[1]
    reply = generate(router, prompt(100), 3)
    text = scrape_metrics(address)[1]
    after = parse_metrics(text)[1]
    # Counters of the shared cluster hold earlier tests' traffic: this request's own retries are
    # the difference, and it took none.
    assert reply.report.attempts == 1
    assert sample(after, "prfaas_retries_total") - sample(before, "prfaas_retries_total") == 0
    assert sample(after, "prfaas_requests_total", route="prfaas", outcome="ok") >= 1
    for line in (
        "# TYPE prfaas_requests_total counter",
        "# TYPE prfaas_egress_bytes_total counter",
        "# TYPE prfaas_retries_total counter",
    ):
        assert line in text.splitlines(), line
    assert sample(after, "prfaas_threshold_tokens") == 64
    assert sample(after, "prfaas_link_capacity_bytes_per_second") >= 0
    assert sample(after, "prfaas_queue_depth", instance="prfaas-0", role="prfaas_prefill") >= 0
    assert sample(after, "prfaas_instances", role="pd_decode") == 1
    assert sample(after, "prfaas_role_changes_total") == 0
    assert sample(after, "prfaas_instances_down") == 0
    assert sample(after, "prfaas_ttft_seconds_bucket", le="+Inf") >= 1
    with pytest.raises(urllib.error.HTTPError) as err:
        scrape_metrics(address, "/other")
    assert err.value.code == 404


def test_bench_cli_against_the_cluster(fake_cluster, capsys):
    argv = ["bench", "--router", fake_cluster["router"]]
    argv += ["--num-prompts", "24", "--request-rate", "40", "--burstiness", "0.5"]
    argv += ["--output-len", "4", "--goodput", "ttft:60000", "--json"]
    code = prfaas(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["completed"], summary["failed"]) == (24, 0)
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
    assert 0 < summary["offload_fraction"] < 1 and summary["egress_bytes"] > 0
    assert summary["model"] == "tiny" and summary["ttft"]["p99_ms"] > 0
    assert "\x1b[" not in err  # progress is drawn on a terminal only
    # The router's side: its CPU per request; no lookups, its prefix caches being off.
    assert summary["router"]["cpu_ms_per_request"] > 0
    assert summary["router"]["lookup_mean_ms"] is None and not summary["router"]["cache_index"]
