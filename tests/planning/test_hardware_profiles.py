"""Hardware files and measured profiles: the derived H20 file against the case study's
calibration, `prfaas plan --model` + hardware files, plan configs that point at a profile file,
`prfaas kv` on a Hugging Face config.json, and `prfaas profile` on the tiny preset."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from prfaas_jax.cli import main
from prfaas_jax.planning.hardware import load_hardware

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "configs" / "plans" / "case-study-1t.toml"


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", "--config", str(PLAN), "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_h20_file_holds_the_case_study_calibration():
    plan = tomllib.loads(PLAN.read_text())
    profile = load_hardware("h20x8").measured["prfaas-1t"]
    assert profile.coeffs == tuple(plan["local"]["prefill_time_s"]["coeffs"])
    assert "derived" in profile.source


def test_plan_with_model_and_h20_file_is_the_case_study(capsys):
    # S_kv from prfaas-1t's state instead of Table 5, H20 from the hardware file: the link does
    # not bind at 100 Gbps, so t, the split and Λ_max are the case study's; only egress moves.
    paper = _plan_json(capsys)
    ours = _plan_json(capsys, "--model", "prfaas-1t", "--local-hardware", "h20x8")
    for key in ("threshold_tokens", "n_prfaas", "n_pd_prefill", "n_pd_decode", "lambda_max"):
        assert ours[key] == paper[key]
    assert ours["egress_gbps"] != paper["egress_gbps"]
    assert ours["egress_gbps"] == pytest.approx(paper["egress_gbps"], rel=0.03)


def test_hardware_flags_need_a_model(capsys):
    assert main(["plan", "--config", str(PLAN), "--local-hardware", "h20x8"]) == 2
    assert "need --model" in capsys.readouterr().err


def test_a_plan_profile_may_be_a_profile_file(tmp_path, capsys):
    (tmp_path / "h20.toml").write_text(
        'model = "prfaas-1t"\nsource = "test"\ncoeffs = [0.83454, 8.8087e-5, 7.3576e-10]\n'
    )
    text = PLAN.read_text().replace(
        "[local.prefill_time_s]                # [derived] H20 is not published. Two-term "
        'calibration:\nkind = "polynomial"',
        '[local.prefill_time_s]\nkind = "measured"\npath = "h20.toml"\n#',
    )
    assert 'path = "h20.toml"' in text
    text = text.replace("coeffs = [0.83454, 8.8087e-5, 7.3576e-10]", "")
    (tmp_path / "plan.toml").write_text(text)
    assert main(["plan", "--config", str(tmp_path / "plan.toml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == _plan_json(capsys)


KIMI_HUB = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "torch_dtype": "bfloat16",
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
}


def test_kv_reads_a_hugging_face_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_HUB))
    argv = ["kv", "--json", "--no-measure", "--lengths", "1K,128K"]
    assert main([*argv, "--model", str(tmp_path / "config.json")]) == 0
    ours = json.loads(capsys.readouterr().out)["rows"]
    assert main([*argv, "--model", "kimi-linear-48b"]) == 0
    preset = json.loads(capsys.readouterr().out)["rows"]
    assert [r["formula_bytes"] for r in ours] == [r["formula_bytes"] for r in preset]
    # 7 MLA × 1152 B/token + 20 KDA × (32·128·128·4 + 3·3·4096·2) B, by hand.
    assert ours[0]["formula_bytes"] == 1024 * 7 * 1152 + 20 * (32 * 128 * 128 * 4 + 3 * 12288 * 2)


@pytest.mark.slow
def test_profile_on_tiny_is_monotone_and_plan_and_simulate_accept_it(tmp_path, capsys):
    out = tmp_path / "tiny-cpu.toml"
    # Points far apart (×32 in length, ×64 in batch), so that a loaded machine's noise cannot
    # reorder them.
    argv = ["profile", "--model", "tiny", "--lengths", "32,1024", "--batch-sizes", "1,64"]
    assert main([*argv, "--repeats", "3", "--out", str(out), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["monotone"], (written["prefill_s"], written["decode_step_s"])
    profile = tomllib.loads(out.read_text())
    assert profile["lengths"] == [32, 1024] and profile["decode_batch_sizes"] == [1, 64]
    assert profile["prefill_s"] == pytest.approx(written["prefill_s"], rel=1e-5)
    text = PLAN.read_text()
    for section in ("prfaas", "local"):
        start = text.index(f"[{section}.prefill_time_s]")
        end = text.index("\n\n", start)
        text = (
            text[:start]
            + f'[{section}.prefill_time_s]\nkind = "measured"\npath = "{out}"'
            + text[end:]
        )
    (tmp_path / "plan.toml").write_text(text)
    assert main(["plan", "--config", str(tmp_path / "plan.toml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lambda_max"] > 0
    sim = (ROOT / "configs" / "sim" / "case-study-1t.toml").read_text()
    sim = sim.replace('plan = "../plans/case-study-1t.toml"', f'plan = "{tmp_path / "plan.toml"}"')
    (tmp_path / "sim.toml").write_text(sim)
    argv = ["simulate", "--config", str(tmp_path / "sim.toml"), "--requests", "200"]
    assert main([*argv, "--no-saturation", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)
