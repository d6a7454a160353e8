"""Kimi Linear checkpoints (KDA + NoPE MLA + sigmoid MoE) match transformers token for token.

Cases: the fixture default (KDA/MLA alternating, dense first block, top-2 of 8 experts + one
shared); q-LoRA MLA with fewer, wider heads, group-limited routing, top-3 and two shared experts;
an attention-first 1:2 pattern with top-1 routing, no shared expert, a 3-tap conv and a prompt
longer than one 64-token chunk.
"""

from __future__ import annotations

from hf_parity import FamilyParity, case

from prfaas_jax.config import LayerKind


class TestKimiLinear(FamilyParity):
    family = "kimi_linear"
    cases = (
        case(
            "qlora-grouped",
            dict(seed=1, num_layers=3, full_attn_layers=(2,), first_k_dense=0),
            dict(num_heads=2, q_lora_rank=12, kv_lora_rank=24, v_head_dim=12),
            dict(qk_nope_head_dim=8, qk_rope_head_dim=4),
            dict(linear_num_heads=2, linear_head_dim=24),
            dict(n_group=2, topk_group=1, top_k=3, num_shared_experts=2),
        ),
        case(
            "top1-long",
            dict(seed=2, num_layers=3, full_attn_layers=(0,), hidden_size=48),
            dict(conv_kernel=3),
            dict(num_experts=6, top_k=1, num_shared_experts=0),
            prompt_len=70,
        ),
    )

    def check_config(self, cfg, case):
        assert set(cfg.layers) == {LayerKind.KDA, LayerKind.MLA}
