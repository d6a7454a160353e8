"""The hybrid decoder stack: ``HybridLM`` (a Flax NNX module) and the pure functions the engines
jit — ``init_params``, ``param_specs``, ``prefill``, ``prefill_layers`` (a prefill a group of
layers at a time) and ``decode_step``.

Block ``i`` is pre-norm::

    h ← h + mixer_i(rms_norm(h))          mixer_i ∈ {KDA, GDN, Lightning, MLA, GQA, SWA}
    h ← h + mlp_i(rms_norm(h))            mlp_i ∈ {SwiGLU, MoE}

followed by a final norm and the LM head. With a ``[residual]`` section (MiniMax-01) each
sub-layer instead computes ``h ← α·n + β·f(n)`` with ``n = rms_norm(h)`` (config.ResidualConfig).
``prefill`` absorbs ``T`` tokens into a state (empty or not) with the chunked ops;
``decode_step`` absorbs one token per row with the recurrent forms and absorbed MLA. Invariants,
held by tests: prefill(T) ≡ prefill(T₁) + prefill(T − T₁) ≡ prefill(T − 1) + decode_step, for
every layer kind.

Modules and params. The model is defined once, as NNX modules (``Block``, ``HybridLM``, the
mixers of model/mixers/, ``SwiGLU`` / ``MoE``). The engines, the HF importers, orbax checkpoints,
the sharding rules and training all hold the weights as ``Params``: the module's ``nnx.Param``
values as a plain nested dict whose keys are the modules' attribute names, with ``layers`` a
tuple (``{"embed", "layers": ({"mixer_norm", "mixer": {...}, "mlp_norm", "mlp": {...}}, …),
"final_norm"[, "lm_head"]}``). ``prefill`` / ``decode_step`` merge the module's graph definition
(static, cached per config) with ``params`` inside the traced function, so what XLA compiles is
the arithmetic alone: jit them with ``cfg`` (and ``impl``) static.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prfaas_jax.config import LayerKind, MlpKind, ModelConfig
from prfaas_jax.model import initializers as init
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.model.mixers.delta import DeltaMixer
from prfaas_jax.model.mixers.gqa import GqaMixer
from prfaas_jax.model.mixers.lightning import LightningMixer
from prfaas_jax.model.mixers.mla import MlaMixer
from prfaas_jax.model.mlp import MoE, SwiGLU
from prfaas_jax.model.norms import rms_norm
from prfaas_jax.model.state import LayerState, ModelState
from prfaas_jax.ops.dispatch import Impl
from prfaas_jax.ops.precision import upcast
from prfaas_jax.ops.weight_dot import weight_dot

Params = dict
Mixer = DeltaMixer | LightningMixer | MlaMixer | GqaMixer


def _mixer(cfg: ModelConfig, index: int, rngs: nnx.Rngs) -> Mixer:
    kind = cfg.layers[index]
    if kind in (LayerKind.KDA, LayerKind.GDN):
        return DeltaMixer(cfg, kind, rngs=rngs)
    if kind is LayerKind.LIGHTNING:
        return LightningMixer(cfg, index, rngs=rngs)
    if kind is LayerKind.MLA:
        return MlaMixer(cfg, rngs=rngs)
    return GqaMixer(cfg, kind, rngs=rngs)


def _residual(
    h: jax.Array, normed: jax.Array, out: jax.Array, factors: tuple[float, float] | None
) -> jax.Array:
    if factors is None:
        return h + out
    alpha, beta = factors
    return normed * alpha + out * beta


class Block(nnx.Module):
    """Decoder block ``index``: pre-norm mixer, then pre-norm MLP, each with its residual."""

    def __init__(self, cfg: ModelConfig, index: int, *, rngs: nnx.Rngs) -> None:
        self.cfg, self.index = cfg, index
        dim, dtype = cfg.hidden_dim, jnp.dtype(cfg.dtype)
        self.mixer_norm = init.ones((dim,), dtype)
        self.mixer = _mixer(cfg, index, rngs)
        self.mlp_norm = init.ones((dim,), dtype)
        if cfg.mlps[index] is MlpKind.MOE:
            self.mlp = MoE(dim, cfg.moe, dtype, rngs=rngs)
        else:
            self.mlp = SwiGLU(dim, cfg.mlp_dim, dtype, rngs=rngs)

    def __call__(
        self, h_BTD: jax.Array, state: LayerState, ctx: StepContext
    ) -> tuple[jax.Array, LayerState]:
        cfg, res = self.cfg, self.cfg.residual
        normed = rms_norm(h_BTD, self.mixer_norm[...], cfg.norm_eps)
        mixed, state = self.mixer(normed, state, ctx)
        h_BTD = _residual(h_BTD, normed, mixed, res and res.mixer_factors(cfg.layers[self.index]))
        normed = rms_norm(h_BTD, self.mlp_norm[...], cfg.norm_eps)
        out = self.mlp(normed)
        return _residual(h_BTD, normed, out, res and (res.mlp_alpha, res.mlp_beta)), state


class HeadLayouts(NamedTuple):
    """A separate LM head in both layouts: a decode engine's view of it
    (model/decode_weights.py). From a DRAM-resident matrix XLA:CPU reads ``x [M, D] @ W [D, V]``
    fastest at one row, and from two rows ``W_VD [V, D]`` contracted on ``D`` as stored: 0.7×
    the time at 8 and 32 rows (docs/performance.md, "Dot forms at a few rows"). The step's row
    count is static, so each compiled step reads one of them."""

    as_loaded: jax.Array  # as the model holds it
    by_vocab: jax.Array  # one row per vocabulary entry, as the embedding table


class HybridLM(nnx.Module):
    """Embedding, the blocks of ``cfg.layers`` and the (tied or separate) LM head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        dim, dtype = cfg.hidden_dim, jnp.dtype(cfg.dtype)
        self.embed = init.dense(rngs, (cfg.vocab_size, dim), dtype, fan_in=1)
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = init.ones((dim,), dtype)
        if not cfg.tie_embeddings:
            self.lm_head = init.dense(rngs, (dim, cfg.vocab_size), dtype)

    def __call__(
        self,
        tokens_BT: jax.Array,
        state: ModelState,
        ctx: StepContext,
        last_B: jax.Array | None = None,
    ) -> tuple[jax.Array, ModelState]:
        """``(logits [B, T, V] fp32, state)``; ``[B, 1, V]`` at position ``last_B`` if given."""
        h, layers = self.blocks(self.embed[...][tokens_BT], state.layers, ctx, 0)
        return self.head(h, last_B), ModelState(lengths=ctx.new_lengths, layers=layers)

    def blocks(
        self, h_BTD: jax.Array, states: tuple[LayerState, ...], ctx: StepContext, start: int
    ) -> tuple[jax.Array, tuple[LayerState, ...]]:
        """Blocks ``start … start + len(states) − 1`` on ``h``, each with its state."""
        new_states = []
        for block, layer_state in zip(self.layers[start:], states, strict=False):
            h_BTD, layer_state = block(h_BTD, layer_state, ctx)
            new_states.append(layer_state)
        return h_BTD, tuple(new_states)

    def head(self, h_BTD: jax.Array, last_B: jax.Array | None = None) -> jax.Array:
        """Logits [B, T, V] fp32 (``[B, 1, V]`` at position ``last_B`` if given)."""
        if last_B is not None:
            # Only position last_B[b] is wanted: the LM head then runs on B rows instead of B·T.
            h_BTD = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)
        h_BTD = rms_norm(h_BTD, self.final_norm[...], self.cfg.norm_eps)
        head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head.get_value()
        if isinstance(head, HeadLayouts) and np.prod(h_BTD.shape[:-1]) > 1:
            return jnp.einsum(  # [V, D] contracted on D, as stored
                "btd,vd->btv",
                upcast(h_BTD),
                upcast(head.by_vocab),
                precision=jax.lax.Precision.HIGHEST,
            )
        if isinstance(head, HeadLayouts):
            head = head.as_loaded
        if head.dtype != jnp.dtype(self.cfg.dtype):
            # Weights narrowed for decode (model/narrow_weights.py) are read as stored: widening
            # the head would copy all of it on every step.
            return weight_dot(upcast(h_BTD), head)
        # Logits in fp32 so sampling and cross-implementation comparisons see the same numbers.
        return jnp.einsum(
            "btd,dv->btv",
            upcast(h_BTD),
            upcast(head),
            precision=jax.lax.Precision.HIGHEST,
        )


