"""`prfaas codesign`: every point of a sweep on the wire, on the cluster and in recall —
`run_codesign(...) -> list[CodesignRow]`.

For each point of a `Sweep` (planning/codesign_config.py):

- **wire side, full size**: S_kv(l) of the point's layout from the state the real prefill returns
  (abstract evaluation, done by the caller's ``measure``: engine/kvsize.py), checked against the
  byte formula; T_prefill(l) on each cluster is the plan's profile of the base layout carried
  over to the point by counted FLOPs, term by term (`prefill_cost.scale_profile`); Φ_kv(l) =
  S_kv(l) / T_prefill(l) (Eq. 1) at the sweep's ``kv_lengths``;
- **cluster side**: the planner's search (`policy.search.search`, the code path of `prfaas plan`)
  on the sweep's plan file with the point's S_kv and T_prefill profiles: t*, N_prfaas / N_p /
  N_d, Λ_max, the speed-ups over homogeneous PD and naive heterogeneous, the egress used, and
  Eq. 2's egress per PrfaaS instance, E[S_kv | L > t*] / E[T_prefill | L > t*];
- **model side, toy size**: the caller's ``recall`` trains the point's toy layout once
  (train/recall_probe.py) and returns held-out accuracy per evaluation length and validation
  accuracy; each toy layout is trained at every learning rate of the toy's grid and at
  ``seeds`` seeds (planning/recall_runs.py), its recall the mean over seeds with a Student-t
  interval. Points whose toy layouts are equal share their runs. A ``budget_min`` caps the
  training time: the plan (``RecallSchedule``) is told first, checked after the first run.

- **exposed transfer**: the layer-wise emission model fed one group per layer
  (planning/codesign_emission.py) at the longest of ``kv_lengths``, on the PrfaaS hardware, over
  one PrfaaS instance's share of the link at the optimum (egress / N_prfaas): the seconds of
  transfer the prefill does not hide. It is what the ``placement`` axis moves. With an
  ``emission`` callable (a sweep with a ``placement`` axis) the toy layout's layer-wise prefill
  is timed too (engine/emission_timing.py), and the same model gives its exposed transfer on a
  link of the toy's Φ_kv = S_kv / T_prefill (Eq. 1: just fast enough on average).

A point's ``wire`` precision (the ``wire`` axis) is not a layout: its S_kv is the layout's state
as it crosses the link in that precision (``state_nbytes(layout, l, precision)``, which the
codec's frames carry exactly), the plan is searched with it, and its recall is the trained toy's
with each evaluation example's context state shipped in that precision (``shipped``).

This module stays free of JAX: the two measurements are passed in as callables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prfaas_jax.config import LayerKind, ModelConfig
from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.codesign_config import Point, Sweep, ToySpec
from prfaas_jax.planning.codesign_emission import measured_exposed_s, modelled_exposed_s
from prfaas_jax.planning.kv_report import SizeLike
from prfaas_jax.planning.paper_tables import MIB, kv_gbps
from prfaas_jax.planning.plan_config import PlanConfig, load_plan_config
from prfaas_jax.planning.prefill_cost import scale_profile
from prfaas_jax.planning.recall_runs import RecallSchedule, SeededRecall, seeded_recall
from prfaas_jax.planning.recall_stats import Interval, mean_interval
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.policy.search import Plan, search
from prfaas_jax.policy.throughput_model import mib_per_s_to_gbps
from prfaas_jax.state_bytes import layer_nbytes
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision


class RecallLike(Protocol):
    """What `run_codesign` reads from train/recall_probe.py's `RecallResult`."""

    accuracy: Mapping[int, float]  # held-out accuracy by evaluation length
    seconds: float
    validation: float  # accuracy on the validation split (chooses the learning rate)


