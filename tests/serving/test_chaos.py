"""The bounded soak under faults (serving/loadgen/soak.py, the harness of bench/chaos.py): a
fake-engine cluster of real processes (configs/clusters/chaos.toml) takes ~175 requests over
50 s while a worker is SIGKILLed every 10 s (a PD decode worker with requests mid-stream, the
PrfaaS prefill worker, a PD prefill worker, a PD decode worker again) and 3 % of state transfers
get a corrupted frame and 3 % a dropped link. No request may be lost, duplicated or wrong;
nearly all must complete; and the faults must really have happened.
"""

from __future__ import annotations

import pytest

from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.loadgen.soak import SoakOptions, run_soak
from prfaas_jax.serving.loadgen.soak_report import check_stream


def test_check_stream():
    expected = [10, 11, 12, 13, 14]
    assert check_stream([], expected) == "ok"
    assert check_stream([10, 11, 12], expected) == "ok"
    assert check_stream(expected, expected) == "ok"
    # A resume that re-sent the last two tokens, then went on.
    assert check_stream([10, 11, 12, 11, 12, 13], expected) == "duplicated"
    assert check_stream([10, 11, 11], expected) == "duplicated"
    assert check_stream([*expected, 14], expected) == "duplicated"  # longer than asked
    assert check_stream([10, 12, 13], expected) == "wrong"  # a gap
    assert check_stream([10, 11, 99], expected) == "wrong"


@pytest.mark.slow
def test_soak_under_faults(tmp_path):
    config = load_cluster_config("chaos")
    assert config.chaos.corrupt_frame_prob > 0 and config.chaos.drop_transfer_prob > 0
    options = SoakOptions(duration_s=50.0, rate=3.5, kill_every_s=10.0, seed=1, deadline_s=120.0)
    report = run_soak(config.path, options, log_dir=tmp_path / "logs", progress=None)
    print(report.format_table())
    counts = report.counts()
    assert counts["sent"] >= 150
    assert counts["lost"] == 0
    assert counts["duplicated"] == 0
    assert counts["wrong"] == 0
    assert counts["completed"] >= 0.95 * counts["accepted"]
    roles = {kill["role"] for kill in report.kills}
    assert len(report.kills) >= 2 and {"prfaas_prefill", "pd_decode"} <= roles
    assert report.restarts >= 2
    assert report.faults["corrupted_frames"] + report.faults["dropped_transfers"] >= 1
    assert report.router["retries"] >= 1
    assert report.router["resumed"] >= 1  # a decode worker died with streams open
