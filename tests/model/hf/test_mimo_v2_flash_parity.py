"""MiMo-V2-Flash checkpoints (SWA with sinks + full GQA, per-type partial RoPE, value scaling,
sigmoid MoE) match transformers token for token.

Cases: the fixture default (full attention at layers 0 and 3, one KV head on full layers and two
on SWA layers, window 8); six query heads over three/six KV heads with a window of 4, unscaled
values, group-limited top-3 routing and a routed scale; a 70-token prompt (far past the window)
with top-1 routing. The CLI test runs the orbax checkpoint through `--model OUT`.
"""

from __future__ import annotations

from hf_parity import FamilyParity, case

from prfaas_jax.config import LayerKind


class TestMiMoV2Flash(FamilyParity):
    family = "mimo_v2_flash"
    cli_weights = "--model"
    cases = (
        case(
            "grouped-window4",
            dict(seed=1, num_layers=3, full_attn_layers=(1,)),
            dict(num_heads=6, num_kv_heads=3, head_dim=12, v_head_dim=8),
            dict(sliding_window=4, attention_value_scale=1.0),
            dict(n_group=2, topk_group=1, top_k=3, routed_scaling_factor=1.5),
        ),
        case(
            "top1-long",
            dict(seed=2, num_layers=3, full_attn_layers=(0,), first_k_dense=0),
            dict(num_experts=4, top_k=1),
            prompt_len=70,
        ),
    )

    def check_config(self, cfg, case):
        assert set(cfg.layers) == {LayerKind.GQA, LayerKind.SWA} and cfg.swa.use_sinks
