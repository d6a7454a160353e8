"""End to end on the real model: `prfaas demo --json` runs the toy cluster (real processes,
the trained `recall-tiny` KDA + MLA model, JAX engines) on a concurrent mix of short and long
recall prompts.

Checked here from its JSON: every request with uncached length > t went to PrfaaS and the rest
to PD (from the RequestReport, against the t of the cluster's config), every output is greedy
generation of the model (recomputed here, not taken from the demo's own check: one
teacher-forced pass of the float32 `lax.scan` reference over prompt + output, which must put
its argmax on each generated token), `state_bytes` equals `state_nbytes(prompt_len)`
(recomputed here), each answer (the second token) is the value the prompt asks for as often
through the cluster as in one process, on both routes, and no process is left behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.config import load_model_config
from prfaas_jax.model import init_state, prefill
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.model.weights import load_model
from prfaas_jax.serving.cluster.netns import owned_namespaces
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.loadgen.demo import (
    DEMO_NEW_TOKENS,
    RECALL_LENGTHS,
    TLS_BYTES_PER_TRANSFER,
    demo_workload,
    recall_task,
)

# A generated token may differ from the oracle's argmax only where the two top logits are this
# close (the engines' chunked kernels and the reference scan round differently).
TIE_LOGIT = 1e-4


def assert_greedy(preset: str, seed: int, outputs: list[list[int]]) -> None:
    """Each output is the greedy continuation of its prompt: all sequences, right-padded to
    one length (causal, so padding never reaches earlier positions), go through one reference
    prefill, and the logits before each generated token must peak at that token."""
    cfg, params = load_model(preset, seed=seed)
    prompts, _ = demo_workload(cfg.vocab_size, seed, recall_task(preset))
    sequences = [p + out for p, out in zip(prompts, outputs, strict=True)]
    width = max(map(len, sequences))
    tokens = np.zeros((len(sequences), width), np.int32)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    state = init_state(cfg, len(sequences), width)
    logits, _ = prefill(params, cfg, jnp.asarray(tokens), state, impl="reference")
    logits = np.asarray(logits)
    for row, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        for i, token in enumerate(out):
            step = logits[row, len(prompt) - 1 + i]
            assert step[token] >= step.max() - TIE_LOGIT, (row, i, token, int(step.argmax()))


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(proc.name))
    return found


NETNS = pytest.param(
    True,
    id="netns",
    marks=pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="--netns needs root and iproute2 (ip, tc)",
    ),
)


@pytest.mark.slow
@pytest.mark.parametrize("netns", [pytest.param(False, id="loopback"), NETNS])
def test_demo_on_the_real_model(tmp_path, child_cache_home, netns):
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-m", "prfaas_jax.cli", "demo", "--json", "--log-dir", str(log_dir)]
    # The demo's config keeps a compile cache: the session's (tests/conftest.py), not the user's.
    demo = subprocess.Popen(
        [*argv, *(["--netns"] if netns else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, XDG_CACHE_HOME=str(child_cache_home)),
    )
    stdout, stderr = demo.communicate(timeout=600)
    assert demo.returncode == 0, stderr[-3000:]
    payload = json.loads(stdout)
    requests = payload["requests"]
    cluster_config = load_cluster_config("toy")
    preset = cluster_config.model.preset
    assert preset == "recall-tiny"
    cfg = load_model_config(preset)
    assert [r["prompt_len"] for r in requests] == list(RECALL_LENGTHS)
    # The configured t, or one the controller moved to and logged: a queue that piles up on
    # PrfaaS (a loaded machine) may re-solve t mid-run ("threshold 64 → 48 (queue_surge)").
    solved = re.findall(r"threshold \S+ → (\S+) \(\w+\)", (log_dir / "router.log").read_text())
    thresholds = {cluster_config.router.threshold, *map(float, solved)}
    routes = set()
    for r in requests:
        assert r["threshold"] in thresholds, (r["threshold"], thresholds)
        assert r["route"] == ("prfaas" if r["uncached_len"] > r["threshold"] else "pd"), r
        assert r["uncached_len"] == r["prompt_len"] and r["cached_len"] == 0
        assert r["output_matches"] and len(r["tokens"]) == DEMO_NEW_TOKENS
        assert r["state_bytes"] == state_nbytes(cfg, r["prompt_len"]) == r["state_nbytes"]
        assert r["prefill_instance"] == ("prfaas-0" if r["route"] == "prfaas" else "pd-0")
        routes.add(r["route"])
    assert routes == {"prfaas", "pd"}
    assert_greedy(preset, cluster_config.model.seed, [r["tokens"] for r in requests])
    summary = payload["summary"]
    assert summary["ok"] and summary["outputs_match"] == len(RECALL_LENGTHS)
    for route, recall in summary["recall_accuracy"].items():
        assert recall["cluster"] == recall["single_process"] >= 0.6, (route, recall)
    answered = [r["recalled"] for r in requests]
    assert answered == [r["recalled_single_process"] for r in requests]
    assert summary["egress_bytes"] > 0
    # Each route's transfer after prefill is part of its TTFT, and takes some time.
    for route, exposed in summary["mean_exposed_transfer_s"].items():
        assert 0 < exposed < summary["mean_ttft_s"][route], route
    assert not processes_mentioning(str(log_dir)), "processes left behind"
    if netns:  # the states crossed the kernel-shaped veth: its count is theirs plus headers
        assert summary["egress_bytes"] <= summary["link_kernel_bytes"]
        handshakes = TLS_BYTES_PER_TRANSFER * summary["link_tls_transfers"]  # mutual TLS
        assert summary["link_tls_transfers"] >= 1
        assert summary["link_kernel_bytes"] <= 1.08 * summary["egress_bytes"] + handshakes
        assert owned_namespaces(demo.pid) == [], "namespaces left behind"
    else:
        assert summary["link_kernel_bytes"] is None