# (layout, lengths, trace): sizes at each length; ``trace`` runs the abstract prefill too.
Measure = Callable[[ModelConfig, Sequence[int], bool], Sequence[SizeLike]]
# (toy layout, toy spec at the run's seed and learning rate): one training run.
Recall = Callable[[ModelConfig, ToySpec], RecallLike]
# (toy layout, prompt length): seconds of each layer of a layer-wise prefill, in order.
Emission = Callable[[ModelConfig, int], Sequence[float]]
# (toy layout, toy spec, its trained result, precision): recall with the state shipped in it.
Shipped = Callable[[ModelConfig, ToySpec, RecallLike, WirePrecision], RecallLike]
Say = Callable[[str], None]


@dataclass(frozen=True)
class WireSize:
    """A layout's state at one length as it crosses the link in a precision (a `SizeLike`), by
    the byte formula."""

    length: int
    formula_bytes: int
    growing_bytes: int
    windowed_bytes: int
    fixed_bytes: int
    by_kind: dict[str, int]
    measured_bytes: int | None = None

    @property
    def serialized_bytes(self) -> int:
        return self.formula_bytes

    @classmethod
    def of(cls, cfg: ModelConfig, length: int, precision: WirePrecision) -> WireSize:
        growing = windowed = fixed = 0
        by_kind: dict[str, int] = {}
        for kind in cfg.layers:
            nbytes = layer_nbytes(cfg, kind, length, precision)
            by_kind[kind.value] = by_kind.get(kind.value, 0) + nbytes
            if kind is LayerKind.SWA:
                windowed += nbytes
            elif kind.is_linear:
                fixed += nbytes
            else:
                growing += nbytes
        return cls(length, growing + windowed + fixed, growing, windowed, fixed, by_kind)


@dataclass(frozen=True)
class CodesignRow:
    point: Point
    label: str
    layout: ModelConfig
    kv: tuple[SizeLike, ...]  # at the sweep's kv_lengths
    kv_profile: Profile  # S_kv(l) in MiB
    prfaas_prefill_s: Profile
    local_prefill_s: Profile
    plan: Plan
    plan_config: PlanConfig
    toy: ModelConfig | None = None
    recall: SeededRecall | None = None
    recall_shared_with: str | None = None  # the label of the point whose toy run this reuses
    precision: WirePrecision = WIRE_NATIVE  # how the state crosses the link
    toy_layer_s: tuple[float, ...] | None = None  # the toy's layer-wise prefill, timed
    emission_length: int = 0  # the prompt length it was timed at

    def toy_exposed(self) -> tuple[float, float] | None:
        """The toy's exposed transfer and prefill seconds, from its timed layers (None untimed)."""
        if self.toy_layer_s is None or self.toy is None:
            return None
        exposed = measured_exposed_s(
            self.toy, self.emission_length, self.toy_layer_s, self.precision
        )
        return exposed, sum(self.toy_layer_s)

    @property
    def link_share_gbps(self) -> float:
        """One PrfaaS instance's share of the link at the optimum: egress / N_prfaas."""
        return self.plan_config.model.deployment.egress_gbps / max(1, self.plan.best.num_prfaas)

    def exposed_s(self, length: int) -> float:
        """Transfer left when the prefill of ``length`` tokens ends, layer-wise, on one PrfaaS
        instance's share of the link (planning/codesign_emission.py)."""
        return modelled_exposed_s(
            self.layout,
            length,
            self.prfaas_prefill_s(length),
            self.link_share_gbps,
            self.precision,
        )

    @property
    def bytes_per_token(self) -> int:
        """Growing bytes per token (full-attention caches; 0 without them)."""
        first, last = self.kv[0], self.kv[-1]
        if first.length == last.length:
            return 0
        return (last.growing_bytes - first.growing_bytes) // (last.length - first.length)

    @property
    def fixed_bytes(self) -> int:
        return self.kv[-1].fixed_bytes

    @property
    def egress_per_instance_gbps(self) -> float:
        """Eq. 2 per PrfaaS instance at t*: E[S_kv | L > t*] / E[T_prefill | L > t*]."""
        routing = self.plan.best.routing
        if not routing.kv_mib or not routing.prfaas_prefill_s:
            return 0.0
        return mib_per_s_to_gbps(routing.kv_mib / routing.prfaas_prefill_s)

    def kv_gbps(self, size: SizeLike) -> float:
        """Φ_kv at one length on the PrfaaS hardware (Eq. 1)."""
        return kv_gbps(size.formula_bytes, self.prfaas_prefill_s(size.length))


