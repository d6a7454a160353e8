"""A co-design sweep from a TOML file: `load_sweep(path) -> Sweep`, and the layouts of its points.

A sweep names a base model and axes; every combination of axis values is a `Point`, and
`Sweep.layout(base, point)` is that point's model config at full size, `Sweep.toy_layout(...)`
the same layout at toy size (docs/codesign.md). Sections and keys:

    [model]        base (preset, model TOML or HF config.json), placement = "periodic" | "kimi"
    [axes]         ratio ("R:1", "all-linear", "all-full"), linear_mixer, full_mixer,
                   kv_lora_rank, linear_heads ("HxD"), state_dtype, swa_window, wire (wire
                   precisions: "native", "bf16", "int8", "state=int8,kv=bf16", …), placement
                   ("early", "even", "late": where a ratio's full-attention blocks sit)
    [full_attention.gqa], [full_attention.swa]   dimensions of a full mixer the base lacks
    [deployment]   plan (a plan TOML, relative to this file), kv_lengths, egress_gbps (the
                   PrfaaS link instead of the plan's)
    [toy]          base (a toy preset: widths), num_layers, the task and the optimiser,
                   lr_grid (learning rates to choose from on a validation split);
    [toy.quick], [toy.large]   the same keys, for ``--toy quick`` (``--quick``) and
                   ``--toy large``

Layer placement of a ratio R:1 over n blocks: ``periodic`` puts full attention at every
(R+1)-th block, and R+1 must divide n; ``kimi`` puts it at every (R+1)-th block *and* at the
last, as Kimi Linear does (27 blocks → 20 KDA + 7 MLA; the case study's 57 → 42 + 15).
The ``placement`` axis moves them for a fixed count: ``even`` is the model's placement above,
``early`` the same number of full-attention blocks first, ``late`` last.
Every mistake — an unknown axis, a ratio that does not divide the block count, a mixer of the
wrong family or without its dimensions — is a one-line `ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from prfaas_jax.config import AttentionConfig, LayerKind, MlpKind, ModelConfig
from prfaas_jax.errors import ConfigError
from prfaas_jax.toml_config import Where, build, keys_of, read, split, value
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision

SECTIONS = ("model", "axes", "full_attention", "deployment", "toy")
LINEAR_KINDS = (LayerKind.KDA, LayerKind.GDN, LayerKind.LIGHTNING)
FULL_KINDS = (LayerKind.MLA, LayerKind.GQA, LayerKind.SWA)
_RATIO = re.compile(r"(\d+):1")
_HEADS = re.compile(r"(\d+)x(\d+)")
PLACEMENTS = ("early", "even", "late")


class Placement(enum.StrEnum):
    PERIODIC = "periodic"  # full attention closes every period; the period divides the blocks
    KIMI = "kimi"  # ... and the last block is full attention too


@dataclass(frozen=True)
class ModelSpec:
    base: str
    placement: Placement = Placement.PERIODIC


@dataclass(frozen=True)
class Axes:
    """Each axis lists its values; an empty axis keeps the base model's value."""

    ratio: tuple[str, ...] = ()
    linear_mixer: tuple[LayerKind, ...] = ()
    full_mixer: tuple[LayerKind, ...] = ()
    kv_lora_rank: tuple[int, ...] = ()
    linear_heads: tuple[str, ...] = ()
    state_dtype: tuple[str, ...] = ()
    swa_window: tuple[int, ...] = ()
    # How the state crosses the link (prfaas_jax/wire_precision.py): not a layout, the same
    # model; S_kv, the plan and the toy's recall are taken with the state in that precision.
    wire: tuple[str, ...] = ()
    # Where the ratio's full-attention blocks sit (PLACEMENTS): the same layers in another order,
    # the same bytes and FLOPs; what moves is the transfer layer-wise emission can hide.
    placement: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for index, name in enumerate(self.placement):
            if name not in PLACEMENTS:
                raise ConfigError(
                    f"axes.placement[{index}]: {name!r} is not one of {', '.join(PLACEMENTS)}"
                )
        for index, text in enumerate(self.wire):
            try:
                WirePrecision.parse(text)
            except ValueError as err:
                raise ConfigError(f"axes.wire[{index}]: {err}") from None


@dataclass(frozen=True)
class FullAttention:
    gqa: AttentionConfig | None = None
    swa: AttentionConfig | None = None


@dataclass(frozen=True)
class SweepDeployment:
    plan: str  # a plan TOML, relative to the sweep file
    kv_lengths: tuple[int, ...] = (1024, 8192, 32768, 131072)
    egress_gbps: float | None = None  # the PrfaaS link instead of the plan's (None: the plan's)

    def __post_init__(self) -> None:
        if not self.kv_lengths or min(self.kv_lengths) < 1:
            raise ConfigError("deployment.kv_lengths: must list positive token counts")
        if self.egress_gbps is not None and not self.egress_gbps > 0:
            raise ConfigError("deployment.egress_gbps: must be a positive number of Gbps")


