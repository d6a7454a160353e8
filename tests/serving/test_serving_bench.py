"""bench/serving.py's race against `transformers serve`: the arithmetic of
bench/serving_metrics.py (goodput, throughput, percentiles and the ratios) against numbers worked
out by hand, and the client's reading of a stream that a server closes without ``data: [DONE]``
(as `transformers serve` does) against the events a stub HTTP server sent, the prfaas cluster
it serves with (bench/serving_cluster.py) as the cluster's loader reads it, and the CPU time it
reads per process (bench/process_cpu.py) against a child's own clock."""

from __future__ import annotations

import http.server
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import threading
from typing import ClassVar

import pytest

from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.loadgen.openai_client import HTTPError, stream_completion
from prfaas_jax.toml_config import dumps

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def metrics():
    yield from bench_module("serving_metrics")


@pytest.fixture(scope="module")
def cluster():
    yield from bench_module("serving_cluster")


@pytest.fixture(scope="module")
def process_cpu():
    yield from bench_module("process_cpu")


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def replies(m):
    """Four requests of 5 tokens each, and one that failed; times in seconds.

    a: TTFT 0.1, E2EL 0.5 → TPOT 0.1   meets TTFT ≤ 300 ms, TPOT ≤ 150 ms
    b: TTFT 0.2, E2EL 1.4 → TPOT 0.3   misses TPOT
    c: TTFT 0.4, E2EL 0.6 → TPOT 0.05  misses TTFT
    d: TTFT 0.3, E2EL 0.7 → TPOT 0.1   meets both (TTFT exactly at the objective)
    e: an error after its first token: counts nowhere
    f: 3 tokens of the 5 asked: a short reply, counts nowhere
    """
    R = m.Reply
    return [
        R(10, 5, ttft=0.1, e2el=0.5, itl=[0.1, 0.1, 0.1, 0.1], output_tokens=5),
        R(20, 5, ttft=0.2, e2el=1.4, itl=[0.3, 0.3, 0.3, 0.3], output_tokens=5),
        R(30, 5, ttft=0.4, e2el=0.6, itl=[0.05, 0.05, 0.05, 0.05], output_tokens=5),
        R(40, 5, ttft=0.3, e2el=0.7, itl=[0.1, 0.1, 0.1, 0.1], output_tokens=5),
        R(50, 5, ttft=0.1, itl=[0.2], output_tokens=2, error="HTTPError: HTTP 500"),
        R(60, 5, ttft=0.1, e2el=0.3, itl=[0.1, 0.1], output_tokens=3),
    ]


def test_goodput_counts_the_requests_that_meet_both_objectives(metrics):
    s = metrics.summarize(replies(metrics), 2.0, metrics.Objective(ttft_ms=300, tpot_ms=150))
    assert (s["requests"], s["completed"], s["failed"], s["met_objective"]) == (6, 4, 2, 2)
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["request_throughput"] == pytest.approx(4 / 2.0)
    assert s["output_throughput"] == pytest.approx(20 / 2.0)
    assert s["errors"] == ["HTTPError: HTTP 500", "short reply"]


