"""What one decode step must read and compute: `decode_step_bytes`, `decode_step_flops`.

Pure Python over `ModelConfig`, like prefill_cost.py, for roofline reports (bench/engine.py):
a step of B rows, each with ``context`` tokens already in its state, at its lower bound of
memory traffic — every byte it needs read exactly once:

    bytes(B, ctx) = weights(B) + B · state_nbytes(ctx)

- weights(B): every parameter, in the model's dtype, except that the embedding table is read
  only at the B rows looked up (an untied LM head, or the tied table used as one, is read
  whole), and an MoE layer reads only the experts its B tokens route to: E·(1 − (1 − k/E)^B)
  of its E experts in expectation under uniform routing (k = ``top_k``; all of them once B is
  large, k of them at B = 1).
- the state: every row's KV caches at ``ctx`` tokens and its recurrent states and conv tails
  (state_bytes.py), read once to attend and update.

FLOPs: 2·P_active·B for the projections (prefill_cost.py's active parameters), 2·D·V·B for the
LM head, and attention over the context — 2·H·(d_qk + d_v)·ctx·B per softmax layer (MLA
decompressed; an SWA window caps ctx) — and 2·H·(2·d_k·d_v) per row for a linear layer's
recurrent update and readout. A step is byte-bound while its FLOPs per byte stay below the
machine's ridge point (peak FLOP/s over read bandwidth).
"""

from __future__ import annotations

from prfaas_jax.config import LayerKind, MlpKind, ModelConfig, dtype_nbytes
from prfaas_jax.planning.prefill_cost import count_params
from prfaas_jax.state_bytes import state_nbytes


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts that ``batch`` tokens route to, each to ``top_k`` of
    ``num_experts`` uniformly at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_weight_bytes(cfg: ModelConfig, batch: int) -> float:
    """weights(B) of the module docstring, in bytes."""
    if batch < 1:
        raise ValueError(f"batch must be ≥ 1, got {batch}")
    count = count_params(cfg)
    table = cfg.vocab_size * cfg.hidden_dim
    # Whole: everything but the table; the LM head (untied, or the tied table) once; B rows.
    params = count.total - table + batch * cfg.hidden_dim
    if cfg.tie_embeddings:
        params += table
    moe = cfg.moe
    if moe is not None:
        untouched = moe.num_experts - experts_touched(moe.num_experts, moe.top_k, batch)
        expert = 3 * cfg.hidden_dim * moe.expert_dim
        params -= sum(kind is MlpKind.MOE for kind in cfg.mlps) * untouched * expert
    return params * dtype_nbytes(cfg.dtype)


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int) -> float:
    """Bytes one decode step of ``batch`` rows at ``context`` tokens must read."""
    return decode_weight_bytes(cfg, batch) + batch * state_nbytes(cfg, context)


def decode_step_flops(cfg: ModelConfig, batch: int, context: int) -> int:
    """FLOPs of one decode step of ``batch`` rows at ``context`` tokens (module docstring)."""
    per_row = 2 * count_params(cfg).active + 2 * cfg.hidden_dim * cfg.vocab_size
    for kind in cfg.layers:
        if kind is LayerKind.MLA:
            mla = cfg.mla
            per_row += 2 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * context
        elif kind in (LayerKind.GQA, LayerKind.SWA):
            att = cfg.attention if kind is LayerKind.GQA else cfg.swa
            keys = min(context, att.window) if kind is LayerKind.SWA else context
            per_row += 2 * att.num_heads * (att.head_dim + att.value_dim) * keys
        else:
            lin = cfg.linear
            heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
            per_row += 2 * heads * 2 * lin.head_dim * lin.v_head_dim
    return per_row * batch
