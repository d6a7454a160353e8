"""One block's mixer and MLP as functions of their own inputs, so a profile can compile and time
each apart from the rest of a step (bench/decode_profile.py, bench/prefill_profile.py)."""

from __future__ import annotations

import jax

from prfaas_jax.config import ModelConfig
from prfaas_jax.model.hybrid import bind
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.norms import rms_norm


def mixer_part(cfg: ModelConfig, params, h, layer_state, ctx: StepContext, index: int):
    """RMSNorm + layer ``index``'s mixer on ``h``: ``(output, new layer state)``."""
    block = bind(cfg, params).layers[index]
    return block.mixer(rms_norm(h, block.mixer_norm[...], cfg.norm_eps), layer_state, ctx)


def mlp_part(cfg: ModelConfig, params, h, index: int) -> jax.Array:
    """RMSNorm + layer ``index``'s MLP (SwiGLU or MoE) on ``h``."""
    block = bind(cfg, params).layers[index]
    return block.mlp(rms_norm(h, block.mlp_norm[...], cfg.norm_eps))
