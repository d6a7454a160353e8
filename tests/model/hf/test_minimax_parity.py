"""MiniMax-01 checkpoints (Lightning + GQA, scaled residuals on the normed input, Mixtral MoE)
match transformers token for token.

Cases: the fixture default (attention at layers 0 and 2, residual factors 1.3/0.9/1.1/0.8/1.2/0.7,
top-2 of 4 experts, 16-token Lightning blocks); six heads — not a power of two, where transformers'
slopes differ from ALiBi's — with a sliding window on the softmax layers, top-3 of 6 experts and a
1:2 pattern; top-1 routing over a 70-token prompt with one wide head pair. The CLI test runs the
orbax checkpoint through `--checkpoint OUT`.

With a sliding window, transformers' *cached* MiniMax generation is wrong: from the first decode
step its logits differ from its own no-cache forward over the same tokens by ~20 (the window
mask does not line up with MiniMax's cache). That case's reference therefore decodes greedily
with one no-cache forward per token.
"""

from __future__ import annotations

from hf_parity import FamilyParity, case

from prfaas_jax.config import LayerKind, LightningDecay


class TestMiniMax(FamilyParity):
    family = "minimax"
    cli_weights = "--checkpoint"
    cases = (
        case(
            "six-heads-swa",
            dict(seed=1, num_layers=3, full_attn_layers=(1,), hidden_size=48),
            dict(residual_factors=(0.8, 1.2, 1.4, 0.6, 0.9, 1.1)),
            dict(num_heads=6, num_kv_heads=3, head_dim=8, sliding_window=6),
            dict(block_size=8),
            dict(num_experts=6, top_k=3),
            hf_cache=False,  # transformers' cached decode is wrong with a window (see above)
        ),
        case(
            "top1-long",
            dict(seed=2, num_layers=3, full_attn_layers=(2,)),
            dict(num_heads=2, num_kv_heads=1, head_dim=32),
            dict(block_size=32),
            dict(num_experts=3, top_k=1),
            prompt_len=70,
        ),
    )

    def check_config(self, cfg, case):
        assert LayerKind.LIGHTNING in cfg.layers
        assert cfg.linear.lightning_decay is LightningDecay.MINIMAX_HF and cfg.residual is not None