# --- params ↔ modules ------------------------------------------------------------------------


def params_of(model: HybridLM) -> Params:
    """The ``Params`` tree of a module: its ``nnx.Param`` values, ``layers`` as a tuple."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {**pure, "layers": tuple(pure["layers"][i] for i in range(len(pure["layers"])))}


def _shape_only_rngs() -> nnx.Rngs:
    """An ``nnx.Rngs`` for building a module whose values are discarded (``eval_shape``).

    Every draw bumps the stream's counter. A traced counter makes flax compare its sharding, and
    asking a tracer for one builds JAX's error text by walking the whole trace, so building a
    model abstractly costs time quadratic in its size (13 s for ``kimi-linear-48b`` instead of
    1 s). A host (NumPy) counter is never compared that way; under a trace it does not advance
    either, so every draw gets the same key — harmless when only shapes and dtypes are kept,
    which is why nothing that keeps values uses this.
    """
    rngs = nnx.Rngs(params=0)
    rngs.params.count.set_value(np.zeros((), np.uint32))
    return rngs


@functools.cache
def graph_of(cfg: ModelConfig) -> nnx.GraphDef:
    """The static graph definition of ``HybridLM(cfg)`` (built abstractly, once per config)."""
    graph, _ = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg, rngs=_shape_only_rngs())))
    return graph


def bind(cfg: ModelConfig, params: Params) -> HybridLM:
    """The module ``HybridLM(cfg)`` holding ``params`` (arrays or tracers; nothing is copied)."""
    return nnx.merge(graph_of(cfg), {**params, "layers": dict(enumerate(params["layers"]))})


@functools.partial(jax.jit, static_argnums=1)
def _init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    return params_of(HybridLM(cfg, rngs=nnx.Rngs(params=key)))


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Random parameters (std 1/sqrt(fan_in)) drawn from ``key``, built by one compiled call."""
    return _init_params(key, cfg)


