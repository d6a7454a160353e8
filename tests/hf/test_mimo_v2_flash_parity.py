"""MiMo-V2-Flash checkpoints (SWA with sinks + full GQA, per-type partial RoPE, value scaling,
sigmoid MoE) match transformers token for token.

Cases: the fixture default (full attention at layers 0 and 3, one KV head on full layers and two
on SWA layers, window 8); six query heads over three/six KV heads with a window of 4, unscaled
values, group-limited top-3 routing and a routed scale; a 70-token prompt (far past the window)
with top-1 routing. The CLI case runs the orbax checkpoint through `--model OUT`.
"""

from __future__ import annotations

import pytest
from hf_parity import case_reference, check_convert, check_import, cli_generate

from prfaas_jax.config import LayerKind

FAMILY = "mimo_v2_flash"
CASES = {
    "default": {},
    "grouped-window4": dict(
        seed=1,
        num_layers=3,
        full_attn_layers=(1,),
        num_heads=6,
        num_kv_heads=3,
        head_dim=12,
        v_head_dim=8,
        sliding_window=4,
        attention_value_scale=1.0,
        n_group=2,
        topk_group=1,
        top_k=3,
        routed_scaling_factor=1.5,
    ),
    "top1-long": dict(
        seed=2,
        num_layers=3,
        full_attn_layers=(0,),
        first_k_dense=0,
        num_experts=4,
        top_k=1,
        prompt_len=70,
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return case_reference(FAMILY, request.param, CASES, tmp_path_factory)


def test_import_matches_transformers(case):
    cfg = check_import(case)
    assert set(cfg.layers) == {LayerKind.GQA, LayerKind.SWA} and cfg.swa.use_sinks


def test_cli_convert_then_generate_model_dir_matches_transformers(
    capsys, tmp_path, tmp_path_factory
):
    ref = case_reference(FAMILY, "default", CASES, tmp_path_factory)
    out = check_convert(capsys, tmp_path, ref)
    cli_generate(capsys, tmp_path, ref, "--model", str(out))
