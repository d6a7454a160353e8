"""The hybrid decoder stack: ``init_params``, ``prefill`` and ``decode_step``.

Block ``i`` is pre-norm::

    h ← h + mixer_i(rms_norm(h))          mixer_i ∈ {KDA, GDN, Lightning, MLA, GQA, SWA}
    h ← h + mlp_i(rms_norm(h))            mlp_i ∈ {SwiGLU, MoE}

followed by a final norm and the LM head. With a ``[residual]`` section (MiniMax-01) each
sub-layer instead computes ``h ← α·n + β·f(n)`` with ``n = rms_norm(h)`` (config.ResidualConfig).
``prefill`` absorbs ``T`` tokens into a state (empty or not) with the chunked ops;
``decode_step`` absorbs one token per row with the recurrent forms and absorbed MLA. Both are pure
functions of (params, state, tokens): jit them with ``cfg`` (and ``impl``) static. Invariants,
held by tests: prefill(T) ≡ prefill(T₁) + prefill(T − T₁) ≡ prefill(T − 1) + decode_step, for
every layer kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.config import LayerKind, MlpKind, ModelConfig
from prfaas_jax.model import initializers as init
from prfaas_jax.model.mixers import delta, gqa, lightning, mla
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.mlp import moe_mlp, swiglu
from prfaas_jax.model.norms import rms_norm
from prfaas_jax.model.state import LayerState, ModelState
from prfaas_jax.ops.dispatch import Impl

Params = dict


def _init_mixer(key: jax.Array, cfg: ModelConfig, kind: LayerKind) -> dict:
    if kind in (LayerKind.KDA, LayerKind.GDN):
        return delta.init_params(key, cfg, kind)
    if kind is LayerKind.LIGHTNING:
        return lightning.init_params(key, cfg)
    if kind is LayerKind.MLA:
        return mla.init_params(key, cfg)
    return gqa.init_params(key, cfg, kind)


def _init_swiglu(key: jax.Array, dim: int, width: int, dtype) -> dict:
    keys = init.KeySplitter(key)
    return {
        "gate": init.dense(keys(), (dim, width), dtype),
        "up": init.dense(keys(), (dim, width), dtype),
        "down": init.dense(keys(), (width, dim), dtype),
    }


def _init_mlp(key: jax.Array, cfg: ModelConfig, kind: MlpKind) -> dict:
    dim, dtype = cfg.hidden_dim, jnp.dtype(cfg.dtype)
    if kind is MlpKind.DENSE:
        return _init_swiglu(key, dim, cfg.mlp_dim, dtype)
    moe = cfg.moe
    keys = init.KeySplitter(key)
    width, experts = moe.expert_dim, moe.num_experts
    p = {
        "router": init.dense(keys(), (dim, experts), jnp.float32),
        "experts_gate": init.dense(keys(), (experts, dim, width), dtype),
        "experts_up": init.dense(keys(), (experts, dim, width), dtype),
        "experts_down": init.dense(keys(), (experts, width, dim), dtype),
    }
    if moe.use_score_bias:
        p["score_bias"] = init.uniform(keys(), (experts,), -0.1, 0.1)
    if moe.num_shared_experts:
        p["shared"] = _init_swiglu(keys(), dim, moe.shared_width, dtype)
    if moe.use_shared_gate:
        p["shared_gate"] = init.dense(keys(), (dim, 1), dtype)
    return p


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Random parameters (std 1/sqrt(fan_in)) as a plain nested-dict pytree."""
    dtype = jnp.dtype(cfg.dtype)
    keys = init.KeySplitter(key)
    params: Params = {
        "embed": init.dense(keys(), (cfg.vocab_size, cfg.hidden_dim), dtype, fan_in=1),
        "layers": tuple(
            {
                "mixer_norm": init.ones((cfg.hidden_dim,), dtype),
                "mixer": _init_mixer(keys(), cfg, kind),
                "mlp_norm": init.ones((cfg.hidden_dim,), dtype),
                "mlp": _init_mlp(keys(), cfg, mlp_kind),
            }
            for kind, mlp_kind in zip(cfg.layers, cfg.mlps, strict=True)
        ),
        "final_norm": init.ones((cfg.hidden_dim,), dtype),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = init.dense(keys(), (cfg.hidden_dim, cfg.vocab_size), dtype)
    return params


def param_specs(cfg: ModelConfig) -> Params:
    """``init_params``' pytree as ``jax.ShapeDtypeStruct`` leaves, without allocating anything.

    The contract for weights from elsewhere (HF import, orbax restore): same structure, shapes
    and dtypes as a random init.
    """
    return jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), cfg))


