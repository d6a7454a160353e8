"""Prefill hardware and its T_prefill profiles: `load_hardware(name_or_path) -> Hardware`.

Also exposes `MeasuredPrefill` (a profile file), `PrefillTime` and `PrefillSource` (measured,
interpolated, extrapolated or estimated).

A hardware file (``configs/hardware/<name>.toml``) describes one prefill instance and how long it
takes to prefill ``l`` tokens of a model, in one of two ways:

- **measured**: a profile file named in ``prefill_profiles`` holds T_prefill at a few lengths for
  one model (e.g. the paper's Table 5 for ``prfaas-1t``, or what `prfaas profile` timed); other
  lengths are interpolated linearly between the points and extrapolated along the end segments
  (`policy.profiles.Profile.table`). A profile may instead be a fitted polynomial (``coeffs``,
  e.g. the case study's derived H20 profile) and may add decode step times per batch size;
- **estimate** (labelled as such): from the counted FLOPs of `prefill_cost.prefill_flops`,

      T_prefill(l) ≈ overhead_s + FLOPs(l) / (num_gpus · peak_tflops · 10¹² · efficiency).

Hardware keys: ``name``, ``num_gpus``, ``peak_tflops`` (per GPU), ``efficiency`` (0, 1],
``overhead_s``, ``prefill_profiles`` (paths relative to the file). Profile keys: ``model``,
``source``, and ``lengths`` + ``prefill_s`` or ``coeffs`` (T(l) = Σ c_k l^k); optionally
``decode_batch_sizes`` + ``decode_step_s``. `Hardware.prefill_profile(cfg)` is T_prefill as a
`Profile` for the planner: the measured one, or the estimate as a polynomial in l. An unknown or
missing key, a value of the wrong type or out of range is a `ConfigError` naming the file and
the key (`toml_config`).
"""

from __future__ import annotations

import enum
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.prefill_cost import flop_profile, prefill_flops
from prfaas_jax.policy.profiles import Profile
from prfaas_jax.toml_config import Where, build, keys_of, read, resolve, split, toml_key, value


class PrefillSource(enum.StrEnum):
    """Where a T_prefill value comes from."""

    MEASURED = "measured"  # a point of the measured table
    INTERPOLATED = "interpolated"  # between two measured points
    EXTRAPOLATED = "extrapolated"  # along an end segment of the measured table
    ESTIMATE = "estimate"  # counted FLOPs at the hardware's achieved rate


def _in_range(key: str, number: float, low: float, high: float) -> None:
    if not low <= number <= high:
        raise ConfigError(f"{key}: must be a number in [{low:g}, {high:g}], got {number!r}")


@dataclass(frozen=True)
class MeasuredPrefill:
    """Measured T_prefill of one model: a table or a fitted polynomial (a profile file), and
    optionally decode step times by batch size."""

    model: str
    source: str
    lengths: tuple[int, ...] = ()
    seconds: tuple[float, ...] = field(default=(), metadata=toml_key("prefill_s"))
    coeffs: tuple[float, ...] = ()  # T(l) = Σ coeffs[k]·l^k, instead of a table
    decode_batch_sizes: tuple[int, ...] = ()
    decode_step_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for key in ("model", "source"):
            if not getattr(self, key):
                raise ConfigError(f"{key}: must be a non-empty string")
        if self.coeffs:
            if self.lengths or self.seconds:
                raise ConfigError("coeffs: give either coeffs or lengths and prefill_s")
        else:
            _check_table("lengths", self.lengths, "prefill_s", self.seconds)
        if self.decode_batch_sizes or self.decode_step_s:
            _check_table(
                "decode_batch_sizes", self.decode_batch_sizes, "decode_step_s", self.decode_step_s
            )

    @property
    def profile(self) -> Profile:
        if self.coeffs:
            return Profile.polynomial(self.coeffs)
        return Profile.table(self.lengths, self.seconds)


