"""Bailing hybrid checkpoints (KDA with the bounded gate + gated MLA with interleaved RoPE,
group-limited sigmoid MoE) match transformers token for token.

Cases: the fixture default (KDA/MLA alternating, two expert groups, one shared expert); q-LoRA
MLA with two wide heads, the unbounded softplus gate, four groups choosing two, top-3 and two
shared experts; an attention-first 1:2 pattern with top-1 routing, no shared expert and a prompt
longer than one 64-token chunk.
"""

from __future__ import annotations

import pytest
from hf_parity import case_reference, check_convert, check_import, cli_generate

from prfaas_jax.config import KdaGate, LayerKind

FAMILY = "bailing_hybrid"
CASES = {
    "default": {},
    "qlora-softplus-top3": dict(
        seed=1,
        num_layers=3,
        full_attn_layers=(2,),
        first_k_dense=0,
        num_heads=2,
        linear_head_dim=24,
        q_lora_rank=12,
        kv_lora_rank=24,
        qk_rope_head_dim=4,
        v_head_dim=12,
        kda_safe_gate=False,
        n_group=4,
        topk_group=2,
        top_k=3,
        num_shared_experts=2,
    ),
    "top1-long": dict(
        seed=2,
        num_layers=3,
        full_attn_layers=(0,),
        n_group=1,
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
    assert set(cfg.layers) == {LayerKind.KDA, LayerKind.MLA} and cfg.mla.use_output_gate
    assert cfg.linear.kda_gate is (
        KdaGate.SOFTPLUS if "softplus" in case.path.name else KdaGate.SAFE
    )


def test_convert_hf_checkpoint_matches_transformers(capsys, tmp_path, tmp_path_factory):
    check_convert(capsys, tmp_path, case_reference(FAMILY, "default", CASES, tmp_path_factory))


def test_cli_generate_hf_matches_transformers(capsys, tmp_path, tmp_path_factory):
    ref = case_reference(FAMILY, "default", CASES, tmp_path_factory)
    cli_generate(capsys, tmp_path, ref, "--hf", str(ref.path))