def _apply_mixer(
    p: dict, cfg: ModelConfig, index: int, x: jax.Array, state: LayerState, ctx: StepContext
) -> tuple[jax.Array, LayerState]:
    kind = cfg.layers[index]
    if kind in (LayerKind.KDA, LayerKind.GDN):
        return delta.apply(p, cfg, kind, x, state, ctx)
    if kind is LayerKind.LIGHTNING:
        return lightning.apply(p, cfg, index, x, state, ctx)
    if kind is LayerKind.MLA:
        return mla.apply(p, cfg, x, state, ctx)
    return gqa.apply(p, cfg, kind, x, state, ctx)


def _residual(
    h: jax.Array, normed: jax.Array, out: jax.Array, factors: tuple[float, float] | None
) -> jax.Array:
    if factors is None:
        return h + out
    alpha, beta = factors
    return normed * alpha + out * beta


def _forward(
    params: Params,
    cfg: ModelConfig,
    tokens_BT: jax.Array,
    state: ModelState,
    ctx: StepContext,
    last_B: jax.Array | None = None,
) -> tuple[jax.Array, ModelState]:
    h = params["embed"][tokens_BT]
    res = cfg.residual
    new_layers = []
    for index, (p, layer_state) in enumerate(zip(params["layers"], state.layers, strict=True)):
        normed = rms_norm(h, p["mixer_norm"], cfg.norm_eps)
        mixed, layer_state = _apply_mixer(p["mixer"], cfg, index, normed, layer_state, ctx)
        h = _residual(h, normed, mixed, res and res.mixer_factors(cfg.layers[index]))
        normed = rms_norm(h, p["mlp_norm"], cfg.norm_eps)
        if cfg.mlps[index] is MlpKind.MOE:
            out = moe_mlp(p["mlp"], cfg.moe, normed)
        else:
            out = swiglu(p["mlp"], normed)
        h = _residual(h, normed, out, res and (res.mlp_alpha, res.mlp_beta))
        new_layers.append(layer_state)
    if last_B is not None:
        # Only position last_B[b] is wanted: the LM head then runs on B rows instead of B·T.
        h = jnp.take_along_axis(h, last_B[:, None, None], axis=1)
    h = rms_norm(h, params["final_norm"], cfg.norm_eps)
    head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    # Logits in fp32 so sampling and cross-implementation comparisons see the same numbers.
    logits = jnp.einsum(
        "btd,dv->btv",
        h.astype(jnp.float32),
        head.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return logits, ModelState(lengths=ctx.new_lengths, layers=tuple(new_layers))


def prefill(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    state: ModelState,
    *,
    impl: Impl | str = Impl.CHUNK,
    valid_len: jax.Array | None = None,
    last_only: bool = False,
) -> tuple[jax.Array, ModelState]:
    """Absorb ``tokens [B, T]`` into ``state``; returns ``(logits [B, T, V] fp32, state)``.

    ``valid_len [B]`` (default ``T``) marks trailing padding: tokens at ``t ≥ valid_len[b]`` leave
    row ``b``'s state untouched and their logits are meaningless. The state must have room for
    the new tokens (``lengths + valid_len ≤ capacity``); tokens past the capacity are dropped.
    With ``last_only`` the logits are ``[B, V]``, at each row's last valid token only.
    """
    batch, seq_len = tokens.shape
    if valid_len is None:
        valid_len = jnp.full((batch,), seq_len, jnp.int32)
    ctx = StepContext(
        lengths=state.lengths,
        valid_len=valid_len.astype(jnp.int32),
        seq_len=seq_len,
        impl=Impl(impl),
        decode=False,
    )
    if not last_only:
        return _forward(params, cfg, tokens, state, ctx)
    logits, state = _forward(params, cfg, tokens, state, ctx, last_B=ctx.valid_len - 1)
    return logits[:, 0], state


def decode_step(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    state: ModelState,
    *,
    impl: Impl | str = Impl.CHUNK,
    active: jax.Array | None = None,
) -> tuple[jax.Array, ModelState]:
    """Absorb one token per row (``tokens [B]``); returns ``(logits [B, V] fp32, state)``.

    ``active [B]`` (default all True) masks rows whose slot is empty: their state is unchanged.
    Linear layers always step their recurrence; ``impl`` only picks the attention kernels
    (``pallas``: the absorbed-MLA decode and flash kernels).
    """
    batch = tokens.shape[0]
    valid_len = jnp.ones((batch,), jnp.int32)
    if active is not None:
        valid_len = active.astype(jnp.int32)
    ctx = StepContext(
        lengths=state.lengths, valid_len=valid_len, seq_len=1, impl=Impl(impl), decode=True
    )
    logits, state = _forward(params, cfg, tokens[:, None], state, ctx)
    return logits[:, 0], state