def param_specs(cfg: ModelConfig) -> Params:
    """``init_params``' pytree as ``jax.ShapeDtypeStruct`` leaves, without allocating anything.

    The contract for weights from elsewhere (HF import, orbax restore): same structure, shapes
    and dtypes as a random init.
    """
    return jax.eval_shape(lambda: params_of(HybridLM(cfg, rngs=_shape_only_rngs())))


# --- the pure entry points the engines jit --------------------------------------------------


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
    model = bind(cfg, params)
    if not last_only:
        return model(tokens, state, ctx)
    logits, state = model(tokens, state, ctx, last_B=ctx.valid_len - 1)
    return logits[:, 0], state


def prefill_layers(
    params: Params,
    cfg: ModelConfig,
    inputs: jax.Array,
    states: tuple[LayerState, ...],
    lengths: jax.Array,
    valid_len: jax.Array,
    *,
    start: int,
    impl: Impl | str = Impl.CHUNK,
) -> tuple[jax.Array, tuple[LayerState, ...]]:
    """Blocks ``start … start + len(states) − 1`` of a prefill, for layer-wise streaming: each
    group's final states exist (and can leave) while later groups compute. ``inputs`` are the
    tokens ``[B, T]`` when ``start == 0``, else the hidden states ``[B, T, D]`` the previous
    group returned; ``lengths`` are the tokens in the state before this call (every layer's).
    Returns the hidden states, or — for the group that ends the stack — the logits ``[B, V]``
    at each row's last valid token, with the group's new states. Chained over groups that tile
    the layers it computes exactly ``prefill(…, last_only=True)``."""
    ctx = StepContext(
        lengths=lengths,
        valid_len=valid_len.astype(jnp.int32),
        seq_len=inputs.shape[1],
        impl=Impl(impl),
        decode=False,
    )
    model = bind(cfg, params)
    h = model.embed[...][inputs] if start == 0 else inputs
    h, states = model.blocks(h, states, ctx, start)
    if start + len(states) == cfg.num_layers:
        return model.head(h, last_B=ctx.valid_len - 1)[:, 0], states
    return h, states


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
    logits, state = bind(cfg, params)(tokens[:, None], state, ctx)
    return logits[:, 0], state