def kv_profile_lengths(cfg: ModelConfig, kv_lengths: Sequence[int]) -> tuple[int, ...]:
    """Lengths at which S_kv(l), piecewise linear (a knot at an SWA window), is pinned down:
    1, the window, and the longest length of interest."""
    window = cfg.swa.window if cfg.swa is not None and LayerKind.SWA in cfg.layers else 0
    top = max(max(kv_lengths), 2 * window, 2)
    return tuple(sorted({1, top, *([window] if 1 < window < top else [])}))


def kv_profile_from_sizes(sizes: Sequence[SizeLike]) -> Profile:
    """S_kv(l) in MiB through the measured sizes (exact: S_kv is linear between them)."""
    for size in sizes:
        if size.measured_bytes is not None and size.measured_bytes != size.formula_bytes:
            raise ConfigError(
                f"the state the prefill returns at {size.length} tokens has "
                f"{size.measured_bytes:,} B, the formula says {size.formula_bytes:,} B (a bug)"
            )
    nbytes = [s.formula_bytes if s.measured_bytes is None else s.measured_bytes for s in sizes]
    return Profile.table([s.length for s in sizes], [b / MIB for b in nbytes])


def _plan_for(
    sweep: Sweep, base_plan: PlanConfig, base: ModelConfig, layout: ModelConfig, kv: Profile
) -> tuple[PlanConfig, Profile, Profile]:
    deployment = base_plan.model.deployment
    try:
        prfaas_s = scale_profile(deployment.prfaas.prefill_s, base, layout)
        local_s = scale_profile(deployment.local.prefill_s, base, layout)
    except ValueError as err:
        raise ConfigError(f"{sweep.path}: model.base: {err}") from None
    config = base_plan.with_profiles(
        kv_size_mib=kv, prfaas_prefill_s=prfaas_s, local_prefill_s=local_s
    )
    return config, prfaas_s, local_s


