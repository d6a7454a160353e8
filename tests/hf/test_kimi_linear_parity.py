"""Kimi Linear checkpoints (KDA + NoPE MLA + sigmoid MoE) match transformers token for token.

Cases: the fixture default (KDA/MLA alternating, dense first block, top-2 of 8 experts + one
shared); q-LoRA MLA with fewer, wider heads, group-limited routing, top-3 and two shared experts;
an attention-first 1:2 pattern with top-1 routing, no shared expert, a 3-tap conv and a prompt
longer than one 64-token chunk.
"""

from __future__ import annotations

import pytest
from hf_parity import case_reference, check_convert, check_import, cli_generate

from prfaas_jax.config import LayerKind

FAMILY = "kimi_linear"
CASES = {
    "default": {},
    "qlora-grouped": dict(
        seed=1,
        num_layers=3,
        full_attn_layers=(2,),
        first_k_dense=0,
        num_heads=2,
        q_lora_rank=12,
        kv_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        linear_num_heads=2,
        linear_head_dim=24,
        n_group=2,
        topk_group=1,
        top_k=3,
        num_shared_experts=2,
    ),
    "top1-long": dict(
        seed=2,
        num_layers=3,
        full_attn_layers=(0,),
        hidden_size=48,
        conv_kernel=3,
        num_experts=6,
        top_k=1,
        num_shared_experts=0,
        prompt_len=70,
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return case_reference(FAMILY, request.param, CASES, tmp_path_factory)


def test_import_matches_transformers(case):
    cfg = check_import(case)
    assert set(cfg.layers) == {LayerKind.KDA, LayerKind.MLA}


def test_convert_hf_checkpoint_matches_transformers(capsys, tmp_path, tmp_path_factory):
    check_convert(capsys, tmp_path, case_reference(FAMILY, "default", CASES, tmp_path_factory))


def test_cli_generate_hf_matches_transformers(capsys, tmp_path, tmp_path_factory):
    ref = case_reference(FAMILY, "default", CASES, tmp_path_factory)
    cli_generate(capsys, tmp_path, ref, "--hf", str(ref.path))