def test_percentiles_are_of_the_completed_requests_in_milliseconds(metrics):
    s = metrics.summarize(replies(metrics), 2.0, metrics.Objective(ttft_ms=300, tpot_ms=150))
    # TTFT 100, 200, 300, 400 ms: P50 = 250; P90 = 300 + 0.7 · 100 = 370 (linear interpolation)
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(370.0)
    # TPOT 50, 100, 100, 300 ms: P50 = 100, P99 = 100 + 0.97 · 200 = 294
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["p99"] == pytest.approx(294.0)
    # ITL: 16 gaps, four each of 50, 100, 100, 300 ms; P90 at rank 13.5 of 0..15 → 300
    assert s["itl_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["p90"] == pytest.approx(300.0)


def test_a_one_token_reply_is_judged_by_its_ttft_alone(metrics):
    one = metrics.Reply(5, 1, ttft=0.2, e2el=0.2, output_tokens=1)
    assert one.tpot is None
    assert metrics.Objective(ttft_ms=200, tpot_ms=1).met_by(one)
    assert not metrics.Objective(ttft_ms=199, tpot_ms=1e9).met_by(one)


def test_ratios_per_rate_and_at_each_servers_best_rate(metrics):
    def run(goodput: float, tokens: float) -> dict:
        return {"goodput": goodput, "output_throughput": tokens}

    ours = {1.0: run(1.0, 30.0), 2.0: run(1.8, 60.0), 4.0: run(0.5, 90.0)}
    theirs = {1.0: run(0.5, 10.0), 2.0: run(0.0, 12.0), 4.0: run(0.0, 0.0)}
    c = metrics.compare(ours, theirs)
    assert c["goodput_ratio"][1.0] == pytest.approx(2.0)
    assert math.isinf(c["goodput_ratio"][2.0]) and math.isinf(c["goodput_ratio"][4.0])
    assert c["throughput_ratio"] == pytest.approx({1.0: 3.0, 2.0: 5.0, 4.0: math.inf})
    # The best of each over the sweep: 1.8 (at 2 req/s) against 0.5 (at 1 req/s)
    assert c["best_goodput"] == {"prfaas": 1.8, "transformers": 0.5}
    assert c["best_goodput_ratio"] == pytest.approx(3.6)
    assert math.isnan(metrics.compare({1.0: run(0, 0)}, {1.0: run(0, 0)})["best_goodput_ratio"])


EVENTS = [{"choices": [{"text": "w1"}]}, {"choices": [{"text": " w2"}]}, {"usage": {"n": 2}}]


class _NoDone(http.server.BaseHTTPRequestHandler):
    """Answers a completion with EVENTS as server-sent events, then closes: no ``[DONE]``; the
    last event has no blank line after it. Keeps the request body for the test."""

    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        length = int(self.headers["content-length"])
        self.bodies.append(json.loads(self.rfile.read(length)))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        frames = [f"data: {json.dumps(e)}" for e in EVENTS]
        self.wfile.write(("\n\n".join(frames) + "\n").encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def no_done_url():
    server = http.server.HTTPServer(("127.0.0.1", 0), _NoDone)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1"
    server.shutdown()
    server.server_close()


def test_the_bench_cluster_takes_set_settings_over_its_own(cluster, tmp_path):
    """``--set SECTION.KEY=VALUE`` (a TOML value) over the single-node cluster, as the cluster's
    own loader reads the file the bench writes; a malformed setting is refused."""
    settings = ["model.preset='tiny'", "engine.prefill_batch_rows = 1", "router.threshold=99"]
    sections = cluster.cluster_sections("ckpt", "reference", 544, 32, settings)
    path = tmp_path / "cluster.toml"
    path.write_text(dumps(sections))
    config = load_cluster_config(path)
    assert (config.model.preset, config.model.impl) == ("tiny", "reference")
    assert (config.engine.max_len, config.engine.max_slots) == (544, 32)
    assert (config.engine.chunk_len, config.engine.buckets) == (512, (32, 64, 128, 256, 512))
    assert config.engine.prefill_batch_rows == 1 and config.router.threshold == 99
    assert (config.instances.pd_prefill, config.instances.pd_decode) == (1, 1)
    assert not config.prefix_cache.enabled and not config.controller.enabled
    for bad in ("engine.max_slots", "max_slots=4", "engine.max_slots=[1"):
        with pytest.raises(ValueError, match="--set"):
            cluster.cluster_sections("ckpt", "reference", 544, 32, [bad])


BURN = """
import sys, time
print(flush=True)
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < 0.1:
    pass
print(time.process_time(), flush=True)
sys.stdin.readline()
"""


def test_process_cpu_counts_a_child_by_its_role(process_cpu, tmp_path):
    """A child named ``--role pd_decode`` burns 0.1 s of CPU by its own clock between the two
    readings: the tree from this process holds it, and its time is counted under its role, none
    on XLA threads."""
    argv = [sys.executable, "-c", BURN, "--role", "pd_decode"]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            child.stdout.readline()  # it runs as itself by now
            assert child.pid in process_cpu.process_tree(os.getpid())
            cpu = process_cpu.ProcessCpu([child.pid])
            child.stdin.write("go\n")
            child.stdin.flush()
            own = float(child.stdout.readline())  # the child's whole CPU time, startup included
            used = cpu.used()
        finally:
            child.kill()
    assert set(used) == {"pd_decode"} and used["pd_decode"]["xla"] == 0.0
    assert 0.08 <= used["pd_decode"]["total"] <= own + 0.02
    # Without a role, a Python module goes by its own name (as `transformers serve` by its script).
    (tmp_path / "sleeper.py").write_text("import sys\nprint(flush=True)\nsys.stdin.readline()\n")
    argv = [sys.executable, "-m", "sleeper"]
    popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=tmp_path, text=True)
    with subprocess.Popen(argv, **popen) as child:
        try:
            child.stdout.readline()  # it runs as itself by now
            assert process_cpu.process_name(child.pid) == "sleeper"
        finally:
            child.kill()


def test_a_stream_closed_without_done_is_cut_short_unless_told_otherwise(no_done_url):
    with pytest.raises(HTTPError, match=r"without data: \[DONE\]"):
        list(stream_completion(no_done_url, "m", [1, 2], 2))
    chunks = [c for _, c in stream_completion(no_done_url, "m", "w1 w2", 2, until_done=False)]
    assert chunks == EVENTS


def test_ignore_eos_is_sent_unless_told_not_to(no_done_url):
    _NoDone.bodies.clear()
    list(stream_completion(no_done_url, "m", "w3", 2, ignore_eos=False, until_done=False))
    with pytest.raises(HTTPError):
        list(stream_completion(no_done_url, "m", [3], 2))
    sent, default = _NoDone.bodies
    assert "ignore_eos" not in sent and sent["prompt"] == "w3"
    assert default["ignore_eos"] is True and default["prompt"] == [3]
