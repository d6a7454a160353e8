"""The demo's recall check can fail: states that are well formed but wrong collapse the answers.

`prfaas demo` serves the trained `recall-tiny` model by default: every prompt ends with an asked
key, and the answer (the second generated token) comes from the decode worker, out of the state
it was shipped. Here the prefill workers run with `[faults] blank_state_prob = 1`: every state
they ship is zeros of the right shapes, with valid checksums, so no check on the wire objects.
The single-process reference still answers, the cluster does not — the demo reports the collapse
per route and exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prfaas_jax.serving.loadgen.demo import DEMO_NEW_TOKENS
from prfaas_jax.toml_config import resolve


@pytest.mark.slow
def test_blank_states_collapse_recall_and_fail_the_demo(tmp_path, child_cache_home):
    toy = resolve("clusters", "toy").read_text()
    assert 'preset = "recall-tiny"' in toy
    config = tmp_path / "blank.toml"
    # One prompt per prefill call: the check is of the states, and the workers then compile no
    # batched calls behind their start, beside the demo's requests.
    assert "[engine]\n" in toy
    toy = toy.replace("[engine]\n", "[engine]\nprefill_batch_rows = 1\n")
    config.write_text(toy + "\n[faults]\nblank_state_prob = 1.0\n")
    result = subprocess.run(
        [sys.executable, "-m", "prfaas_jax.cli", "demo", "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, XDG_CACHE_HOME=str(child_cache_home)),  # the session's compile cache
    )
    assert result.returncode == 1, result.stderr[-3000:]
    payload = json.loads(result.stdout)
    recall = payload["summary"]["recall_accuracy"]
    for route in ("prfaas", "pd"):
        assert recall[route]["single_process"] >= 0.6, recall
        assert recall[route]["cluster"] <= 0.2, recall
    assert not payload["summary"]["ok"]
    # Nothing on the wire objected: every state arrived, of the right size, and decoded.
    for request in payload["requests"]:
        assert request["state_bytes"] == request["state_nbytes"]
        assert len(request["tokens"]) == DEMO_NEW_TOKENS
