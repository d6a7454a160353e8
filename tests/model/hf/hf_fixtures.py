"""Tiny random Hugging Face checkpoints and ``transformers``' side of the parity tests (CPU, fp32).

``make_tiny(family, dir, **knobs)`` (or ``make_tiny_<family>(dir, **knobs)``) builds a small
randomly initialised ``transformers`` model. Each family's function only maps its own knobs onto
its config class and names the parameters whose default init is a constant (norm weights,
score-correction biases, ``dt_bias``, sinks, ...); ``_save_tiny`` does the rest for every family:
it takes the knobs all five share (``seed``, ``hidden_size``, ``intermediate_size``,
``rms_norm_eps``, ``vocab_size``, ``init_std``, ``lm_head_scale``, ``save_original_format``; a
family's ``**shared``), perturbs those parameters so parity tests exercise them, scales ``lm_head``
so greedy choices are not near-ties, and writes ``config.json`` + ``model.safetensors`` with
``save_pretrained``.

Important: by default ``save_pretrained`` in transformers 5 *reverts* its load-time weight
conversions, so the saved safetensors use the ORIGINAL hub checkpoint layout, e.g.
  * Kimi: ``self_attn.{q,k,v}_conv1d``, ``self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}``,
    ``block_sparse_moe.experts.{e}.w1/w2/w3`` (dense layers too: ``block_sparse_moe.gate_proj``);
  * Bailing: ``model.word_embeddings``, ``layers.{i}.attention.*``, ``attention.dense`` (o_proj),
    ``attention.{q,k,v}_conv1d``, ``mlp.gate.expert_bias``, ``mlp.experts.{e}.gate_proj``;
  * Qwen3-Next / MiMo: per-expert ``mlp.experts.{e}.{gate,up,down}_proj``; MiMo
    ``self_attn.attention_sink_bias``;
  * MiniMax: ``block_sparse_moe.experts.{e}.w1/w2/w3`` and ``block_sparse_moe.gate``.
That is what a real checkpoint looks like, so it is the right input for an importer. Pass
``save_original_format=False`` to get the in-memory HF names instead (fused
``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I], one ``conv1d``).

Layer indices taken by these helpers are 0-based. Every checkpoint directory also gets a
``fixture_perturbed.txt`` listing the (in-memory) parameter names that were perturbed.

``hf_prefill_logits`` / ``hf_greedy_with_logits`` / ``hf_greedy_without_cache`` reload the
directory with ``AutoModelForCausalLM.from_pretrained`` on CPU in float32 (eager attention) and run
it. torch/transformers are imported lazily so importing this module does not require them.

The module is over 500 lines because it holds the five families' config mappings side by side:
their knobs differ, and keeping them together keeps the shared saving path in one place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FAMILIES = ("kimi_linear", "minimax", "qwen3_next", "mimo_v2_flash", "bailing_hybrid")

Rule = tuple[str, str, float]  # (parameter name substring, "add" | "set", scale)


# --------------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _layer_types(
    num_layers: int, special: Sequence[int], special_name: str, other: str
) -> list[str]:
    special = set(int(i) for i in special)
    bad = [i for i in special if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer indices {bad} out of range for num_layers={num_layers}")
    return [special_name if i in special else other for i in range(num_layers)]


def _first_dense(num_layers: int, first_k_dense: int) -> list[str]:
    return ["dense" if i < first_k_dense else "sparse" for i in range(num_layers)]


def _rope(theta: float, **extra: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **extra}


def _perturb_(model, seed: int, rules: Sequence[Rule]) -> list[str]:
    """Apply perturbation rules in place. Each rule is (name substring, mode, scale).

    mode "add": p += scale * N(0, 1)   (for ones-/zeros-initialised norms, biases, dt_bias ...)
    mode "set": p  = scale * N(0, 1)   (replace, e.g. sinks)
    Returns the list of parameter/buffer names that were touched.
    """
    torch = _torch()
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    touched = []
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    with torch.no_grad():
        for name, t in named.items():
            for sub, mode, scale in rules:
                if sub in name:
                    noise = (
                        torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype) * scale
                    )
                    if mode == "add":
                        t.add_(noise)
                    elif mode == "set":
                        t.copy_(noise)
                    else:  # pragma: no cover
                        raise ValueError(mode)
                    touched.append(name)
                    break
    return touched


def _save_tiny(
    config_cls_name: str,
    config: dict[str, Any],
    rules: Sequence[Rule],
    tmp_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    rms_norm_eps: float = 1e-5,
    vocab_size: int = 160,
    init_std: float = 0.2,
    lm_head_scale: float = 4.0,
    save_original_format: bool = True,
) -> Path:
    """Build ``transformers.<config_cls_name>(**config)``, plus the keys all five configs share,
    from ``seed``; perturb it by ``rules``, scale ``lm_head`` and save it to ``tmp_dir``."""
    torch = _torch()
    import transformers
    from transformers import AutoModelForCausalLM

    config_cls = getattr(transformers, config_cls_name)
    cfg = config_cls(
        **config,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        rms_norm_eps=rms_norm_eps,
        vocab_size=vocab_size,
        initializer_range=init_std,
        pad_token_id=None,  # Kimi's default 163839 is out of range (and zeroes its embedding row)
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    touched = _perturb_(model, seed, rules)
    with torch.no_grad():
        if lm_head_scale != 1.0:
            model.lm_head.weight.mul_(lm_head_scale)
    # make generation deterministic & never stop early
    gc = model.generation_config
    gc.do_sample = False
    gc.eos_token_id = None
    out = Path(tmp_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, save_original_format=save_original_format)
    (out / "fixture_perturbed.txt").write_text("\n".join(touched) + "\n")
    return out


# Rules shared by all families (names as in the in-memory HF model).
_NORM_ONES = [
    ("layernorm.weight", "add", 0.2),  # input_/post_attention_/kv_a_/q_a_layernorm (init ones)
    ("model.norm.weight", "add", 0.2),
]


# --------------------------------------------------------------------------------------------------
# KDA + MLA + DeepSeek-V3-style sigmoid MoE: what Kimi Linear and Bailing hybrid share
# --------------------------------------------------------------------------------------------------


def _save_kda_mla(
    config_cls_name: str,
    config: dict[str, Any],
    tmp_dir: str | Path,
    *,
    num_layers: int = 4,
    full_attn_layers: Sequence[int] = (1, 3),
    num_heads: int = 4,  # MLA heads (Bailing's KDA heads too)
    kv_lora_rank: int = 16,
    q_lora_rank: int | None = None,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 16,
    num_experts: int = 8,
    top_k: int = 2,
    num_shared_experts: int = 1,
    moe_intermediate_size: int = 32,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 2.446,
    **shared: Any,
) -> Path:
    """``_save_tiny`` of a KDA/MLA family: ``config`` plus the layer pattern, MLA and MoE keys."""
    config = dict(
        config,
        num_hidden_layers=num_layers,
        layer_types=_layer_types(
            num_layers, full_attn_layers, "full_attention", "linear_attention"
        ),
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        n_shared_experts=num_shared_experts,
        moe_intermediate_size=moe_intermediate_size,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
    )
    rules = [
        *_NORM_ONES,
        ("o_norm.weight", "add", 0.2),
        ("e_score_correction_bias", "add", 0.1),  # zeros by default: selection-only bias
    ]
    return _save_tiny(config_cls_name, config, rules, tmp_dir, **shared)


def make_tiny_kimi_linear(
    tmp_dir: str | Path,
    *,
    num_layers: int = 4,
    first_k_dense: int = 1,
    linear_num_heads: int = 4,
    linear_head_dim: int = 16,
    conv_kernel: int = 4,
    **knobs: Any,
) -> Path:
    """Kimi Linear (KDA + NoPE MLA). ``knobs``: ``_save_kda_mla``'s and ``_save_tiny``'s."""
    config = dict(
        linear_num_heads=linear_num_heads,
        linear_head_dim=linear_head_dim,
        linear_conv_kernel_dim=conv_kernel,
        mlp_layer_types=_first_dense(num_layers, first_k_dense),
    )
    return _save_kda_mla("KimiLinearConfig", config, tmp_dir, num_layers=num_layers, **knobs)


# --------------------------------------------------------------------------------------------------
# MiniMax-Text-01 (Lightning attention + GQA softmax attention + Mixtral-style MoE)
# --------------------------------------------------------------------------------------------------


_MINIMAX_RESIDUAL_FACTORS = (1.3, 0.9, 1.1, 0.8, 1.2, 0.7)


def make_tiny_minimax(
    tmp_dir: str | Path,
    *,
    num_layers: int = 4,
    full_attn_layers: Sequence[int] = (0, 2),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_experts: int = 4,
    top_k: int = 2,
    block_size: int = 16,  # lightning prefill block; < prompt length exercises inter-block
    sliding_window: int | None = None,
    rope_theta: float = 10_000.0,
    residual_factors: tuple[float, ...] = _MINIMAX_RESIDUAL_FACTORS,
    **shared: Any,
) -> Path:
    """residual_factors = (full_alpha, full_beta, linear_alpha, linear_beta, mlp_alpha, mlp_beta).

    They default to 1 in MiniMaxConfig (the released MiniMax-Text-01 reportedly uses alpha ~3.5566,
    beta 1). The fixture uses distinct non-unit values so a reimplementation must place them right:
    h = residual * alpha + sublayer_out * beta, where residual is the *normed* sublayer input.
    MiniMax's ``intermediate_size`` (a ``shared`` keyword) is the per-expert FFN size: it has no
    ``moe_intermediate_size``.
    """
    fa, fb, la, lb, ma, mb = residual_factors
    config = dict(
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        block_size=block_size,
        sliding_window=sliding_window,
        rope_parameters=_rope(rope_theta),
        layer_types=_layer_types(
            num_layers, full_attn_layers, "full_attention", "linear_attention"
        ),
        full_attn_alpha_factor=fa,
        full_attn_beta_factor=fb,
        linear_attn_alpha_factor=la,
        linear_attn_beta_factor=lb,
        mlp_alpha_factor=ma,
        mlp_beta_factor=mb,
    )
    rules = [*_NORM_ONES, ("self_attn.norm.weight", "add", 0.2)]  # lightning output RMSNorm
    return _save_tiny(
        "MiniMaxConfig", config, rules, tmp_dir, **{"intermediate_size": 32, **shared}
    )


# --------------------------------------------------------------------------------------------------
# Qwen3-Next (Gated DeltaNet + gated GQA attention + softmax MoE with gated shared expert)
# --------------------------------------------------------------------------------------------------


def make_tiny_qwen3_next(
    tmp_dir: str | Path,
    *,
    num_layers: int = 4,
    full_attn_layers: Sequence[int] = (3,),
    mlp_only_layers: Sequence[int] = (0,),
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    partial_rotary_factor: float = 0.25,
    rope_theta: float = 10_000.0,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 16,
    linear_value_head_dim: int = 16,
    conv_kernel: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    shared_expert_intermediate_size: int = 48,
    norm_topk_prob: bool = True,
    **shared: Any,
) -> Path:
    """``shared``: ``_save_tiny``'s knobs; ``rms_norm_eps`` is 1e-6 unless given."""
    config = dict(
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rope_parameters=_rope(rope_theta, partial_rotary_factor=partial_rotary_factor),
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=conv_kernel,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        layer_types=_layer_types(
            num_layers, full_attn_layers, "full_attention", "linear_attention"
        ),
    )
    rules = [
        # zero-centred (1 + w) RMSNorms: input/post_attention layernorm, final norm, q_norm, k_norm
        ("layernorm.weight", "add", 0.2),
        ("model.norm.weight", "add", 0.2),
        ("q_norm.weight", "add", 0.2),
        ("k_norm.weight", "add", 0.2),
        ("linear_attn.norm.weight", "add", 0.2),  # gated RMSNorm, plain w (init ones)
        ("dt_bias", "add", 1.0),  # init ones
    ]
    return _save_tiny("Qwen3NextConfig", config, rules, tmp_dir, **{"rms_norm_eps": 1e-6, **shared})