@dataclass(frozen=True)
class ToySpec:
    """The toy-size model and how it is trained and evaluated (train/recall_probe.py)."""

    base: str = "tiny"
    num_layers: int = 8
    task: str = "mqar"
    vocab_size: int = 64
    seq_len: int = 32
    num_pairs: int = 4
    num_queries: int = 2
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    # Learning rates to choose from, per layout, on a validation split (() = ``lr`` alone):
    # hybrids of different ratios train best at different rates.
    lr_grid: tuple[float, ...] = ()
    warmup_steps: int = 20
    seed: int = 0
    eval_examples: int = 256
    eval_lengths: tuple[int, ...] = ()  # held-out lengths; () = the trained length and twice it
    # Prompt length at which a placement sweep times the toy's layer-wise emission.
    emission_length: int = 1024

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError("toy.num_layers: must be ≥ 1")
        if self.task not in ("mqar", "retrieval"):
            raise ConfigError(f"toy.task: must be 'mqar' or 'retrieval', got {self.task!r}")
        if not self.eval_lengths:
            object.__setattr__(self, "eval_lengths", (self.seq_len, 2 * self.seq_len))
        if min(self.eval_lengths) < 1:
            raise ConfigError("toy.eval_lengths: must be positive token counts")
        if self.emission_length < 1:
            raise ConfigError("toy.emission_length: must be a positive token count")
        if any(not lr > 0 for lr in (self.lr, *self.lr_grid)):
            raise ConfigError("toy.lr_grid: learning rates must be positive")

    @property
    def learning_rates(self) -> tuple[float, ...]:
        """The rates a layout is trained at to choose one: ``lr_grid``, else ``lr``."""
        return self.lr_grid or (self.lr,)


@dataclass(frozen=True)
class Point:
    """One combination of axis values (None: the base model's)."""

    ratio: str | None
    linear_mixer: LayerKind | None
    full_mixer: LayerKind | None
    kv_lora_rank: int | None
    linear_heads: str | None
    state_dtype: str | None
    swa_window: int | None
    wire: str | None = None
    placement: str | None = None  # PLACEMENTS; None: "even"

    @property
    def precision(self) -> WirePrecision:
        return WIRE_NATIVE if self.wire is None else WirePrecision.parse(self.wire)

    def label(self, varying: tuple[str, ...]) -> str:
        parts = [str(getattr(self, name)) for name in varying]
        return " ".join(parts) or "base"


def _count_full(ratio: str, num_layers: int, placement: Placement, where: Where) -> list[bool]:
    """Which blocks are full attention for ``ratio`` over ``num_layers`` blocks."""
    if ratio == "all-linear":
        return [False] * num_layers
    if ratio == "all-full":
        return [True] * num_layers
    match = _RATIO.fullmatch(ratio)
    if not match or int(match[1]) < 1:
        raise where.error(
            f"{ratio!r} is not a ratio: use 'R:1' (R ≥ 1), 'all-linear' or 'all-full'"
        )
    period = int(match[1]) + 1
    if placement is Placement.PERIODIC and num_layers % period:
        raise where.error(
            f"{ratio} needs a multiple of {period} blocks, the layout has {num_layers} "
            '(or set model.placement = "kimi": full attention also in the last block)'
        )
    last = placement is Placement.KIMI
    return [(i + 1) % period == 0 or (last and i == num_layers - 1) for i in range(num_layers)]


def _base_kinds(cfg: ModelConfig) -> tuple[LayerKind | None, LayerKind | None]:
    linear = next((k for k in cfg.layers if k.is_linear), None)
    full = next((k for k in cfg.layers if not k.is_linear), None)
    return linear, full


