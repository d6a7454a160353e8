"""Qwen3-Next checkpoints (Gated DeltaNet + gated GQA, zero-centred norms, softmax MoE with a
sigmoid-gated shared expert) match transformers token for token.

Cases: the fixture default (GDN ×3 + attention, grouped value heads 2→4, first block dense);
equal key/value head counts, top-3 routing without renormalisation, half-rotary attention on a
1:2 pattern and a narrow shared expert; three value heads per key head, top-1 routing and a prompt
longer than one 64-token chunk.
"""

from __future__ import annotations

import pytest
from hf_parity import case_reference, check_convert, check_import, cli_generate

from prfaas_jax.config import LayerKind

FAMILY = "qwen3_next"
CASES = {
    "default": {},
    "equal-heads-top3": dict(
        seed=1,
        num_layers=3,
        full_attn_layers=(1,),
        mlp_only_layers=(),
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        partial_rotary_factor=0.5,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=12,
        linear_value_head_dim=8,
        top_k=3,
        norm_topk_prob=False,
        shared_expert_intermediate_size=24,
    ),
    "gva3-top1-long": dict(
        seed=2,
        num_layers=3,
        full_attn_layers=(2,),
        linear_num_key_heads=1,
        linear_num_value_heads=3,
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
    assert set(cfg.layers) == {LayerKind.GDN, LayerKind.GQA} and cfg.moe.use_shared_gate


def test_convert_hf_checkpoint_matches_transformers(capsys, tmp_path, tmp_path_factory):
    check_convert(capsys, tmp_path, case_reference(FAMILY, "default", CASES, tmp_path_factory))


def test_cli_generate_hf_matches_transformers(capsys, tmp_path, tmp_path_factory):
    ref = case_reference(FAMILY, "default", CASES, tmp_path_factory)
    cli_generate(capsys, tmp_path, ref, "--hf", str(ref.path))