# --------------------------------------------------------------------------------------------------
# MiMo-V2-Flash (SWA+sinks / full GQA attention, partial RoPE, sigmoid MoE, no shared expert)
# --------------------------------------------------------------------------------------------------


def make_tiny_mimo_v2_flash(
    tmp_dir: str | Path,
    *,
    num_layers: int = 4,
    full_attn_layers: Sequence[int] = (0, 3),
    first_k_dense: int = 1,
    num_heads: int = 4,
    num_kv_heads: int = 1,
    head_dim: int = 24,  # int(24 * 0.334) = 8 rotary dims
    v_head_dim: int = 16,
    sliding_window: int = 8,  # HF semantics: query i sees keys i-W+1 .. i (W keys incl. itself)
    partial_rotary_factor: float = 0.334,
    full_rope_theta: float = 5_000_000.0,
    swa_rope_theta: float = 10_000.0,
    attention_value_scale: float = 0.707,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    **shared: Any,
) -> Path:
    """``shared``: ``_save_tiny``'s knobs. ``num_kv_heads`` is the full-attention layers' count;
    sliding-window layers get twice as many."""
    # HF: rd = int(head_dim * partial_rotary_factor); inv_freq = theta ** (-arange(0, rd, 2) / rd);
    # the rotated width is 2 * len(inv_freq) (= rd + 1 when rd is odd, e.g. head_dim 16 -> rd 5,
    # 6 dims rotated). Keep rd even (default head_dim 24 -> 8) unless testing that corner.
    config = dict(
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        sliding_window=sliding_window,
        layer_types=_layer_types(
            num_layers, full_attn_layers, "full_attention", "sliding_attention"
        ),
        mlp_layer_types=_first_dense(num_layers, first_k_dense),
        rope_parameters={
            "full_attention": _rope(full_rope_theta, partial_rotary_factor=partial_rotary_factor),
            "sliding_attention": _rope(swa_rope_theta, partial_rotary_factor=partial_rotary_factor),
        },
        attention_value_scale=attention_value_scale,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
    )
    rules = [
        *_NORM_ONES,
        ("e_score_correction_bias", "add", 0.1),
        ("self_attn.sinks", "set", 1.0),  # init N(0, init_std): make the sink matter
    ]
    return _save_tiny("MiMoV2FlashConfig", config, rules, tmp_dir, **shared)


