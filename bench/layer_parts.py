"""What the step profiles share (bench/decode_profile.py, bench/prefill_profile.py): one block's
mixer and MLP as functions of their own inputs, so each compiles and times apart from the rest
of a step, and the table of parts against their bounds."""

from __future__ import annotations

import jax

from prfaas_jax.config import ModelConfig
from prfaas_jax.model.hybrid import bind
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.norms import rms_norm
from prfaas_jax.tables import table


def mixer_part(cfg: ModelConfig, params, h, layer_state, ctx: StepContext, index: int):
    """RMSNorm + layer ``index``'s mixer on ``h``: ``(output, new layer state)``."""
    block = bind(cfg, params).layers[index]
    return block.mixer(rms_norm(h, block.mixer_norm[...], cfg.norm_eps), layer_state, ctx)


def mlp_part(cfg: ModelConfig, params, h, index: int) -> jax.Array:
    """RMSNorm + layer ``index``'s MLP (SwiGLU or MoE) on ``h``."""
    block = bind(cfg, params).layers[index]
    return block.mlp(rms_norm(h, block.mlp_norm[...], cfg.norm_eps))


def parts_table(rows: list[dict], *, work: str, scale: dict, headers: list[str]) -> str:
    """A profile's rows (``part``, ``us``, ``work`` and its ``bound_us``) as a table: time and
    bound in µs ÷ ``scale["time"]`` with ``scale["digits"]`` decimals, work ÷ ``scale["work"]``;
    a row marked ``in_sum: False`` ends in "·"."""
    time, digits, per = scale["time"], scale["digits"], scale["work"]
    body = [
        [
            r["part"] + ("" if r.get("in_sum", True) else "  ·"),
            f"{r['us'] / time:.{digits}f}",
            "" if r[work] is None else f"{r[work] / per:.{3 if per >= 1e9 else 2}f}",
            "" if r["bound_us"] is None else f"{r['bound_us'] / time:.{digits}f}",
            "" if r["bound_us"] is None else f"{r['bound_us'] / r['us']:.0%}",
        ]
        for r in rows
    ]
    return table(body, headers)
