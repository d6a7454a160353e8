"""Model configuration: ``ModelConfig``, the per-layer ``LayerKind`` pattern, and preset loading.

A hybrid model is a stack of decoder blocks. Each block has a *mixer* chosen per layer from

* linear attention with a fixed-size recurrent state: ``KDA`` (Kimi Delta Attention, per-channel
  gate), ``GDN`` (Gated DeltaNet, per-head gate), ``LIGHTNING`` (constant per-head decay), or
* softmax attention with a KV cache: ``MLA`` (latent ``c_kv ‖ k_rope`` cache), ``GQA`` (grouped
  K/V heads, cache grows with length), ``SWA`` (GQA over a sliding window, cache bounded by it),

and an MLP that is either dense (SwiGLU) or a mixture of experts with top-k routing (optionally
group-limited) and optional, optionally gated, shared experts. An optional ``[residual]`` section
scales the residual connections the way MiniMax-01 does (``ResidualConfig``). Configs are frozen,
hashable (usable as ``jax.jit`` statics) and validated on construction. Presets live in
``configs/models/<name>.toml`` and are read by ``toml_config.build``: an unknown key or a value of
the wrong type is an error naming the file and the key. ``layers`` and ``mlps`` take a repeat
shorthand, ``["kda*3", "mla"]``. Over 400 lines because the section configs stay beside
``ModelConfig``, which checks them against each other.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from prfaas_jax.errors import ConfigError
from prfaas_jax.toml_config import Where, build, presets, read, resolve
from prfaas_jax.toml_config import config_dir as config_dir  # part of this module's API

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Impl(enum.StrEnum):
    """Which implementation of each op a model runs (`prfaas_jax.ops.dispatch`)."""

    REFERENCE = "reference"
    CHUNK = "chunk"
    PALLAS = "pallas"


class LayerKind(enum.StrEnum):
    KDA = "kda"
    GDN = "gdn"
    LIGHTNING = "lightning"
    MLA = "mla"
    GQA = "gqa"
    SWA = "swa"

    @property
    def is_linear(self) -> bool:
        return self in (LayerKind.KDA, LayerKind.GDN, LayerKind.LIGHTNING)

    @property
    def has_growing_state(self) -> bool:
        """True when the layer's cache grows with every token (full attention)."""
        return self in (LayerKind.MLA, LayerKind.GQA)


class MlpKind(enum.StrEnum):
    DENSE = "dense"
    MOE = "moe"


class RopeKind(enum.StrEnum):
    NONE = "none"
    NEOX = "neox"  # rotate-half over the first ``rope_fraction`` of the head dims ("standard")
    INTERLEAVED = "interleaved"  # rotate adjacent pairs (2i, 2i+1)


