"""Recall at toy size is measured by training (train/recall_probe.py): the all-full point of the
shipped sweep's quick setting, trained through `prfaas codesign --quick`, answers MQAR — and,
on a `wire` axis, still does with its context state shipped in int8 (one training run)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from prfaas_jax.cli import main

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "configs" / "codesign" / "kimi-ratio.toml"


@pytest.mark.slow
def test_all_full_point_of_the_quick_setting_recalls(tmp_path, capsys):
    shipped = tomllib.loads(KIMI.read_text())
    toy, quick = shipped["toy"], shipped["toy"]["quick"]
    lines = ['[model]\nbase = "prfaas-1t"\nplacement = "kimi"\n[axes]\nratio = ["all-full"]\n']
    lines.append('wire = ["native", "int8"]\n')
    lines.append(f'[deployment]\nplan = "{ROOT / "configs" / "plans" / "case-study-1t.toml"}"\n')
    # One training run: the sweep's settings but its learning-rate grid (--seeds and lr_grid
    # are tests/planning/test_recall_runs.py's) and its other settings' sub-tables.
    kept = {k: v for k, v in toy.items() if k not in ("quick", "large", "lr_grid")}
    lines.append("[toy]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kept.items()))
    lines.append("[toy.quick]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in quick.items()))
    path = tmp_path / "all-full.toml"
    path.write_text("".join(lines))
    assert main(["codesign", "--config", str(path), "--quick", "--json"]) == 0
    row, wire = json.loads(capsys.readouterr().out)["rows"]
    assert row["toy_layout"] == {"mla": quick["num_layers"]}
    assert set(row["recall"]) == {str(n) for n in quick["eval_lengths"]}
    assert row["recall"][str(quick["seq_len"])] >= 0.95
    # The int8 point: the same trained toy, its answers made from a shipped state.
    assert (row["wire"], wire["wire"]) == ("native", "int8")
    assert wire["recall_shared_with"] == row["label"] and wire["toy_layout"] == row["toy_layout"]
    assert wire["recall"][str(quick["seq_len"])] >= 0.9
    assert wire["kv_bytes"]["131072"] < 0.6 * row["kv_bytes"]["131072"]