def make_tiny_bailing_hybrid(
    tmp_dir: str | Path,
    *,
    first_k_dense: int = 1,
    linear_head_dim: int = 16,  # passed as config head_dim; HF then overwrites config.head_dim
    conv_kernel: int = 4,
    kda_safe_gate: bool = True,
    kda_lower_bound: float = -5.0,
    rope_theta: float = 10_000.0,
    **knobs: Any,
) -> Path:
    """Bailing hybrid / Ling 3 (KDA with the safe gate, gated MLA with interleaved RoPE, grouped
    MoE); ``num_heads`` is shared by MLA *and* KDA. ``knobs``: ``_save_kda_mla``'s (with two
    expert groups and a routed scale of 2.5 by default) and ``_save_tiny``'s."""
    config = dict(
        head_dim=linear_head_dim,
        short_conv_kernel_size=conv_kernel,
        kda_safe_gate=kda_safe_gate,
        kda_lower_bound=kda_lower_bound,
        rope_theta=rope_theta,
        rope_parameters=_rope(rope_theta),
        first_k_dense_replace=first_k_dense,
        num_mtp_layers=0,
    )
    defaults = dict(n_group=2, routed_scaling_factor=2.5, rms_norm_eps=1e-6)
    return _save_kda_mla("BailingHybridConfig", config, tmp_dir, **{**defaults, **knobs})


