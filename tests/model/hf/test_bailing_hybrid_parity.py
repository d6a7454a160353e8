"""Bailing hybrid checkpoints (KDA with the bounded gate + gated MLA with interleaved RoPE,
group-limited sigmoid MoE) match transformers token for token.

Cases: the fixture default (KDA/MLA alternating, two expert groups, one shared expert); q-LoRA
MLA with two wide heads, the unbounded softplus gate, four groups choosing two, top-3 and two
shared experts; an attention-first 1:2 pattern with top-1 routing, no shared expert and a prompt
longer than one 64-token chunk.
"""

from __future__ import annotations

from hf_parity import FamilyParity, case

from prfaas_jax.config import KdaGate, LayerKind


class TestBailingHybrid(FamilyParity):
    family = "bailing_hybrid"
    cases = (
        case(
            "qlora-softplus-top3",
            dict(seed=1, num_layers=3, full_attn_layers=(2,), first_k_dense=0),
            dict(num_heads=2, q_lora_rank=12, kv_lora_rank=24, v_head_dim=12),
            dict(qk_rope_head_dim=4),
            dict(linear_head_dim=24, kda_safe_gate=False),
            dict(n_group=4, topk_group=2, top_k=3, num_shared_experts=2),
        ),
        case(
            "top1-long",
            dict(seed=2, num_layers=3, full_attn_layers=(0,)),
            dict(n_group=1, top_k=1, num_shared_experts=0),
            prompt_len=70,
        ),
    )

    def check_config(self, cfg, case):
        assert set(cfg.layers) == {LayerKind.KDA, LayerKind.MLA} and cfg.mla.use_output_gate
        safe = case.knobs.get("kda_safe_gate", True)
        assert cfg.linear.kda_gate is (KdaGate.SAFE if safe else KdaGate.SOFTPLUS)
