"""Qwen3-Next checkpoints (Gated DeltaNet + gated GQA, zero-centred norms, softmax MoE with a
sigmoid-gated shared expert) match transformers token for token.

Cases: the fixture default (GDN ×3 + attention, grouped value heads 2→4, first block dense);
equal key/value head counts, top-3 routing without renormalisation, half-rotary attention on a
1:2 pattern and a narrow shared expert; three value heads per key head, top-1 routing and a prompt
longer than one 64-token chunk.
"""

from __future__ import annotations

from hf_parity import FamilyParity, case

from prfaas_jax.config import LayerKind


class TestQwen3Next(FamilyParity):
    family = "qwen3_next"
    cases = (
        case(
            "equal-heads-top3",
            dict(seed=1, num_layers=3, full_attn_layers=(1,), mlp_only_layers=()),
            dict(num_heads=2, num_kv_heads=1, head_dim=16, partial_rotary_factor=0.5),
            dict(linear_num_key_heads=2, linear_num_value_heads=2),
            dict(linear_key_head_dim=12, linear_value_head_dim=8),
            dict(top_k=3, norm_topk_prob=False, shared_expert_intermediate_size=24),
        ),
        case(
            "gva3-top1-long",
            dict(seed=2, num_layers=3, full_attn_layers=(2,)),
            dict(linear_num_key_heads=1, linear_num_value_heads=3),
            dict(num_experts=4, top_k=1),
            prompt_len=70,
        ),
    )

    def check_config(self, cfg, case):
        assert set(cfg.layers) == {LayerKind.GDN, LayerKind.GQA} and cfg.moe.use_shared_gate