class MoeScoring(enum.StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class LightningDecay(enum.StrEnum):
    """Which per-layer slope schedule a Lightning layer uses (docs/model-configs.md)."""

    MINIMAX = "minimax"  # s_h · (1 − l/(L−1) + 1e-5)
    RING = "ring"  # s_h · (1 − (l−1)/(L−1) + 1e-5)
    # transformers' MiniMax port: geometric slopes 2^(−8(h+1)/H) for every H (no ALiBi
    # interleaving when H is not a power of two) and 1e-5 inside the denominator:
    # s_h · (1 − l/(L−1+1e-5) + 1e-5).
    MINIMAX_HF = "minimax_hf"


class KdaGate(enum.StrEnum):
    """How a KDA layer turns its gate pre-activation ``f`` (already + dt_bias) into a log decay."""

    SOFTPLUS = "softplus"  # g = −exp(A_log[h]) · softplus(f)              (Kimi Linear)
    SAFE = "safe"  # g = lower_bound · sigmoid(exp(A_log[h]) · f), in (lower_bound, 0)  (Bailing)


def dtype_nbytes(name: str) -> int:
    """Bytes per element of a dtype named in a config."""
    return _DTYPE_BYTES[name]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_dtype(name: str, field: str) -> None:
    _check(name in _DTYPE_BYTES, f"{field} must be one of {sorted(_DTYPE_BYTES)}, got {name!r}")


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Shared dimensions of the KDA / GDN / Lightning layers of a model."""

    num_heads: int  # query/key heads
    num_v_heads: int  # value heads (≥ num_heads: grouped value attention)
    head_dim: int  # d_k
    v_head_dim: int  # d_v
    conv_kernel: int = 4  # depthwise causal short conv over [q | k | v] (KDA, GDN); 1 = none
    gate_rank: int = 0  # KDA low-rank gate projections (f_a/f_b, g_a/g_b); 0 = head_dim
    full_rank_gates: bool = False  # KDA f/g gates as one full-rank projection each (f, g_proj)
    kda_gate: KdaGate = KdaGate.SOFTPLUS
    gate_lower_bound: float = -5.0  # KdaGate.SAFE only
    lightning_decay: LightningDecay = LightningDecay.MINIMAX
    qk_scale: float = 0.0  # q scale inside the linear op; 0 = head_dim^-0.5 (MiniMax uses 1)
    o_norm_eps: float = 0.0  # eps of the output RMSNorm; 0 = the model's norm_eps

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_v_heads", "head_dim", "v_head_dim", "conv_kernel"):
            _check(getattr(self, name) >= 1, f"linear.{name} must be ≥ 1")
        _check(
            self.num_v_heads % self.num_heads == 0,
            f"linear.num_v_heads ({self.num_v_heads}) must be a multiple of "
            f"linear.num_heads ({self.num_heads})",
        )
        _check(self.qk_scale >= 0.0, "linear.qk_scale must be ≥ 0 (0 = head_dim^-0.5)")
        _check(self.o_norm_eps >= 0.0, "linear.o_norm_eps must be ≥ 0 (0 = norm_eps)")
        _check(self.gate_lower_bound < 0.0, "linear.gate_lower_bound must be < 0")

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_heads * self.head_dim + self.num_v_heads * self.v_head_dim

    @property
    def low_rank(self) -> int:
        return self.gate_rank or self.head_dim


@dataclass(frozen=True)
class AttentionConfig:
    """A softmax-attention layer with grouped K/V heads (GQA, or SWA when ``window`` is set)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim
    v_head_dim: int = 0  # 0 = head_dim
    window: int = 0  # sliding window in tokens, current token included (SWA only)
    rope: RopeKind = RopeKind.NEOX
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # partial RoPE: rotate only this fraction of head_dim
    use_qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    use_output_gate: bool = False  # o ← o · sigmoid(W_gate x) per head (gated attention)
    use_sinks: bool = False  # learned per-head sink logit in the softmax denominator

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            _check(getattr(self, name) >= 1, f"attention.{name} must be ≥ 1")
        _check(
            self.num_heads % self.num_kv_heads == 0,
            f"attention.num_heads ({self.num_heads}) must be a multiple of "
            f"num_kv_heads ({self.num_kv_heads})",
        )
        _check(self.window >= 0, "attention.window must be ≥ 0")
        _check(0.0 < self.rope_fraction <= 1.0, "attention.rope_fraction must be in (0, 1]")
        _check(
            self.rotary_dim % 2 == 0, "attention rotary dims (head_dim·rope_fraction) must be even"
        )

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rope is RopeKind.NONE else round(self.head_dim * self.rope_fraction)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi Linear, Ring-2.5)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0 = a single q projection (Kimi Linear)
    rope: RopeKind = RopeKind.NONE  # Kimi Linear is NoPE; Ring-2.5 uses INTERLEAVED
    rope_theta: float = 10000.0
    latent_norm_eps: float = 0.0  # eps of the c_kv and c_q RMSNorms; 0 = the model's norm_eps
    use_output_gate: bool = False  # o_h ← o_h · sigmoid(w_h · x), one scalar per head (Bailing)

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _check(getattr(self, name) >= 1, f"mla.{name} must be ≥ 1")
        _check(self.qk_rope_head_dim % 2 == 0, "mla.qk_rope_head_dim must be even")
        _check(self.latent_norm_eps >= 0.0, "mla.latent_norm_eps must be ≥ 0 (0 = norm_eps)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """Top-k routed experts plus always-on shared experts."""

    num_experts: int
    top_k: int
    expert_dim: int
    num_shared_experts: int = 0
    scoring: MoeScoring = MoeScoring.SOFTMAX
    use_score_bias: bool = False  # bias added for expert *selection* only (DeepSeek-V3 style)
    renormalize: bool = True  # renormalise the top-k weights to sum to one
    routed_scale: float = 1.0  # multiplies the routed experts' output
    # Group-limited selection (DeepSeek-V3): experts form ``num_groups`` equal groups, each scored
    # by the sum of its two best selection scores; only the best ``topk_groups`` groups compete.
    num_groups: int = 1
    topk_groups: int = 1
    shared_dim: int = 0  # width of the shared SwiGLU; 0 = num_shared_experts · expert_dim
    use_shared_gate: bool = False  # shared output · sigmoid(x · w_gate), one scalar per token

    def __post_init__(self) -> None:
        _check(self.num_experts >= 1, "moe.num_experts must be ≥ 1")
        _check(
            1 <= self.top_k <= self.num_experts,
            f"moe.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}",
        )
        _check(self.expert_dim >= 1, "moe.expert_dim must be ≥ 1")
        _check(self.num_shared_experts >= 0, "moe.num_shared_experts must be ≥ 0")
        _check(self.shared_dim >= 0, "moe.shared_dim must be ≥ 0")
        _check(
            not self.use_shared_gate or self.num_shared_experts >= 1,
            "moe.use_shared_gate needs num_shared_experts ≥ 1",
        )
        _check(
            self.num_groups >= 1 and self.num_experts % self.num_groups == 0,
            f"moe.num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})",
        )
        _check(
            1 <= self.topk_groups <= self.num_groups,
            f"moe.topk_groups must be in [1, num_groups={self.num_groups}]",
        )
        if self.num_groups > 1:
            group_size = self.num_experts // self.num_groups
            _check(group_size >= 2, "moe: grouped routing needs at least 2 experts per group")
            _check(
                self.topk_groups * group_size >= self.top_k,
                f"moe: {self.topk_groups} group(s) of {group_size} experts cannot supply "
                f"top_k={self.top_k} experts",
            )

    @property
    def shared_width(self) -> int:
        """Hidden width of the shared-expert SwiGLU (0 when there is none)."""
        if not self.num_shared_experts:
            return 0
        return self.shared_dim or self.num_shared_experts * self.expert_dim


@dataclass(frozen=True)
class ResidualConfig:
    """Scaled residual connections around each sub-layer (MiniMax-01).

    With pre-norm ``n`` and sub-layer ``f`` the block computes ``h ← α·n(h) + β·f(n(h))``: the
    *normed* input is the residual branch. ``(α, β)`` depend on the sub-layer: linear mixers,
    softmax-attention mixers, or the MLP. Without this section the block is the usual
    ``h ← h + f(n(h))``.
    """

    linear_alpha: float = 1.0
    linear_beta: float = 1.0
    attention_alpha: float = 1.0
    attention_beta: float = 1.0
    mlp_alpha: float = 1.0
    mlp_beta: float = 1.0

    def mixer_factors(self, kind: LayerKind) -> tuple[float, float]:
        if kind.is_linear:
            return self.linear_alpha, self.linear_beta
        return self.attention_alpha, self.attention_beta


@dataclass(frozen=True)
class ModelConfig:
    """A hybrid decoder-only LM. ``layers[i]`` and ``mlps[i]`` describe block ``i``."""

    name: str
    vocab_size: int
    hidden_dim: int
    layers: tuple[LayerKind, ...]
    mlps: tuple[MlpKind, ...]
    mlp_dim: int = 0  # dense SwiGLU intermediate size
    norm_eps: float = 1e-5
    dtype: str = "float32"  # params, activations and KV caches
    state_dtype: str = "float32"  # recurrent states of linear layers
    tie_embeddings: bool = False
    max_len: int = 131072  # longest sequence the model is meant to see
    # True: max_len is the positional range the weights were trained for (an imported Hugging
    # Face checkpoint's max_position_embeddings), which `with_max_len` may lower but never lift.
    # False (every preset here: NoPE MLA, or RoPE on weights with no trained range): a default.
    max_len_fixed: bool = False
    linear: LinearAttentionConfig | None = None
    attention: AttentionConfig | None = None  # GQA layers
    swa: AttentionConfig | None = None  # SWA layers
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    residual: ResidualConfig | None = None  # None: plain pre-norm residuals

    def __post_init__(self) -> None:
        _check(bool(self.layers), "layers must not be empty")
        _check(
            len(self.mlps) == len(self.layers),
            f"mlps has {len(self.mlps)} entries but layers has {len(self.layers)}",
        )
        _check(self.vocab_size >= 2, "vocab_size must be ≥ 2")
        _check(self.hidden_dim >= 1, "hidden_dim must be ≥ 1")
        _check(self.max_len >= 1, "max_len must be ≥ 1")
        _check_dtype(self.dtype, "dtype")
        _check_dtype(self.state_dtype, "state_dtype")
        kinds = set(self.layers)
        needs = {
            "linear": kinds & {LayerKind.KDA, LayerKind.GDN, LayerKind.LIGHTNING},
            "attention": kinds & {LayerKind.GQA},
            "swa": kinds & {LayerKind.SWA},
            "mla": kinds & {LayerKind.MLA},
        }
        for section, users in needs.items():
            if users:
                _check(
                    getattr(self, section) is not None,
                    f"layers use {sorted(map(str, users))} but the [{section}] section is missing",
                )
        if self.swa is not None and LayerKind.SWA in kinds:
            _check(self.swa.window >= 1, "swa.window must be ≥ 1 for SWA layers")
        if LayerKind.LIGHTNING in kinds and self.linear is not None:
            _check(
                self.linear.num_heads == self.linear.num_v_heads,
                "Lightning layers need linear.num_v_heads == linear.num_heads",
            )
        if MlpKind.MOE in self.mlps:
            _check(self.moe is not None, "mlps use 'moe' but the [moe] section is missing")
        if MlpKind.DENSE in self.mlps:
            _check(self.mlp_dim >= 1, "mlps use 'dense' but mlp_dim is not set")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_config(self, kind: LayerKind) -> Any:
        """The section that holds the dimensions of layers of ``kind``."""
        if kind.is_linear:
            return self.linear
        return {LayerKind.GQA: self.attention, LayerKind.SWA: self.swa, LayerKind.MLA: self.mla}[
            kind
        ]

    def with_max_len(self, max_len: int) -> ModelConfig:
        """This model holding up to ``max_len`` tokens, lifted or lowered: the limit is not part
        of the model (`fingerprint` leaves it out), so states stay exchangeable. A ``ConfigError``
        when ``max_len`` is past a fixed limit (``max_len_fixed``)."""
        _check(max_len >= 1, f"max_len must be ≥ 1, got {max_len}")
        _check(
            not self.max_len_fixed or max_len <= self.max_len,
            f"{max_len} tokens exceed {self.name}'s max_len {self.max_len}, the positional "
            "range its weights were trained for (max_len_fixed)",
        )
        return dataclasses.replace(self, max_len=max_len)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict that ``config_from_dict`` turns back into an equal config."""
        return _plain(dataclasses.asdict(self))

    def fingerprint(self) -> str:
        """Hex SHA-256 of the canonical config.

        ``name``, ``max_len`` and ``max_len_fixed`` are excluded: none changes the math or the
        state layout, so deployments with different serving limits can still exchange states.
        Computed once per config (every state header is checked against it).
        """
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:
        canonical = self.to_dict()
        canonical.pop("name")
        canonical.pop("max_len")
        canonical.pop("max_len_fixed")
        blob = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


# --- loading --------------------------------------------------------------------------------


def _expand_pattern(entries: Any, where: Where, enum_type: type[enum.Enum]) -> tuple:
    """Expand ``["kda*3", "mla"]`` into ``(KDA, KDA, KDA, MLA)``."""
    if not isinstance(entries, list | tuple):
        raise where.error("expected a list such as ['kda*3', 'mla']")
    out: list = []
    for entry in entries:
        if not isinstance(entry, str):
            raise where.error(f"entries must be strings, got {entry!r}")
        name, _, count = entry.partition("*")
        try:
            kind = enum_type(name.strip().lower())
            repeat = int(count) if count else 1
        except ValueError:
            choices = ", ".join(m.value for m in enum_type)
            raise where.error(
                f"bad entry {entry!r} (kinds: {choices}; repeat as 'kind*N')"
            ) from None
        if repeat < 1:
            raise where.error(f"repeat count must be ≥ 1 in {entry!r}")
        out.extend([kind] * repeat)
    return tuple(out)


def config_from_dict(raw: dict[str, Any], *, source: str = "config") -> ModelConfig:
    """Build a validated ``ModelConfig`` from TOML/JSON data (``source`` names it in errors)."""
    where = Where(source)
    # `to_dict` writes an absent section as None; TOML has no None.
    table = {key: value for key, value in raw.items() if value is not None}
    for key, kind in (("layers", LayerKind), ("mlps", MlpKind)):
        if key in table:
            table[key] = _expand_pattern(table[key], where.at(key), kind)
    return build(ModelConfig, table, where)


def available_presets() -> list[str]:
    return presets("models")


def load_model_config(name_or_path: str | os.PathLike[str]) -> ModelConfig:
    """Load a preset by name (``configs/models/<name>.toml``), a TOML file by path, or the
    ``config.toml`` of a checkpoint folder."""
    path = resolve("models", name_or_path)
    if path.is_dir():
        path = path / "config.toml"
    raw = read(path, "model config")
    raw.setdefault("name", path.stem)
    return config_from_dict(raw, source=str(path))
