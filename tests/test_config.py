"""ModelConfig validation, preset loading and the canonical fingerprint."""

from __future__ import annotations

import dataclasses

import pytest

from prfaas_jax.config import (
    LayerKind,
    MlpKind,
    RopeKind,
    available_presets,
    config_from_dict,
    load_model_config,
)
from prfaas_jax.errors import ConfigError


def test_presets_load_and_round_trip():
    assert {"tiny", "tiny-gdn", "tiny-lightning", "tiny-swa"} <= set(available_presets())
    for name in available_presets():
        cfg = load_model_config(name)
        assert config_from_dict(cfg.to_dict()) == cfg
        hash(cfg)  # usable as a jax.jit static argument


def test_tiny_is_kimi_linear_shaped():
    cfg = load_model_config("tiny")
    assert cfg.layers == (LayerKind.KDA,) * 3 + (LayerKind.MLA,)
    assert cfg.mlps == (MlpKind.DENSE,) + (MlpKind.MOE,) * 3
    assert cfg.mla.rope is RopeKind.NONE
    assert load_model_config("tiny-lightning").layers.count(LayerKind.LIGHTNING) == 7


def test_pattern_shorthand_expands():
    raw = load_model_config("tiny").to_dict()
    raw["layers"] = ["kda*2", "mla", "kda"]
    assert config_from_dict(raw).layers == (
        LayerKind.KDA,
        LayerKind.KDA,
        LayerKind.MLA,
        LayerKind.KDA,
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(bogus=1), "unknown key"),
        (lambda r: r["mla"].update(extra=2), "unknown key"),
        (lambda r: r.update(layers=["kda", "mamba", "mla", "kda"]), "bad entry 'mamba'"),
        (lambda r: r.update(mlps=["dense"]), "mlps has 1 entries"),
        (lambda r: r.pop("mla"), "[mla] section is missing"),
        (lambda r: r["linear"].update(num_v_heads=3), "multiple of"),
        (lambda r: r["moe"].update(top_k=99), "top_k"),
        (lambda r: r["mla"].update(rope="sideways"), 'mla.rope: expected one of "none"'),
        (lambda r: r.update(dtype="int8"), "dtype must be one of"),
        (lambda r: r["moe"].update(num_groups=3), "must divide num_experts"),
        (lambda r: r["moe"].update(num_groups=4, topk_groups=5), "topk_groups"),
        (lambda r: r["moe"].update(num_groups=4, top_k=3), "cannot supply"),
        (lambda r: r["moe"].update(num_shared_experts=0, use_shared_gate=True), "shared_gate"),
        (lambda r: r["linear"].update(kda_gate="clamp"), "linear.kda_gate: expected one of"),
        (lambda r: r["linear"].update(gate_lower_bound=0.0), "gate_lower_bound"),
        (lambda r: r["linear"].update(qk_scale=-1.0), "qk_scale"),
        (lambda r: r.update(residual={"mlp_gamma": 1.0}), "unknown key"),
    ],
)
def test_bad_configs_raise_config_error(mutate, message):
    raw = load_model_config("tiny").to_dict()
    mutate(raw)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        config_from_dict(raw)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match=r"presets: .*tiny"):
        load_model_config("no-such-model")


def test_toml_file_errors(tmp_path):
    broken = tmp_path / "broken.toml"
    broken.write_text("name = [")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_model_config(broken)
    with pytest.raises(ConfigError, match="cannot read model config"):
        load_model_config(tmp_path / "missing.toml")


def test_fingerprint_tracks_the_math_only():
    cfg = load_model_config("tiny")
    assert cfg.fingerprint() == dataclasses.replace(cfg, name="x", max_len=7).fingerprint()
    assert cfg.fingerprint() == dataclasses.replace(cfg, max_len_fixed=True).fingerprint()
    assert cfg.fingerprint() != dataclasses.replace(cfg, norm_eps=1e-6).fingerprint()
    assert cfg.fingerprint() != load_model_config("tiny-gdn").fingerprint()


def test_with_max_len_lifts_a_default_limit_and_keeps_a_trained_one():
    """A preset's max_len is a default (NoPE MLA, or RoPE without a trained range): lifted or
    lowered at will. One marked `max_len_fixed` (an imported checkpoint's trained positional
    range) may be lowered, never lifted."""
    cfg = load_model_config("recall-tiny")
    assert (cfg.max_len, cfg.max_len_fixed) == (4096, False)
    lifted = cfg.with_max_len(32768)
    assert lifted.max_len == 32768
    assert lifted == dataclasses.replace(cfg, max_len=32768)
    assert lifted.fingerprint() == cfg.fingerprint()
    assert cfg.with_max_len(512).max_len == 512
    fixed = dataclasses.replace(cfg, max_len_fixed=True)
    assert fixed.with_max_len(4096).max_len == 4096
    assert fixed.with_max_len(1024).max_len == 1024
    with pytest.raises(ConfigError, match="4097 tokens exceed recall-tiny's max_len 4096"):
        fixed.with_max_len(4097)
    with pytest.raises(ConfigError, match="max_len must be ≥ 1"):
        cfg.with_max_len(0)
