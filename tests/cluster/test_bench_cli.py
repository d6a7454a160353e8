"""`prfaas bench` through the CLI: a short run against a fake-engine cluster of real processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_cli_against_a_fake_cluster(fake_cluster):
    command = [sys.executable, "-m", "prfaas_jax.cli", "bench", "--router", fake_cluster["router"]]
    command += ["--num-prompts", "24", "--request-rate", "40", "--burstiness", "0.5"]
    command += ["--output-len", "4", "--goodput", "ttft:60000", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["completed"], summary["failed"]) == (24, 0)
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
    assert 0 < summary["offload_fraction"] < 1 and summary["egress_bytes"] > 0
    assert summary["model"] == "tiny" and summary["ttft"]["p99_ms"] > 0
    assert "\x1b[" not in result.stderr  # progress is drawn on a terminal only