MAKERS: dict[str, Callable[..., Path]] = {
    "kimi_linear": make_tiny_kimi_linear,
    "minimax": make_tiny_minimax,
    "qwen3_next": make_tiny_qwen3_next,
    "mimo_v2_flash": make_tiny_mimo_v2_flash,
    "bailing_hybrid": make_tiny_bailing_hybrid,
}


def make_tiny(family: str, tmp_dir: str | Path, **kwargs: Any) -> Path:
    return MAKERS[family](tmp_dir, **kwargs)


# --------------------------------------------------------------------------------------------------
# running the reference
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: float, attn_implementation: str):
    torch = _torch()
    from transformers import AutoModelForCausalLM

    del mtime  # cache key only: a rewritten checkpoint is reloaded
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.eval()
    return model


def load_hf_model(path: str | Path, *, attn_implementation: str = "eager"):
    """Load (and memoise) a saved fixture on CPU in float32."""
    p = Path(path)
    mtime = max(f.stat().st_mtime for f in p.iterdir())
    return _load(str(p.resolve()), mtime, attn_implementation)


def _ids(prompt_ids: Sequence[int]):
    torch = _torch()
    ids = torch.tensor([list(int(t) for t in prompt_ids)], dtype=torch.long)
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    return ids


def hf_prefill_logits(
    path: str | Path, prompt_ids: Sequence[int], *, attn_implementation: str = "eager"
) -> np.ndarray:
    """Logits of one full forward over the prompt (no cache): float32 array [T, vocab]."""
    torch = _torch()
    model = load_hf_model(path, attn_implementation=attn_implementation)
    with torch.no_grad():
        out = model(input_ids=_ids(prompt_ids), use_cache=False)
    return out.logits[0].float().cpu().numpy()