def _check_table(x_key: str, xs: tuple[int, ...], y_key: str, ys: tuple[float, ...]) -> None:
    if not all(x > 0 for x in xs):
        raise ConfigError(f"{x_key}: must be positive")
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise ConfigError(f"{x_key}: must increase strictly")
    if not len(ys) == len(xs) >= 2:
        raise ConfigError(f"{y_key}: must list one time per entry of {x_key} (at least two)")
    for seconds in ys:
        _in_range(y_key, seconds, 1e-9, 1e6)


@dataclass(frozen=True)
class PrefillTime:
    seconds: float
    source: PrefillSource


@dataclass(frozen=True)
class Hardware:
    """One prefill instance (a hardware file; `prefill_profiles` fill `measured`)."""

    name: str
    num_gpus: int
    peak_tflops: float  # dense BF16 per GPU
    efficiency: float  # achieved fraction of the peak during prefill
    overhead_s: float  # length-independent cost of one prefill request
    measured: dict[str, MeasuredPrefill] = field(default_factory=dict)  # by model name

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ConfigError(f"num_gpus: must be a positive integer, got {self.num_gpus}")
        _in_range("peak_tflops", self.peak_tflops, 1e-9, 1e6)
        _in_range("efficiency", self.efficiency, 1e-9, 1.0)
        _in_range("overhead_s", self.overhead_s, 0.0, 1e3)

    def estimate_s(self, cfg: ModelConfig, length: int) -> float:
        rate = self.num_gpus * self.peak_tflops * 1e12 * self.efficiency
        return self.overhead_s + prefill_flops(cfg, length) / rate

    def prefill_time(self, cfg: ModelConfig, length: int, *, estimate: bool = False) -> PrefillTime:
        """T_prefill(length): the measured profile of ``cfg.name`` if any, else the estimate."""
        table = None if estimate else self.measured.get(cfg.name)
        if table is None:
            return PrefillTime(self.estimate_s(cfg, length), PrefillSource.ESTIMATE)
        if table.coeffs or length in table.lengths:
            source = PrefillSource.MEASURED
        elif table.lengths[0] < length < table.lengths[-1]:
            source = PrefillSource.INTERPOLATED
        else:
            source = PrefillSource.EXTRAPOLATED
        return PrefillTime(table.profile(length), source)

    def prefill_profile(
        self, cfg: ModelConfig, *, estimate: bool = False
    ) -> tuple[Profile, PrefillSource]:
        """T_prefill(l) of ``cfg`` as a `Profile`: the measured one (MEASURED), or the estimate
        overhead_s + FLOPs(l) / rate as a piecewise polynomial (ESTIMATE)."""
        table = None if estimate else self.measured.get(cfg.name)
        if table is not None:
            return table.profile, PrefillSource.MEASURED
        rate = self.num_gpus * self.peak_tflops * 1e12 * self.efficiency
        flops = flop_profile(cfg)
        pieces = tuple(
            (self.overhead_s + piece[0] / rate, *(c / rate for c in piece[1:]))
            for piece in flops.coeffs
        )
        return Profile(knots=flops.knots, coeffs=pieces), PrefillSource.ESTIMATE


def load_measured(path: str | os.PathLike[str]) -> MeasuredPrefill:
    """A prefill profile file (module docstring)."""
    path = Path(path)
    return build(MeasuredPrefill, read(path, "prefill profile"), Where(str(path)))


def load_hardware(name_or_path: str | os.PathLike[str]) -> Hardware:
    """A hardware file by name (``configs/hardware/<name>.toml``) or by path."""
    path = resolve("hardware", name_or_path)
    where = Where(str(path))
    doc, profiles = split(
        read(path, "hardware file"), where, keys_of(Hardware, "measured"), ("prefill_profiles",)
    )
    paths = value(profiles, "prefill_profiles", tuple[str, ...], where)
    measured = {m.model: m for m in (load_measured(path.parent / p) for p in paths)}
    return build(Hardware, doc, where, measured=measured)
