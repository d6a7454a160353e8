"""Counted parameters and prefill FLOPs of a model config: `count_params`, `prefill_flops` (and
`prefill_flops_by_part`, the same count per layer's mixer and MLP and the LM head).

Pure Python over `ModelConfig` (no JAX), so the planner and `prfaas kv` can estimate T_prefill for
any preset without building it. For one sequence of L tokens (batch 1):

    FLOPs(L) = 2·P_active·L                        every projection a token passes through
             + 2·D·V                               the LM head, for the last position only
             + Σ_attention 2·H·(d_qk + d_v)·pairs(L)     causal softmax attention
             + Σ_linear    L·H_v·(2·C·(a·d_k + b·d_v) + c·d_k·d_v)   chunked linear attention
             + Σ_conv      2·kernel·channels·L     depthwise short convolutions

- P_active counts matmul weights only: mixer projections, the dense SwiGLU or the router, the
  ``top_k`` routed and the shared experts of an MoE (the MoE "active parameters"). Embedding
  lookups and norms are not matmuls.
- pairs(L) = L(L+1)/2 for full attention (GQA, and MLA decompressed to per-head K and V as in
  prefill), Σ_i min(i, W) for a window W.
- A chunk of C = 64 tokens of a delta-rule layer (KDA, GDN) costs, per value head, the key-key and
  query-key matrices, the WY factors W = T·K and U = T·V, the corrected values U − W·S, the output
  Q·S + A·V and the state update: a = 3, b = 2, c = 6 per token. Lightning (no delta rule) has only
  Q·Kᵀ, A·V, Q·S and the update: a = b = 1, c = 4.

`count_params(cfg).total` is checked against the leaves of `init_params` in the tests, so the two
cannot drift apart silently.

`flop_profile(cfg)` is the same count as a piecewise polynomial in L (a knot at an SWA window,
where Σ min(i, W) turns linear), and `scale_profile(profile, base, layout)` carries a measured
T_prefill profile of one layout over to another: coefficient k ≥ 1 of the profile is multiplied by
the ratio of the two layouts' FLOP coefficients of L^k (k = 1: projections, linear attention,
convolutions; k = 2: softmax attention), the constant (per-request overhead) is kept. This is the
two-term calibration of the case study's H20 profile (docs/planning.md) read the other way: the
linear and the quadratic part of a profile scale separately. Equal layouts give the profile back
exactly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from prfaas_jax.config import LayerKind, MlpKind, ModelConfig
from prfaas_jax.policy.profiles import Profile

CHUNK_LEN = 64  # the chunk size of the chunked linear-attention ops
_LINEAR_TERMS = {  # (a, b, c) of the module docstring
    LayerKind.KDA: (3, 2, 6),
    LayerKind.GDN: (3, 2, 6),
    LayerKind.LIGHTNING: (1, 1, 4),
}


@dataclass(frozen=True)
class ParamCount:
    total: int  # every parameter of the model
    active: int  # matmul weights one token passes through (LM head excluded)
    embedding: int  # the embedding table (and an untied LM head)


def _mixer_params(cfg: ModelConfig, kind: LayerKind) -> tuple[int, int]:
    """(matmul weights, other parameters) of one mixer of ``kind``."""
    dim = cfg.hidden_dim
    if kind in (LayerKind.KDA, LayerKind.GDN):
        lin = cfg.linear
        qk, v = lin.num_heads * lin.head_dim, lin.num_v_heads * lin.v_head_dim
        matmul = dim * (2 * qk + v) + dim * lin.num_v_heads + v * dim  # q, k, v, beta, o
        if kind is LayerKind.KDA:
            gate_width = lin.num_v_heads * lin.head_dim
            if lin.full_rank_gates:
                matmul += dim * (gate_width + v)
            else:
                matmul += 2 * dim * lin.low_rank + lin.low_rank * (gate_width + v)
        else:
            gate_width = lin.num_v_heads
            matmul += dim * lin.num_v_heads + dim * v  # a (decay) and z (output gate)
        other = lin.conv_kernel * lin.conv_channels + lin.num_v_heads + lin.v_head_dim
        return matmul, other + gate_width
    if kind is LayerKind.LIGHTNING:
        lin = cfg.linear
        v = lin.num_heads * lin.v_head_dim
        qkv = dim * lin.num_heads * (2 * lin.head_dim + lin.v_head_dim)
        return qkv + 2 * dim * v, v
    if kind is LayerKind.MLA:
        mla = cfg.mla
        q_out = mla.num_heads * mla.qk_head_dim
        if mla.q_lora_rank:
            q, other = dim * mla.q_lora_rank + mla.q_lora_rank * q_out, mla.q_lora_rank
        else:
            q, other = dim * q_out, 0
        kv_a = dim * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        kv_b = mla.kv_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        out = mla.num_heads * mla.v_head_dim * dim
        gate = dim * mla.num_heads if mla.use_output_gate else 0
        return q + kv_a + kv_b + out + gate, other + mla.kv_lora_rank
    att = cfg.attention if kind is LayerKind.GQA else cfg.swa
    q, o = att.num_heads * att.head_dim, att.num_heads * att.value_dim
    kv = att.num_kv_heads * (att.head_dim + att.value_dim)
    matmul = dim * (q + kv) + o * dim + (dim * o if att.use_output_gate else 0)
    other = (2 * att.head_dim if att.use_qk_norm else 0) + (att.num_heads if att.use_sinks else 0)
    return matmul, other


def _mlp_params(cfg: ModelConfig, kind: MlpKind) -> tuple[int, int, int]:
    """(all matmul weights, active matmul weights, other parameters) of one MLP."""
    dim = cfg.hidden_dim
    if kind is MlpKind.DENSE:
        weights = 3 * dim * cfg.mlp_dim
        return weights, weights, 0
    moe = cfg.moe
    expert = 3 * dim * moe.expert_dim
    shared = 3 * dim * moe.shared_width + (dim if moe.use_shared_gate else 0)
    router = dim * moe.num_experts
    total = router + moe.num_experts * expert + shared
    active = router + moe.top_k * expert + shared
    return total, active, moe.num_experts if moe.use_score_bias else 0


def count_params(cfg: ModelConfig) -> ParamCount:
    """Total parameters, active matmul weights per token, and embedding parameters."""
    dim = cfg.hidden_dim
    embedding = cfg.vocab_size * dim * (1 if cfg.tie_embeddings else 2)
    total, active = embedding + dim, 0  # + the final norm
    for kind, mlp_kind in zip(cfg.layers, cfg.mlps, strict=True):
        mixer, mixer_other = _mixer_params(cfg, kind)
        mlp, mlp_active, mlp_other = _mlp_params(cfg, mlp_kind)
        total += mixer + mixer_other + mlp + mlp_other + 2 * dim  # + the two block norms
        active += mixer + mlp_active
    return ParamCount(total=total, active=active, embedding=embedding)


def attention_pairs(length: int, window: int = 0) -> int:
    """Causal (query, key) pairs of a sequence: all of them, or those within ``window``."""
    if not window or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def _layer_flops(cfg: ModelConfig, kind: LayerKind, length: int) -> int:
    """FLOPs of one mixer beyond its projections: attention, or the linear-attention state."""
    if kind is LayerKind.MLA:
        mla = cfg.mla
        return 2 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim) * attention_pairs(length)
    if kind in (LayerKind.GQA, LayerKind.SWA):
        att = cfg.attention if kind is LayerKind.GQA else cfg.swa
        pairs = attention_pairs(length, att.window if kind is LayerKind.SWA else 0)
        return 2 * att.num_heads * (att.head_dim + att.value_dim) * pairs
    lin = cfg.linear
    a, b, c = _LINEAR_TERMS[kind]
    heads = lin.num_heads if kind is LayerKind.LIGHTNING else lin.num_v_heads
    d_k, d_v = lin.head_dim, lin.v_head_dim
    per_token = heads * (2 * CHUNK_LEN * (a * d_k + b * d_v) + c * d_k * d_v)
    if kind is not LayerKind.LIGHTNING:
        per_token += 2 * lin.conv_kernel * lin.conv_channels
    return per_token * length


@dataclass(frozen=True)
class PrefillFlops:
    """`prefill_flops` by part: per layer its mixer (projections and attention or linear
    state) and its MLP (active weights only), and the LM head at the last position.
    ``cores[i]`` is the part of ``mixers[i]`` beyond the projections: softmax attention, or
    the linear-attention state and the short convolutions."""

    mixers: tuple[int, ...]
    cores: tuple[int, ...]
    mlps: tuple[int, ...]
    head: int

    @property
    def total(self) -> int:
        return sum(self.mixers) + sum(self.mlps) + self.head


def prefill_flops_by_part(cfg: ModelConfig, length: int) -> PrefillFlops:
    """Counted FLOPs of prefilling one sequence of ``length`` tokens, part by part."""
    if length < 1:
        raise ValueError(f"length must be ≥ 1, got {length}")
    cores = tuple(_layer_flops(cfg, kind, length) for kind in cfg.layers)
    mixers = tuple(
        2 * _mixer_params(cfg, kind)[0] * length + core
        for kind, core in zip(cfg.layers, cores, strict=True)
    )
    mlps = tuple(2 * _mlp_params(cfg, kind)[1] * length for kind in cfg.mlps)
    head = 2 * cfg.hidden_dim * cfg.vocab_size
    return PrefillFlops(mixers=mixers, cores=cores, mlps=mlps, head=head)


def prefill_flops(cfg: ModelConfig, length: int) -> int:
    """Counted FLOPs of prefilling one sequence of ``length`` tokens (module docstring)."""
    if length < 1:
        raise ValueError(f"length must be ≥ 1, got {length}")
    projections = 2 * count_params(cfg).active * length + 2 * cfg.hidden_dim * cfg.vocab_size
    return projections + sum(_layer_flops(cfg, kind, length) for kind in cfg.layers)


def _attention_pair_pieces(window: int) -> list[tuple[float, tuple[float, ...]]]:
    """pairs(L) as (upper end, coefficients) pieces: L²/2 + L/2, then W·L − W(W−1)/2 past W."""
    full = (0.0, 0.5, 0.5)
    if not window:
        return [(math.inf, full)]
    return [(float(window), full), (math.inf, (-window * (window - 1) / 2, float(window), 0.0))]


def flop_profile(cfg: ModelConfig) -> Profile:
    """`prefill_flops(cfg, L)` as a piecewise polynomial in L (exact at every integer L ≥ 1)."""
    windows = sorted({cfg.swa.window} if LayerKind.SWA in cfg.layers and cfg.swa else set())
    knots = tuple(float(w) for w in windows)
    pieces = [[0.0, 0.0, 0.0] for _ in range(len(knots) + 1)]
    for piece in pieces:
        piece[0] += 2 * cfg.hidden_dim * cfg.vocab_size
        piece[1] += 2 * count_params(cfg).active
    for kind in cfg.layers:
        if kind.is_linear:
            for piece in pieces:
                piece[1] += _layer_flops(cfg, kind, 1)
            continue
        if kind is LayerKind.MLA:
            mla = cfg.mla
            width, window = 2 * mla.num_heads * (mla.qk_head_dim + mla.v_head_dim), 0
        else:
            att = cfg.attention if kind is LayerKind.GQA else cfg.swa
            width = 2 * att.num_heads * (att.head_dim + att.value_dim)
            window = att.window if kind is LayerKind.SWA else 0
        for index, piece in enumerate(pieces):
            upper = knots[index] if index < len(knots) else math.inf
            coeffs = next(c for end, c in _attention_pair_pieces(window) if upper <= end)
            for k, c in enumerate(coeffs):
                piece[k] += width * c
    return Profile(knots=knots, coeffs=tuple(tuple(piece) for piece in pieces))


def _piece_at(profile: Profile, lo: float, hi: float) -> tuple[float, ...]:
    """The coefficients of ``profile`` on (lo, hi], which lies inside one of its pieces."""
    return next(coeffs for _, _, coeffs in profile.pieces(lo, hi))


def scale_profile(profile: Profile, base: ModelConfig, layout: ModelConfig) -> Profile:
    """``profile`` (T_prefill of ``base``) carried over to ``layout`` term by term (module
    docstring). Raises ``ValueError`` when ``layout`` has FLOPs of an order ``base`` lacks (an
    attention-free base says nothing about what attention costs)."""
    base_flops, layout_flops = flop_profile(base), flop_profile(layout)
    knots = tuple(sorted({*profile.knots, *base_flops.knots, *layout_flops.knots}))
    edges = (-math.inf, *knots, math.inf)
    pieces = []
    for lo, hi in itertools.pairwise(edges):
        coeffs = list(_piece_at(profile, lo, hi))
        base_c, layout_c = _piece_at(base_flops, lo, hi), _piece_at(layout_flops, lo, hi)
        for k in range(1, max(len(coeffs), len(layout_c))):
            have = base_c[k] if k < len(base_c) else 0.0
            want = layout_c[k] if k < len(layout_c) else 0.0
            if want == have:
                continue
            if not have:
                raise ValueError(
                    f"{base.name} has no FLOPs of order L^{k}, so its T_prefill profile cannot be "
                    f"carried over to a layout that has them ({layout.name})"
                )
            if k >= len(coeffs):
                coeffs.append(0.0)
            coeffs[k] *= want / have
        pieces.append(tuple(coeffs))
    return Profile(knots=knots, coeffs=tuple(pieces))