@dataclass(frozen=True)
class Sweep:
    path: Path
    model: ModelSpec
    axes: Axes
    full_attention: FullAttention
    deployment: SweepDeployment
    toy: ToySpec
    quick: ToySpec
    large: ToySpec | None = None  # [toy.large], for users with time

    def toy_setting(self, name: str) -> ToySpec:
        """``[toy]`` ("default"), ``[toy.quick]`` ("quick") or ``[toy.large]`` ("large")."""
        if name == "quick":
            return self.quick
        if name == "large":
            if self.large is None:
                raise Where(str(self.path), "toy.large").error("the sweep has no [toy.large]")
            return self.large
        return self.toy

    @property
    def plan_path(self) -> Path:
        return self.path.parent / self.deployment.plan

    @property
    def varying(self) -> tuple[str, ...]:
        """The axes with more than one value (they label the points)."""
        names = [f.name for f in dataclasses.fields(Axes)]
        return tuple(n for n in names if len(getattr(self.axes, n)) > 1) or ("ratio",)

    def points(self) -> list[Point]:
        names = [f.name for f in dataclasses.fields(Axes)]
        values = [getattr(self.axes, n) or (None,) for n in names]
        return [Point(*combo) for combo in itertools.product(*values)]

    def _where(self, key: str, value: object) -> Where:
        where = Where(str(self.path), f"axes.{key}")
        values = getattr(self.axes, key)
        return where.item(values.index(value)) if value in values else where

    def _pattern(self, base: ModelConfig, point: Point, num_layers: int) -> tuple[LayerKind, ...]:
        linear, full = _base_kinds(base)
        linear = point.linear_mixer or linear
        full = point.full_mixer or full
        if point.ratio is None:
            if num_layers != base.num_layers:  # the toy: the base's share of full layers
                raise Where(str(self.path), "axes.ratio").error("a toy layout needs a ratio")
            full_at = [not k.is_linear for k in base.layers]
        else:
            where = self._where("ratio", point.ratio)
            full_at = _count_full(point.ratio, num_layers, self.model.placement, where)
        if point.placement in ("early", "late"):  # the same count of full blocks, moved
            count = sum(full_at)
            full_at = [i < count for i in range(num_layers)]
            if point.placement == "late":
                full_at.reverse()
        if linear is None and not all(full_at):
            raise Where(str(self.path), "axes.linear_mixer").error(
                f"{base.name} has no linear layers; name one (kda, gdn, lightning)"
            )
        if full is None and any(full_at):
            raise Where(str(self.path), "axes.full_mixer").error(
                f"{base.name} has no full-attention layers; name one (mla, gqa, swa)"
            )
        return tuple(full if f else linear for f in full_at)

    def _check_kinds(self, point: Point) -> None:
        if point.linear_mixer is not None and point.linear_mixer not in LINEAR_KINDS:
            raise self._where("linear_mixer", point.linear_mixer).error(
                f"{point.linear_mixer} is not a linear mixer (kda, gdn, lightning)"
            )
        if point.full_mixer is not None and point.full_mixer not in FULL_KINDS:
            raise self._where("full_mixer", point.full_mixer).error(
                f"{point.full_mixer} is not a full-attention mixer (mla, gqa, swa)"
            )

    def _sections(
        self, cfg: ModelConfig, point: Point, kinds: set[LayerKind], *, toy_of: ModelConfig | None
    ) -> dict:
        """Replacement sections for ``cfg`` with layers of ``kinds`` at ``point``; ``toy_of`` is
        the full-size base when ``cfg`` is the toy base (widths scale by the point's factor)."""

        def scaled(new: int, old: int, toy: int) -> int:
            return new if toy_of is None else max(1, round(toy * new / old))

        changes: dict[str, object] = {}
        if point.state_dtype is not None:
            changes["state_dtype"] = point.state_dtype
        linear = cfg.linear
        if point.linear_heads is not None:
            match = _HEADS.fullmatch(point.linear_heads)
            if not match or min(int(match[1]), int(match[2])) < 1:
                raise self._where("linear_heads", point.linear_heads).error(
                    f"{point.linear_heads!r} is not heads × head dim, e.g. '64x128'"
                )
            ref = (toy_of or cfg).linear
            if ref is None or linear is None:
                raise self._where("linear_heads", point.linear_heads).error(
                    f"{cfg.name} has no [linear] section to change"
                )
            heads = scaled(int(match[1]), ref.num_v_heads, linear.num_v_heads)
            dim = scaled(int(match[2]), ref.v_head_dim, linear.v_head_dim)
            linear = dataclasses.replace(
                linear, num_heads=heads, num_v_heads=heads, head_dim=dim, v_head_dim=dim
            )
        if linear is not None and linear is not cfg.linear:
            changes["linear"] = linear
        if LayerKind.LIGHTNING in kinds and linear.num_heads != linear.num_v_heads:
            raise self._where("linear_mixer", LayerKind.LIGHTNING).error(
                f"lightning needs as many value heads as q/k heads; {cfg.name} has "
                f"{linear.num_heads} and {linear.num_v_heads} (set axes.linear_heads)"
            )
        if point.kv_lora_rank is not None:
            if cfg.mla is None or (toy_of or cfg).mla is None:
                raise self._where("kv_lora_rank", point.kv_lora_rank).error(
                    f"{cfg.name} has no [mla] section to change"
                )
            ref = (toy_of or cfg).mla.kv_lora_rank
            rank = scaled(point.kv_lora_rank, ref, cfg.mla.kv_lora_rank)
            changes["mla"] = dataclasses.replace(cfg.mla, kv_lora_rank=rank)
        for kind, section in ((LayerKind.GQA, "attention"), (LayerKind.SWA, "swa")):
            if kind in kinds and getattr(cfg, section) is None:
                given = getattr(self.full_attention, kind.value)
                if given is None or toy_of is not None:
                    raise self._where("full_mixer", kind).error(
                        f"{cfg.name} has no [{section}] section: give one as "
                        f"[full_attention.{kind.value}] (the toy base needs its own)"
                    )
                changes[section] = given
        if LayerKind.MLA in kinds and cfg.mla is None:
            raise self._where("full_mixer", LayerKind.MLA).error(f"{cfg.name} has no [mla] section")
        if point.swa_window is not None:
            swa = changes.get("swa", cfg.swa)
            if swa is None or LayerKind.SWA not in kinds:
                raise self._where("swa_window", point.swa_window).error("no SWA layers to window")
            changes["swa"] = dataclasses.replace(swa, window=point.swa_window)
        return changes

    def _build(self, cfg: ModelConfig, **changes: object) -> ModelConfig:
        try:
            return dataclasses.replace(cfg, **changes)
        except ConfigError as err:
            raise ConfigError(f"{self.path}: {err}") from None

    def layout(self, base: ModelConfig, point: Point) -> ModelConfig:
        """The point's model at full size: the base with the point's mixers and widths."""
        self._check_kinds(point)
        layers = self._pattern(base, point, base.num_layers)
        sections = self._sections(base, point, set(layers), toy_of=None)
        name = f"{base.name}-" + "-".join(_slug(point))
        return self._build(base, name=name, layers=layers, **sections)

    def toy_layout(
        self, toy: ToySpec, toy_base: ModelConfig, base: ModelConfig, point: Point
    ) -> ModelConfig:
        """The point's model at toy size: ``toy.num_layers`` blocks of ``toy_base``'s widths
        (scaled by the point's widths against ``base``), dense MLPs, the task's vocabulary."""
        self._check_kinds(point)
        if point.ratio is None:
            point = dataclasses.replace(point, ratio=_ratio_of(base))
        if point.linear_mixer is None or point.full_mixer is None:
            linear, full = _base_kinds(base)
            point = dataclasses.replace(
                point,
                linear_mixer=point.linear_mixer or linear,
                full_mixer=point.full_mixer or full,
            )
        layers = self._pattern(toy_base, point, toy.num_layers)
        if toy_base.mlp_dim < 1:
            raise Where(str(self.path), "toy.base").error(f"{toy_base.name} has no dense mlp_dim")
        sections = self._sections(toy_base, point, set(layers), toy_of=base)
        return self._build(
            toy_base,
            name=f"{toy_base.name}-" + "-".join(_slug(point)),
            layers=layers,
            mlps=(MlpKind.DENSE,) * len(layers),
            moe=None,
            vocab_size=toy.vocab_size,
            **sections,
        )


