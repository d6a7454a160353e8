"""What the step profiles share (bench/decode_profile.py, bench/prefill_profile.py): one block's
mixer and MLP as functions of their own inputs, so each compiles and times apart from the rest
of a step, the table of parts against their bounds, and bench/engine.py's model."""

from __future__ import annotations

import contextlib
import sys
import tempfile

import jax

from prfaas_jax.config import ModelConfig
from prfaas_jax.model.hf import load_hf
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


def bench_model():
    """``(cfg, params)`` of bench/engine.py's random Kimi-Linear checkpoint (``PRESET``),
    written by the tests' builder and loaded by ``load_hf``."""
    import hf_fixtures  # tests/model/hf, on the path the scripts set
    from engine import PRESET  # bench/ is the scripts' own directory

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        return load_hf(hf_fixtures.make_tiny_kimi_linear(tmp, **PRESET), name="bench")
