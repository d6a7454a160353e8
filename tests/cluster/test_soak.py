"""The bounded soak under faults (serving/loadgen/soak.py, the harness of `prfaas soak`): a
fake-engine cluster of real processes (configs/clusters/faults.toml) takes ~175 requests over
25 s while a worker is SIGKILLed every 5 s (a PD decode worker with requests mid-stream, the
PrfaaS prefill worker, a PD prefill worker, a PD decode worker again) and 3 % of state transfers
get a corrupted frame and 3 % a dropped link. No request may be lost, duplicated or wrong; no
attempt may fail on a state that does not match its tokens (engine/fake.py: the router's retry
would hide it, so the logs are read); nearly all must complete; and the faults must really have
happened. It runs as a user would:
`prfaas soak`, its table and then its JSON.
"""

from __future__ import annotations

import json

import pytest

from prfaas_jax.cli import main as prfaas
from prfaas_jax.engine.fake import STATE_MISMATCH
from prfaas_jax.serving.cluster_config import load_cluster_config


@pytest.mark.slow
def test_soak_under_faults(tmp_path, capsys):
    config = load_cluster_config("faults")
    assert config.faults.corrupt_frame_prob > 0 and config.faults.drop_transfer_prob > 0
    argv = ["soak", "--config", str(config.path), "--duration", "25", "--rate", "7"]
    argv += ["--kill-every", "5", "--seed", "1", "--deadline", "120"]
    code = prfaas([*argv, "--log-dir", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    table, _, last_line = out.rstrip().rpartition("\n")
    print(table)
    report = json.loads(last_line)
    counts = report["counts"]
    assert code == 0  # nothing lost, duplicated or wrong
    assert "outputs wrong" in table and "resumed mid-stream" in table
    assert counts["sent"] >= 150
    assert counts["lost"] == 0
    assert counts["duplicated"] == 0
    assert counts["wrong"] == 0
    lines = [
        line
        for path in (tmp_path / "logs").glob("*.log")
        for line in path.read_text(errors="replace").splitlines()
    ]
    assert any("attempt 1 failed" in line for line in lines)  # the router logs why attempts fail
    refused = [line for line in lines if STATE_MISMATCH in line]
    assert not refused, refused[:3]
    assert counts["completed"] >= 0.95 * counts["accepted"]
    roles = {kill["role"] for kill in report["kills"]}
    assert len(report["kills"]) >= 2 and {"prfaas_prefill", "pd_decode"} <= roles
    assert report["restarts"] == len(report["kills"])  # every killed worker was replaced
    assert report["faults"]["corrupted_frames"] + report["faults"]["dropped_transfers"] >= 1
    assert report["router"]["retries"] >= 1
    assert report["router"]["resumed"] >= 1  # a decode worker died with streams open
