"""`prfaas kv`: state sizes of the full-size presets by hand, formula, real prefill and codec;
Table 5 and the §2.3 egress figures; FLOP counts; hardware profiles; the command's JSON and errors.

The hand calculations below are written from the configs in the canonical representation of
docs/design.md §3.2, independently of model/state.py: MLA caches kv_lora_rank + qk_rope_head_dim
bf16 values per token, GQA 2·n_kv·head_dim (K and V dims may differ), SWA the same for the last
min(L, W) tokens, KDA/GDN an fp32 S[H_v, d_k, d_v] plus 3 conv taps of bf16 channels, Lightning
an fp32 S[H, d_k, d_v].
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

import jax
import pytest

from prfaas_jax.cli import main
from prfaas_jax.config import load_model_config
from prfaas_jax.engine import codec
from prfaas_jax.engine.kvsize import (
    abstract_prefill_state,
    formula_size,
    nbytes_by_kind,
    state_sizes,
)
from prfaas_jax.errors import ConfigError
from prfaas_jax.model.hybrid import param_specs
from prfaas_jax.planning.hardware import load_hardware
from prfaas_jax.planning.paper_tables import (
    EGRESS_FIGURES,
    MIB,
    PAPER_LENGTHS,
    TABLE5,
    cluster_egress_gbps,
    kv_gbps,
)
from prfaas_jax.planning.prefill_cost import (
    attention_pairs,
    count_params,
    prefill_flops,
    prefill_flops_by_part,
)
from prfaas_jax.state_bytes import layer_fixed_nbytes
from prfaas_jax.wire_precision import WirePrecision

FP32_KDA_32 = 32 * 128 * 128 * 4  # 2,097,152 B: 32 heads of 128×128 fp32
CONV_KIMI = 3 * (3 * 32 * 128) * 2  # 73,728 B: 3 taps × [q | k | v] channels, bf16


@dataclass(frozen=True)
class Hand:
    per_token: int = 0  # growing layers, bytes per token
    fixed: int = 0  # linear layers, bytes
    windowed_per_token: int = 0  # SWA layers, bytes per token while L ≤ window
    window: int = 0

    def at(self, length: int) -> int:
        windowed = min(length, self.window) * self.windowed_per_token
        return length * self.per_token + windowed + self.fixed


HAND = {
    # 7 MLA × 1152 B/token + 20 KDA × (2,097,152 B state + 73,728 B conv tail)
    "kimi-linear-48b": Hand(7 * (512 + 64) * 2, 20 * (FP32_KDA_32 + CONV_KIMI)),
    # 12 GQA × 2 KV heads × (256 + 256) bf16; 36 GDN × (32 v-heads fp32 + 3 × (2·16·128 + 32·128))
    "qwen3-next-80b": Hand(
        12 * 2 * 512 * 2, 36 * (FP32_KDA_32 + 3 * (2 * 16 * 128 + 32 * 128) * 2)
    ),
    # 15 GQA as above; 45 GDN × (64 v-heads fp32 + 3 × (2·16·128 + 64·128) bf16)
    "qwen3.5-397b": Hand(
        15 * 2 * 512 * 2, 45 * (64 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 64 * 128) * 2)
    ),
    # 9 GA × 4 KV heads × (192 + 128); 39 SWA × 8 KV heads × (192 + 128) for min(L, 128) tokens
    "mimo-v2-flash": Hand(9 * 4 * 320 * 2, 0, 39 * 8 * 320 * 2, 128),
    # 10 MLA × 1152; 70 Lightning × 64 heads of 128×128 fp32
    "ring-2.5-1t": Hand(10 * 1152, 70 * 64 * 128 * 128 * 4),
    "minimax-m2.5": Hand(62 * 8 * 256 * 2),
    "qwen3-235b": Hand(94 * 4 * 256 * 2),
    "deepseek-v3": Hand(61 * (512 + 64) * 2),
    # 15 MLA × 1152; 42 KDA × (64 heads fp32 + 3 × 3·64·128 bf16)
    "prfaas-1t": Hand(15 * 1152, 42 * (64 * 128 * 128 * 4 + 3 * 3 * 64 * 128 * 2)),
}
REAL = tuple(name for name in HAND if name != "prfaas-1t")


@functools.cache
def _abstract(name: str):
    cfg = load_model_config(name)
    return cfg, param_specs(cfg)


def test_kimi_example_of_the_issue():
    assert (FP32_KDA_32, CONV_KIMI) == (2_097_152, 73_728)
    assert HAND["kimi-linear-48b"].at(1) == 7 * 1152 + 20 * (2_097_152 + 73_728)


@pytest.mark.parametrize("length", PAPER_LENGTHS)
@pytest.mark.parametrize("name", tuple(HAND))
def test_formula_equals_hand(name, length):
    cfg = load_model_config(name)
    size = formula_size(cfg, length)
    assert size.formula_bytes == HAND[name].at(length) == size.serialized_bytes
    hand = HAND[name]
    assert (size.growing_bytes, size.fixed_bytes) == (length * hand.per_token, hand.fixed)
    assert size.windowed_bytes == min(length, hand.window) * hand.windowed_per_token


# The shortest and the longest paper length: each state is affine in the length past every
# window (the longest window of a preset is MiMo's 128), so two lengths pin it; each is one
# abstract prefill of a full-size model (seconds for 94 blocks).
@pytest.mark.parametrize("length", (PAPER_LENGTHS[0], PAPER_LENGTHS[-1]))
@pytest.mark.parametrize("name", tuple(HAND))
def test_measured_equals_formula(name, length):
    cfg, params = _abstract(name)
    size = formula_size(cfg, length)
    measured = nbytes_by_kind(cfg, abstract_prefill_state(cfg, length, params))
    assert sum(measured.values()) == size.formula_bytes == HAND[name].at(length)
    assert measured == size.by_kind


def test_state_sizes_reports_measurements_and_progress():
    calls = []
    sizes = state_sizes(
        load_model_config("tiny-swa"), [3, 50], progress=lambda c, n, s: calls.append(n)
    )
    assert calls == [3, 50]
    assert [s.measured_bytes for s in sizes] == [s.formula_bytes for s in sizes]
    assert state_sizes(load_model_config("tiny"), [5], measure=False)[0].measured_bytes is None


@pytest.mark.parametrize("name", tuple(HAND))
def test_parameter_count_matches_init_params(name):
    cfg, params = _abstract(name)
    leaves = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    assert count_params(cfg).total == leaves


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("kimi-linear-48b", 48e9),
        ("qwen3-next-80b", 80e9),
        ("qwen3.5-397b", 397e9),
        ("mimo-v2-flash", 309e9),
        ("ring-2.5-1t", 1e12),
        ("minimax-m2.5", 229e9),
        ("qwen3-235b", 235e9),
        ("deepseek-v3", 671e9),
        ("prfaas-1t", 1e12),
    ],
)
def test_presets_have_their_published_size(name, published):
    assert count_params(load_model_config(name)).total == pytest.approx(published, rel=0.04)


def test_prefill_flops_by_hand():
    cfg = load_model_config("qwen3-235b")  # dense GQA only: projections + attention + LM head
    length = 1000
    attention = 94 * 2 * 64 * (128 + 128) * (length * (length + 1) // 2)
    head = 2 * 4096 * 151936
    assert prefill_flops(cfg, length) == 2 * count_params(cfg).active * length + attention + head
    assert attention_pairs(5, 3) == 1 + 2 + 3 + 3 + 3
    assert attention_pairs(3, 8) == 6
    parts = prefill_flops_by_part(cfg, length)
    assert parts.head == head
    assert parts.mixers == (parts.mixers[0],) * 94  # every layer has the same GQA mixer
    q_kv_o = 4096 * (64 * 128 + 2 * 4 * 128) + 64 * 128 * 4096
    assert parts.cores == (attention // 94,) * 94
    assert parts.mixers[0] == 2 * q_kv_o * length + attention // 94


@pytest.mark.parametrize("name", ["kimi-linear-48b", "qwen3-next-80b", "mimo-v2-flash", "tiny"])
@pytest.mark.parametrize("length", [1, 1000, 131072])
def test_prefill_flops_by_part_add_up(name, length):
    cfg = load_model_config(name)
    parts = prefill_flops_by_part(cfg, length)
    assert len(parts.mixers) == len(parts.cores) == len(parts.mlps) == cfg.num_layers
    assert all(0 < core < mixer for core, mixer in zip(parts.cores, parts.mixers, strict=True))
    assert parts.total == prefill_flops(cfg, length)


def test_prfaas_1t_is_within_2_percent_of_table5():
    """The preset lands within 1.8 % of every row (1.8 % at 32K, 0.8 % at 128K, 1e-4 below)."""
    cfg = load_model_config("prfaas-1t")
    for row in TABLE5:
        ours = formula_size(cfg, row.length).formula_bytes / MIB
        assert ours == pytest.approx(row.kv_mib, rel=0.02), row.length


def test_eq1_units_match_the_tables():
    assert kv_gbps(701.3 * MIB, 1.84) == pytest.approx(3.197, abs=1e-3)


@pytest.mark.parametrize("figure", EGRESS_FIGURES, ids=lambda f: f.label)
def test_eq2_reproduces_the_egress_figures(figure):
    """A transcription check of Eq. 2 against the paper's own figures (instances × Table 3's
    per-instance throughput): it tests the formula as written here, not the state sizes."""
    egress = cluster_egress_gbps(figure.num_gpus, figure.gpus_per_instance, figure.paper_kv_gbps())
    if figure.upper_bound:
        assert egress < figure.paper_gbps
    else:
        assert egress == pytest.approx(figure.paper_gbps, rel=0.05)


def test_hardware_profiles_and_estimates():
    hardware = load_hardware("h200x8")
    cfg = load_model_config("prfaas-1t")
    for row in TABLE5:
        got = hardware.prefill_time(cfg, row.length)
        assert (got.seconds, got.source) == (row.prefill_s, "measured")
    assert hardware.prefill_time(cfg, 4096).source == "interpolated"
    assert hardware.prefill_time(cfg, 262144).source == "extrapolated"
    estimate = hardware.prefill_time(cfg, 32768, estimate=True)
    assert estimate.source == "estimate"
    assert estimate.seconds == pytest.approx(1.84, rel=0.1)  # calibrated on Table 5
    other = hardware.prefill_time(load_model_config("deepseek-v3"), 1024)
    assert other.source == "estimate" and other.seconds > hardware.overhead_s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\nnum_gpus = 8\n', "missing key"),
        ("bogus = 1\n", "unknown key"),
        (
            'name = "x"\nnum_gpus = 8\npeak_tflops = 1.0\nefficiency = 2.0\noverhead_s = 0.1\n'
            "prefill_profiles = []\n",
            "efficiency",
        ),
    ],
)
def test_bad_hardware_files_are_config_errors(tmp_path, text, message):
    path = tmp_path / "hw.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_hardware(path)


# --- the command ----------------------------------------------------------------------------

ROW_KEYS = {
    "length",
    "formula_bytes",
    "measured_bytes",
    "serialized_bytes",
    "growing_bytes",
    "fixed_bytes",
    "prefill_seconds",
    "prefill_source",
    "kv_gbps",
}


def _json(capsys, *argv: str) -> dict:
    assert main(["kv", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_kv_json_for_one_model(capsys):
    out = _json(capsys, "--model", "kimi-linear-48b", "--lengths", "1K,128K")
    assert set(out) >= {"model", "rows"} and out["model"] == "kimi-linear-48b"
    assert [row["length"] for row in out["rows"]] == [1024, 131072]
    for row in out["rows"]:
        assert set(row) >= ROW_KEYS
        assert row["measured_bytes"] == row["formula_bytes"] == row["serialized_bytes"]
        assert row["formula_bytes"] == HAND["kimi-linear-48b"].at(row["length"])
        assert row["prefill_source"] == "estimate"
        expected = row["formula_bytes"] * 8 / row["prefill_seconds"] / 1e9
        assert row["kv_gbps"] == pytest.approx(expected)


@pytest.mark.parametrize("wire", ["bf16", "int8", "state=fp8_e4m3,latent=int8"])
def test_kv_wire_is_what_the_codec_header_carries(capsys, wire):
    out = _json(
        capsys, "--model", "kimi-linear-48b", "--lengths", "1K,32K", "--no-measure", "--wire", wire
    )
    assert out["wire_precision"] == str(WirePrecision.parse(wire))
    cfg = load_model_config("kimi-linear-48b")
    for row in out["rows"]:
        encoder = codec.StreamEncoder(cfg, row["length"], precision=WirePrecision.parse(wire))
        assert row["wire_bytes"] == encoder.state_header.payload_nbytes < row["formula_bytes"]
        expected = row["wire_bytes"] * 8 / row["prefill_seconds"] / 1e9
        assert row["wire_kv_gbps"] == pytest.approx(expected)


def test_kv_uses_the_measured_profile(capsys):
    out = _json(capsys, "--model", "prfaas-1t", "--lengths", "32K", "--no-measure")
    (row,) = out["rows"]
    assert (row["prefill_seconds"], row["prefill_source"]) == (1.84, "measured")
    assert row["measured_bytes"] is None


def test_kv_compare_ratios(capsys):
    out = _json(
        capsys, "--compare", "minimax-m2.5,mimo-v2-flash", "--lengths", "32K", "--no-measure"
    )
    first, second = out["models"]
    assert first["rows"][0]["bytes_ratio"] == 1.0
    ratio = HAND["mimo-v2-flash"].at(32768) / HAND["minimax-m2.5"].at(32768)
    assert second["rows"][0]["bytes_ratio"] == pytest.approx(ratio)


PAGED_PRESETS = "kimi-linear-48b,qwen3.5-397b,ring-2.5-1t,mimo-v2-flash,prfaas-1t"


def test_kv_paged_for_the_real_presets(capsys):
    """Pages never hold less than the canonical state, and the rounding fades with length: a
    request's waste is under one page per layer (two per SWA ring: the ring's slack block)."""
    argv = ["--compare", PAGED_PRESETS, "--lengths", "1K,128K", "--no-measure"]
    out = _json(capsys, *argv, "--allocator", "paged", "--block-size", "16")
    for model in out["models"]:
        cfg, paged = load_model_config(model["model"]), model["paged"]
        # The page holds 16 tokens and the largest linear state, padded by under one token.
        linear = max(layer_fixed_nbytes(cfg, kind) for kind in cfg.layers)
        per_token = paged["page_bytes"] // paged["tokens_per_page"]
        assert paged["tokens_per_page"] >= 16 and paged["page_bytes"] >= linear
        assert paged["tokens_per_page"] == 16 or paged["page_bytes"] - linear < per_token
        slack = sum(2 if kind.value == "swa" else 1 for kind in cfg.layers)
        for row in paged["rows"]:
            assert row["pages"] * paged["page_bytes"] == row["paged_bytes"]
            waste = row["paged_bytes"] - row["formula_bytes"]
            assert 0 <= waste < slack * paged["page_bytes"], model["model"]
    assert main(["kv", *argv, "--allocator", "paged"]) == 0
    assert "paged allocator: prfaas-1t, block size 16" in capsys.readouterr().out


def test_kv_paper(capsys):
    out = _json(capsys, "--paper")
    assert all(abs(row["kv_mib_error"]) < 0.02 for row in out["table5"])
    assert all(row["reproduced"] for row in out["egress"])
    assert {row["model"] for row in out["table3"]} == set(REAL) - {"qwen3-next-80b", "deepseek-v3"}
    assert main(["kv", "--paper"]) == 0
    assert "reproduces 5 of 5 figures" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "tiny", "--lengths", "1K,abc"],
        ["--model", "tiny", "--lengths", "0"],
        ["--model", "tiny", "--lengths", "1.5K"],
        ["--model", "tiny", "--lengths", ""],
        ["--paper", "--lengths", "1K"],
        ["--compare", "tiny"],
        ["--model", "no-such-model"],
        ["--model", "tiny", "--hardware", "no-such-hardware"],
        ["--model", "tiny", "--wire", "int4"],
        ["--model", "tiny", "--wire", "state=int8,weights=bf16"],
        ["--paper", "--allocator", "paged"],
        ["--model", "tiny", "--allocator", "paged", "--block-size", "0"],
    ],
)
def test_kv_user_errors_are_one_line_and_exit_2(capsys, argv):
    assert main(["kv", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("prfaas kv: error:")
