"""`prfaas plan --wire`: the 1T case study planned with its state in each wire precision.

Oracles: the plain `prfaas plan --model` for native (the same search), Eq. 2's egress
(offload × Λ_max × E[S_kv | L > t]) recomputed from the printed quantities, the byte formula's
ratio of each precision at the offloaded lengths, and the throughput model's monotonicity: fewer
bytes on a binding link never lower Λ_max nor raise t.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prfaas_jax.cli import main

PLAN = Path(__file__).resolve().parents[2] / "configs" / "plans" / "case-study-1t.toml"
WIRES = ["native", "bf16", "fp8_e4m3", "int8"]


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--config", str(PLAN), "--model", "prfaas-1t", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("bandwidth", ["100", "5"])
def test_each_precision_is_one_plan_of_its_own_bytes(capsys, bandwidth):
    rows = plan_json(capsys, "--bandwidth", bandwidth, "--wire", *WIRES)["rows"]
    assert [row["wire"] for row in rows] == WIRES
    plain = plan_json(capsys, "--bandwidth", bandwidth)
    native = rows[0]
    for key in ("threshold_tokens", "n_pd_prefill", "n_pd_decode", "lambda_max", "egress_gbps"):
        assert native[key] == plain[key]
    for row in rows:
        egress = row["offload_fraction"] * row["lambda_max"] * row["kv_mib_offloaded"]
        assert row["egress_gbps"] == pytest.approx(egress * 2**20 * 8 / 1e9, rel=1e-9)
        assert row["egress_gbps"] <= float(bandwidth) * (1 + 1e-9)
    for fewer, more in zip(rows[1:], rows, strict=False):
        assert fewer["lambda_max"] >= more["lambda_max"] - 1e-9
        assert fewer["threshold_tokens"] <= more["threshold_tokens"]


def test_at_100_gbps_the_link_does_not_bind_and_only_egress_moves(capsys):
    rows = {r["wire"]: r for r in plan_json(capsys, "--wire", *WIRES)["rows"]}
    for row in rows.values():
        assert (row["threshold_tokens"], row["lambda_max"]) == (
            rows["native"]["threshold_tokens"],
            rows["native"]["lambda_max"],
        )
    assert rows["int8"]["egress_gbps"] < 0.5 * rows["native"]["egress_gbps"]


def test_wire_needs_a_model_and_a_known_precision(capsys):
    assert main(["plan", "--config", str(PLAN), "--wire", "int8"]) == 2
    assert "--wire needs --model" in capsys.readouterr().err
    argv = ["plan", "--config", str(PLAN), "--model", "prfaas-1t", "--wire", "int4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected one of native, bf16, fp8_e4m3, int8" in err[0]