def run_codesign(
    sweep: Sweep,
    base: ModelConfig,
    *,
    measure: Measure,
    recall: Recall | None = None,
    shipped: Shipped | None = None,
    toy_base: ModelConfig | None = None,
    toy: ToySpec | None = None,
    say: Say | None = None,
    seeds: int = 1,
    budget_min: float | None = None,
    tell: Say | None = None,
    emission: Emission | None = None,
) -> list[CodesignRow]:
    """Every point of ``sweep`` (module docstring); ``recall`` None skips the toy side;
    ``shipped`` gives the recall of points with a wire precision other than native; ``tell``
    hears the plan of training runs (and the budget's verdict after the first)."""
    base_plan = load_plan_config(sweep.plan_path, egress_gbps=sweep.deployment.egress_gbps)
    if base_plan.model.deployment.prfaas is None:
        raise ConfigError(f"{sweep.plan_path}: the plan has no [prfaas] cluster")
    toy = toy or sweep.toy
    points = sweep.points()
    layouts = [sweep.layout(base, point) for point in points]
    toys = (
        [sweep.toy_layout(toy, toy_base, base, point) for point in points]
        if recall is not None and toy_base is not None
        else [None] * len(points)
    )
    layouts_to_train = len({cfg.fingerprint() for cfg in toys if cfg is not None})
    schedule = RecallSchedule(layouts_to_train, len(toy.learning_rates), seeds, budget_min)
    if layouts_to_train and tell is not None:
        tell(schedule.plan())
    trained: dict[str, tuple[str, SeededRecall]] = {}
    timed: dict[str, tuple[float, ...]] = {}
    through_wire: dict[tuple[str, str], SeededRecall] = {}
    rows = []
    for index, (point, layout, toy_cfg) in enumerate(zip(points, layouts, toys, strict=True)):
        label = point.label(sweep.varying)
        if say is not None:
            say(f"[{index + 1}/{len(points)}] {label}: state sizes and plan")
        lengths = kv_profile_lengths(layout, sweep.deployment.kv_lengths)
        # One trace per layout (its cost does not depend on the length): at the longest length,
        # where it must equal the formula; the formula gives the profile's other points.
        traced = measure(layout, lengths[-1:], True)
        kv = kv_profile_from_sizes([*measure(layout, lengths[:-1], False), *traced])
        kv_rows = tuple(measure(layout, sweep.deployment.kv_lengths, False))
        precision = point.precision
        if not precision.is_native:  # the state as it crosses the link
            kv = kv_profile_from_sizes([WireSize.of(layout, n, precision) for n in lengths])
            kv_rows = tuple(WireSize.of(layout, n, precision) for n in sweep.deployment.kv_lengths)
        config, prfaas_s, local_s = _plan_for(sweep, base_plan, base, layout, kv)
        plan = search(config.model, config.baseline, thresholds=config.thresholds)
        result, shared = None, None
        if toy_cfg is not None:
            key = toy_cfg.fingerprint()
            if key in trained:
                shared, result = trained[key]
            else:
                prefix = f"[{index + 1}/{len(points)}] {label}"
                train = _counted(recall, schedule, prefix, say, tell)
                result = seeded_recall(train, toy_cfg, toy, schedule)
                trained[key] = (label, result)
            if not precision.is_native:
                if shipped is None:
                    raise ConfigError(f"{sweep.path}: axes.wire needs a shipped-state recall")
                wire_key = (key, str(precision))
                if wire_key not in through_wire:
                    if say is not None:
                        say(f"[{index + 1}/{len(points)}] {label}: recall through the wire")
                    through_wire[wire_key] = result.map(
                        lambda spec, run, cfg=toy_cfg, p=precision: shipped(cfg, spec, run, p)
                    )
                result = through_wire[wire_key]
        layer_s = None
        if toy_cfg is not None and emission is not None:
            key = toy_cfg.fingerprint()
            if key not in timed:
                if say is not None:
                    say(f"[{index + 1}/{len(points)}] {label}: timing layer-wise emission")
                timed[key] = tuple(emission(toy_cfg, toy.emission_length))
            layer_s = timed[key]
        rows.append(
            CodesignRow(
                point=point,
                label=label,
                layout=layout,
                kv=kv_rows,
                kv_profile=kv,
                prfaas_prefill_s=prfaas_s,
                local_prefill_s=local_s,
                plan=plan,
                plan_config=config,
                toy=toy_cfg,
                recall=result,
                recall_shared_with=shared,
                precision=precision,
                toy_layer_s=layer_s,
                emission_length=toy.emission_length if layer_s is not None else 0,
            )
        )
    return rows


def _counted(
    recall: Recall, schedule: RecallSchedule, prefix: str, say: Say | None, tell: Say | None
) -> Recall:
    """``recall`` that shows which run of the schedule it is and, after the sweep's first run,
    tells the schedule's verdict on the budget."""

    def train(toy_cfg: ModelConfig, spec: ToySpec) -> RecallLike:
        if say is not None:
            say(
                f"{prefix}: run {schedule.done + 1}/{schedule.runs()} {toy_cfg.name} "
                f"lr {spec.lr:g} seed {spec.seed}"
            )
        result = recall(toy_cfg, spec)
        schedule.done += 1
        if schedule.done == 1:
            verdict = schedule.first_run(result.seconds)
            if tell is not None:
                tell(verdict)
        return result

    return train


def recall_interval(row: CodesignRow) -> Interval | None:
    """The 95 % interval of `mean_recall` over the seeds: each seed's held-out accuracy
    averaged over the evaluation lengths, then their Student-t interval; None below two
    seeds."""
    runs = row.recall.runs if row.recall is not None else ()
    if len(runs) < 2:
        return None
    return mean_interval([sum(run.accuracy.values()) / len(run.accuracy) for run in runs])


def mean_recall(row: CodesignRow) -> float:
    """Held-out accuracy averaged over the evaluation lengths (NaN without a toy run)."""
    if row.recall is None:
        return math.nan
    values = list(row.recall.accuracy.values())
    return sum(values) / len(values)
