"""`prfaas serve` with `[model] impl = "pallas"`: the toy cluster (`configs/clusters/toy.toml`,
the trained `recall-tiny`) serves the toy workload through the Pallas kernels, and every output
equals greedy generation through the `chunk` ops in this process; on a machine without a GPU or
TPU the kernels run interpreted and `prfaas serve` says so in one line.

The workload is the demo's recall prompts, one per distinct length (so both routes: lengths up
to the toy's t = 64 stay in the PD cluster, longer ones go to PrfaaS), which keeps the
single-process reference to one compile per prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import jax
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.model.weights import load_model
from prfaas_jax.serving.cluster.serve import INTERPRETED_WARNING
from prfaas_jax.serving.cluster_config import load_cluster_config, resolve_cluster_path
from prfaas_jax.serving.loadgen.demo import (
    DEMO_NEW_TOKENS,
    demo_workload,
    recall_task,
    reference_tokens,
    send,
)
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

from .test_serve_cli import alive


def pallas_toy_config(path):
    """The toy cluster's TOML with `impl = "pallas"` in `[model]`, and one prompt per prefill
    call (`prefill_batch_rows = 1`): the workers then compile no batched calls, each of which
    would cost an interpreted kernel's compile at start."""
    toy = resolve_cluster_path("toy").read_text()
    assert toy.count("[model]\n") == 1 and toy.count("[engine]\n") == 1
    toy = toy.replace("[model]\n", '[model]\nimpl = "pallas"\n')
    path.write_text(toy.replace("[engine]\n", "[engine]\nprefill_batch_rows = 1\n"))
    return path


@pytest.mark.slow
def test_serve_pallas_outputs_equal_chunk(tmp_path, child_cache_home):
    config = load_cluster_config(pallas_toy_config(tmp_path / "toy-pallas.toml"))
    assert str(config.model.impl) == "pallas"
    cfg = load_model_config(config.model.preset)
    prompts, _ = demo_workload(cfg.vocab_size, config.model.seed, recall_task(config.model.preset))
    by_length = {len(p): p for p in prompts}
    prompts = [by_length[n] for n in sorted(by_length)]
    threshold = 64
    assert min(map(len, prompts)) <= threshold < max(map(len, prompts))  # both routes

    ready_file = tmp_path / "ready.json"
    command = [sys.executable, "-m", "prfaas_jax.cli", "serve", "--config", str(config.path)]
    command += ["--ready-file", str(ready_file), "--log-dir", str(tmp_path / "logs")]
    env = dict(os.environ, XDG_CACHE_HOME=str(child_cache_home))
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        # The reference compiles while the cluster starts.
        _, params = load_model(config.model.preset, seed=config.model.seed)
        expected = reference_tokens(cfg, params, prompts, DEMO_NEW_TOKENS, config.engine.max_len)
        deadline = time.monotonic() + 600
        while not ready_file.exists():
            assert server.poll() is None, server.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "prfaas serve not ready after 600 s"
            time.sleep(0.2)
        ready = json.loads(ready_file.read_text())
        with grpc.insecure_channel(ready["router"]) as channel:
            stub = pb_grpc.RouterStub(channel)
            results = [send(stub, f"req-{i}", p, DEMO_NEW_TOKENS) for i, p in enumerate(prompts)]
        assert [r.tokens for r in results] == expected
        assert {r.report.route for r in results} == {"pd", "prfaas"}
        pids = [ready["router_pid"], *(w["pid"] for w in ready["workers"].values())]
        server.terminate()
        assert server.wait(timeout=60) == 0
        stderr = server.stderr.read().decode()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    interpreted = jax.default_backend() == "cpu"
    assert ready["interpreted_kernels"] is interpreted
    assert (INTERPRETED_WARNING in stderr.splitlines()) is interpreted
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "orphan processes"
