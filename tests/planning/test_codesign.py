"""`prfaas codesign`'s wire and cluster sides: layouts of a sweep, FLOP-scaled profiles, the 3:1
point against `prfaas plan` on the case study, S_kv against `prfaas kv`, and one-line errors for
bad sweeps. The toy-size training is in tests/train/test_recall_probe.py."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from prfaas_jax.cli import main
from prfaas_jax.config import LayerKind, load_model_config
from prfaas_jax.engine.kvsize import state_sizes
from prfaas_jax.planning.codesign import run_codesign
from prfaas_jax.planning.codesign_config import load_sweep
from prfaas_jax.planning.prefill_cost import (
    flop_profile,
    prefill_flops,
    prefill_flops_by_part,
    scale_profile,
)
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.state_bytes import layer_nbytes, state_nbytes
from prfaas_jax.wire_precision import WirePrecision

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs" / "plans" / "case-study-1t.toml"
KIMI = ROOT / "configs" / "codesign" / "kimi-ratio.toml"


def _sweep(tmp_path: Path, body: str, name: str = "sweep.toml") -> Path:
    path = tmp_path / name
    path.write_text(f'[deployment]\nplan = "{PLAN}"\nkv_lengths = [1024, 131072]\n{body}')
    return path


def _formula(cfg, lengths, trace):
    """The byte formula without the trace: a 57-block trace takes tens of seconds, and the
    traced sizes are checked through the command on tiny layouts below."""
    return state_sizes(cfg, lengths, measure=False)


@pytest.mark.parametrize("name", ["prfaas-1t", "mimo-v2-flash", "tiny-swa", "ring-2.5-1t"])
def test_flop_profile_is_the_flop_count(name):
    cfg = load_model_config(name)
    profile = flop_profile(cfg)
    for length in (1, 2, 127, 128, 129, 1000, 32768, 131072):
        assert profile(length) == pytest.approx(prefill_flops(cfg, length), rel=1e-12)


def test_scale_profile_keeps_an_equal_layout_exactly_and_scales_term_by_term():
    base = load_model_config("prfaas-1t")
    profile = Profile.polynomial([0.3891, 4.107e-5, 9.476e-11])
    assert scale_profile(profile, base, base) == profile
    # All 57 blocks MLA: the attention (L²) FLOPs are 57/15 of the base's.
    all_mla = base.__class__(**{**base.__dict__, "layers": (LayerKind.MLA,) * 57})
    scaled = scale_profile(profile, base, all_mla)
    (c0, c1, c2), fb, fa = scaled.coeffs[0], flop_profile(base), flop_profile(all_mla)
    assert c0 == 0.3891
    assert c2 == pytest.approx(9.476e-11 * 57 / 15, rel=1e-12)
    assert c1 == pytest.approx(4.107e-5 * fa.coeffs[0][1] / fb.coeffs[0][1], rel=1e-12)
    no_attention = base.__class__(**{**base.__dict__, "layers": (LayerKind.KDA,) * 57})
    with pytest.raises(ValueError, match="no FLOPs of order L\\^2"):
        scale_profile(profile, no_attention, base)


def test_kimi_placement_at_3_to_1_is_the_case_study_model_and_ratios_count_by_hand():
    sweep = load_sweep(KIMI)
    base = load_model_config("prfaas-1t")
    layouts = {p.ratio: sweep.layout(base, p) for p in sweep.points()}
    assert layouts["3:1"].layers == base.layers
    assert layouts["3:1"].fingerprint() == base.fingerprint()
    counts = {r: cfg.layers.count(LayerKind.MLA) for r, cfg in layouts.items()}
    # MLA at every (R+1)-th of 57 blocks, and at the last: 28 + 1, 14 + 1, 7 + 1, 3 + 1.
    assert counts == {"1:1": 29, "3:1": 15, "7:1": 8, "15:1": 4, "all-linear": 0, "all-full": 57}
    toy_base = load_model_config("tiny")
    toys = {p.ratio: sweep.toy_layout(sweep.toy, toy_base, base, p) for p in sweep.points()}
    toy_counts = {r: cfg.layers.count(LayerKind.MLA) for r, cfg in toys.items()}
    # The same rule over the toy's 8 blocks: 4 + 0, 2 + 0, 1 + 0 and 0 + 1 MLA blocks.
    assert toy_counts == {"1:1": 4, "3:1": 2, "7:1": 1, "15:1": 1, "all-linear": 0, "all-full": 8}
    assert all(cfg.linear == toy_base.linear and cfg.mla == toy_base.mla for cfg in toys.values())


def test_the_3_to_1_point_is_prfaas_plan_on_the_case_study(tmp_path, capsys):
    sweep = load_sweep(
        _sweep(
            tmp_path,
            '[model]\nbase = "prfaas-1t"\nplacement = "kimi"\n[axes]\nratio = ["3:1", "1:1"]\n',
        )
    )
    rows = run_codesign(sweep, load_model_config("prfaas-1t"), measure=_formula)
    assert main(["plan", "--config", str(PLAN), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    best = rows[0].plan.best
    assert rows[0].point.ratio == "3:1"
    assert best.routing.threshold == plan["threshold_tokens"] == 19_400
    assert (best.num_prfaas, best.num_pd_prefill, best.num_pd_decode) == (
        plan["n_prfaas"],
        plan["n_pd_prefill"],
        plan["n_pd_decode"],
    )
    assert best.lambda_max == plan["lambda_max"]
    assert rows[0].plan.speedup_vs_homogeneous == plan["speedup_vs_homogeneous"]
    # 1:1 doubles the MLA layers (29 of 57): more attention work per prefill, a different plan.
    assert rows[1].plan.best.lambda_max != best.lambda_max


@pytest.mark.parametrize("egress", [None, 5])
def test_a_wire_point_is_prfaas_plan_wire_on_the_case_study(tmp_path, capsys, egress):
    body = '[model]\nbase = "prfaas-1t"\nplacement = "kimi"\n[axes]\nratio = ["3:1"]\n'
    body += 'wire = ["native", "int8"]\n'
    path = _sweep(tmp_path, body)
    if egress is not None:  # [deployment] egress_gbps: the link instead of the plan's 100 Gbps
        text = path.read_text().replace("kv_lengths", f"egress_gbps = {egress}\nkv_lengths")
        path.write_text(text)
    sweep = load_sweep(path)
    rows = run_codesign(sweep, load_model_config("prfaas-1t"), measure=_formula)
    argv = ["plan", "--config", str(PLAN), "--model", "prfaas-1t", "--json"]
    assert main([*argv, "--bandwidth", str(egress or 100), "--wire", "native", "int8"]) == 0
    planned = json.loads(capsys.readouterr().out)["rows"]
    assert [str(row.precision) for row in rows] == [p["wire"] for p in planned]
    for row, plan in zip(rows, planned, strict=True):
        best = row.plan.best
        assert best.routing.threshold == plan["threshold_tokens"]
        assert best.lambda_max == pytest.approx(plan["lambda_max"], rel=1e-9)
        assert best.egress_gbps == pytest.approx(plan["egress_gbps"], rel=1e-9)
    int8 = WirePrecision.parse("int8")
    for size in rows[1].kv:
        assert size.formula_bytes == state_nbytes(rows[1].layout, size.length, int8)
        assert size.growing_bytes + size.fixed_bytes == size.formula_bytes
    native, int8 = (row.plan.best for row in rows)
    if egress is None:  # the link does not bind: the same plan, half the egress
        assert int8.lambda_max == native.lambda_max and int8.egress_gbps < 0.5 * native.egress_gbps
    else:  # it binds: fewer bytes, a lower t and more throughput
        assert int8.routing.threshold < native.routing.threshold
        assert int8.lambda_max > 1.3 * native.lambda_max


def test_state_bytes_are_prfaas_kv_and_bfloat16_states_halve_the_recurrent_part(tmp_path, capsys):
    path = _sweep(
        tmp_path,
        '[model]\nbase = "tiny"\n[axes]\nratio = ["3:1", "1:1"]\n'
        'state_dtype = ["float32", "bfloat16"]\n',
    )
    layouts = tmp_path / "layouts"
    argv = ["codesign", "--config", str(path), "--no-recall", "--json", "--layouts", str(layouts)]
    plot, table = tmp_path / "codesign.png", tmp_path / "codesign.csv"
    assert main([*argv, "--plot", str(plot), "--csv", str(table)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(table, newline="") as fh:
        lines = list(csv.DictReader(fh))
    assert [int(line["kv_bytes_131072"]) for line in lines] == [
        row["kv_bytes"]["131072"] for row in rows
    ]
    for row in rows:
        argv = [
            "kv",
            "--model",
            str(layouts / f"{row['layout']}.toml"),
            "--json",
            "--lengths",
            "1024,131072",
        ]
        assert main(argv) == 0  # traced == serialized == formula, or exit 1
        kv = json.loads(capsys.readouterr().out)["rows"]
        assert row["kv_bytes"] == {str(r["length"]): r["formula_bytes"] for r in kv}
    by_label = {row["label"]: row for row in rows}
    for ratio, num_kda in (("3:1", 3), ("1:1", 2)):
        fp32, bf16 = by_label[f"{ratio} float32"], by_label[f"{ratio} bfloat16"]
        # tiny: 2 KDA heads of 16 × 16; S in float32 is 2·16·16·4 B per layer, half in bfloat16.
        assert fp32["recurrent_bytes"] - bf16["recurrent_bytes"] == num_kda * 2 * 16 * 16 * 2
        # tiny's MLA caches 32 + 8 float32 values per token and layer.
        assert fp32["bytes_per_token"] == bf16["bytes_per_token"] == (4 - num_kda) * 40 * 4


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('[model]\nbase = "prfaas-1t"\n[axes]\nwidth = [1]\n', "axes.width: unknown key"),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nratio = ["3:1"]\n',
            "axes.ratio[0]: 3:1 needs a multiple of 4 blocks",
        ),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nratio = ["three"]\n',
            "axes.ratio[0]: 'three' is not a ratio",
        ),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nlinear_mixer = ["mla"]\n',
            "axes.linear_mixer[0]: mla is not a linear mixer",
        ),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nfull_mixer = ["gqa"]\n',
            "axes.full_mixer[0]: prfaas-1t has no [attention] section",
        ),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nfull_mixer = ["swa"]\nkv_lora_rank = [256]\n',
            "axes.full_mixer[0]",
        ),
        ('[model]\nbase = "prfaas-1t"\n[toy.quick]\nstep = 3\n', "toy.quick.step: unknown key"),
        ('[model]\nbase = "prfaas-1t"\n[toy.large]\nstep = 3\n', "toy.large.step: unknown key"),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nplacement = ["middle"]\n',
            "axes.placement[0]: 'middle' is not one of early, even, late",
        ),
        (
            '[model]\nbase = "prfaas-1t"\n[toy]\nlr_grid = [1e-3, 0.0]\n',
            "toy.lr_grid: learning rates must be positive",
        ),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nstate_dtype = ["float8"]\n',
            "state_dtype must be one of",
        ),
        (
            '[model]\nbase = "prfaas-1t"\n[axes]\nwire = ["native", "int4"]\n',
            "axes.wire[1]: wire precision state='int4'",
        ),
    ],
)
def test_bad_sweeps_are_one_line_errors_naming_the_key(tmp_path, capsys, body, key):
    path = _sweep(tmp_path, body)
    assert main(["codesign", "--config", str(path), "--no-recall"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prfaas codesign: error:"), err
    assert key in err[0]


def test_a_toy_setting_the_sweep_lacks_is_a_one_line_error(tmp_path, capsys):
    path = _sweep(tmp_path, '[model]\nbase = "prfaas-1t"\n[toy]\nsteps = 3\n')
    assert main(["codesign", "--config", str(path), "--toy", "large"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.endswith("toy.large: the sweep has no [toy.large]")
    assert main(["codesign", "--config", str(path), "--no-recall", "--seeds", "0"]) == 2
    assert "--seeds must be at least 1" in capsys.readouterr().err
    assert load_sweep(KIMI).toy_setting("large").num_layers == 16


def test_all_linear_has_no_growing_state_and_no_attention_time(tmp_path):
    sweep = load_sweep(
        _sweep(
            tmp_path,
            '[model]\nbase = "prfaas-1t"\nplacement = "kimi"\n[axes]\nratio = ["all-linear"]\n',
        )
    )
    (row,) = run_codesign(sweep, load_model_config("prfaas-1t"), measure=_formula)
    assert row.bytes_per_token == 0
    assert row.kv[0].formula_bytes == row.kv[-1].formula_bytes == 57 * 4_341_760
    assert len(row.prfaas_prefill_s.coeffs[0]) < 3 or row.prfaas_prefill_s.coeffs[0][2] == 0
    assert math.isfinite(row.plan.best.lambda_max)


def test_linear_mixer_axis_changes_the_recurrent_state_by_hand(tmp_path):
    sweep = load_sweep(
        _sweep(
            tmp_path,
            '[model]\nbase = "prfaas-1t"\nplacement = "kimi"\n'
            '[axes]\nlinear_mixer = ["kda", "gdn", "lightning"]\n',
        )
    )
    rows = run_codesign(sweep, load_model_config("prfaas-1t"), measure=_formula)
    fixed = {row.point.linear_mixer.value: row.fixed_bytes for row in rows}
    state = 42 * 64 * 128 * 128 * 4  # 42 linear layers, 64 heads of 128 × 128, float32
    conv = 42 * 3 * (3 * 64 * 128) * 2  # KDA and GDN: 3 taps of q ‖ k ‖ v in bfloat16
    assert fixed == {"kda": state + conv, "gdn": state + conv, "lightning": state}
    assert {row.bytes_per_token for row in rows} == {15 * 1152}
    # Lightning's full-rank output gate (2 · 7168 · 8192 weights against KDA's rank-128 gates)
    # outweighs its cheaper recurrence: more FLOPs per token, a slower prefill, a smaller Λ_max.
    by_mixer = {row.point.linear_mixer.value: row.plan.best.lambda_max for row in rows}
    assert by_mixer["lightning"] < by_mixer["kda"]


def test_placement_moves_the_full_blocks_and_only_the_exposed_transfer(tmp_path):
    body = (
        '[model]\nbase = "prfaas-1t"\nplacement = "kimi"\n[axes]\nratio = ["3:1"]\n'
        'placement = ["early", "even", "late"]\n'
    )
    path = tmp_path / "placement.toml"
    path.write_text(
        f'[deployment]\nplan = "{PLAN}"\nkv_lengths = [1024, 131072]\negress_gbps = 25\n{body}'
    )
    sweep = load_sweep(path)
    base = load_model_config("prfaas-1t")
    early, even, late = run_codesign(sweep, base, measure=_formula)
    mla = [[k is LayerKind.MLA for k in row.layout.layers] for row in (early, even, late)]
    assert mla[0] == [True] * 15 + [False] * 42 and mla[2] == mla[0][::-1]
    assert even.layout.layers == base.layers
    toy_base = load_model_config("tiny")
    toys = [sweep.toy_layout(sweep.toy, toy_base, base, p) for p in sweep.points()]
    # 8 toy blocks at 3:1, Kimi placement: MLA at blocks 3 and 7; early 0 and 1; late 6 and 7.
    assert [[i for i, k in enumerate(t.layers) if k is LayerKind.MLA] for t in toys] == [
        [0, 1],
        [3, 7],
        [6, 7],
    ]
    # The same bytes and FLOPs, so the same plan; the exposed transfer is what moves.
    assert early.kv == even.kv == late.kv and early.plan == even.plan == late.plan
    n = 131072
    assert early.exposed_s(n) < even.exposed_s(n) <= late.exposed_s(n)
    # Early: every MLA cache leaves while the 42 KDA layers compute; what is left after the
    # prefill is the last KDA layer's state (6.25 Gbps: 25 over 4 PrfaaS instances), less the
    # LM head's compute, which follows that layer.
    assert early.link_share_gbps == 25 / early.plan.best.num_prfaas == 6.25
    flops = prefill_flops_by_part(early.layout, n)
    head_s = early.prfaas_prefill_s(n) * flops.head / flops.total
    last_kda = layer_nbytes(early.layout, LayerKind.KDA, n)
    assert early.exposed_s(n) == pytest.approx(8 * last_kda / 6.25e9 - head_s, rel=1e-9)