def hf_greedy_with_logits(
    path: str | Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    attn_implementation: str = "eager",
) -> tuple[list[int], np.ndarray]:
    """Greedy generation with the HF cache (prefill once, then one token per step).

    Returns (new token ids, logits [max_new_tokens, vocab] float32) where logits[i] is the
    distribution that produced token i (logits[0] = last prefill position). EOS never stops it.
    """
    torch = _torch()
    model = load_hf_model(path, attn_implementation=attn_implementation)
    ids = _ids(prompt_ids)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    new = out.sequences[0, ids.shape[1] :].tolist()
    logits = torch.stack([x[0] for x in out.logits]).float().cpu().numpy()
    return new, logits


def hf_greedy_without_cache(
    path: str | Path, prompt_ids: Sequence[int], max_new_tokens: int
) -> tuple[list[int], np.ndarray]:
    """``hf_greedy_with_logits`` by one full no-cache forward per token, for configurations whose
    cached generation disagrees with transformers' own forward pass."""
    tokens: list[int] = []
    step_logits = []
    for _ in range(max_new_tokens):
        last = hf_prefill_logits(path, [*prompt_ids, *tokens])[-1]
        step_logits.append(last)
        tokens.append(int(np.argmax(last)))
    return tokens, np.stack(step_logits)


def greedy_margins(logits: np.ndarray) -> np.ndarray:
    """top1 - top2 logit gap per row; parity tests can assert min() > their tolerance."""
    part = np.sort(logits, axis=-1)
    return part[..., -1] - part[..., -2]


def default_prompt(length: int = 20, *, vocab_size: int = 160, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=length).tolist()


def _selfcheck(max_new_tokens: int = 24) -> None:  # pragma: no cover - manual smoke test
    """python tests/model/hf/hf_fixtures.py : build, save, reload and generate with every family."""
    import tempfile
    import time

    prompt = default_prompt(20, seed=1)
    for fam in FAMILIES:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            path = make_tiny(fam, d)
            t1 = time.perf_counter()
            toks, logits = hf_greedy_with_logits(path, prompt, max_new_tokens)
            t2 = time.perf_counter()
            full = hf_prefill_logits(path, prompt + toks)
            ref = full[len(prompt) - 1 : len(prompt) - 1 + max_new_tokens]
            print(
                f"{fam:15s} build+save {t1 - t0:5.2f}s  "
                f"load+greedy{max_new_tokens} {t2 - t1:5.2f}s  "
                f"cache-vs-nocache {np.abs(ref - logits).max():.1e}  "
                f"min margin {greedy_margins(logits).min():.3f}  tokens {toks}"
            )


if __name__ == "__main__":  # pragma: no cover
    _selfcheck()