def _ratio_of(cfg: ModelConfig) -> str:
    """The base's own ratio, as a toy layout needs one."""
    num_full = sum(not k.is_linear for k in cfg.layers)
    if num_full == 0:
        return "all-linear"
    if num_full == cfg.num_layers:
        return "all-full"
    return f"{round((cfg.num_layers - num_full) / num_full)}:1"


def _slug(point: Point) -> list[str]:
    parts = []
    for value_ in dataclasses.astuple(point):
        if value_ is not None:
            parts.append(str(value_).replace(":", "to"))
    return parts or ["base"]


def load_sweep(path: str | Path) -> Sweep:
    """Reads a sweep TOML (module docstring); every mistake is a `ConfigError` naming the key."""
    path = Path(path)
    where = Where(str(path))
    (doc,) = split(read(path, "codesign sweep"), where, SECTIONS)
    model = value(doc, "model", ModelSpec, where)
    axes = value(doc, "axes", Axes, where, default=Axes())
    full_attention = value(doc, "full_attention", FullAttention, where, default=FullAttention())
    deployment = value(doc, "deployment", SweepDeployment, where)
    toy_table = value(doc, "toy", dict, where, default={})
    toy_where = where.at("toy")
    toy_keys, settings = split(toy_table, toy_where, keys_of(ToySpec), ("quick", "large"))
    toy = build(ToySpec, toy_keys, toy_where)
    named = {}
    for name in ("quick", "large"):
        table = value(settings, name, dict, toy_where, default=None)
        if table is None:
            continue
        split(table, toy_where.at(name), keys_of(ToySpec))  # unknown keys name toy.<setting>
        named[name] = build(ToySpec, {**toy_keys, **table}, toy_where.at(name))
    quick = named.get("quick", toy)
    if not (path.parent / deployment.plan).is_file():
        raise where.at("deployment.plan").error(f"no plan file {path.parent / deployment.plan}")
    return Sweep(path, model, axes, full_attention, deployment, toy, quick, named.get("large"))
