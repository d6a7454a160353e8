"""Prefill hardware and its T_prefill profiles: `load_hardware(name_or_path) -> Hardware`.

Also exposes `MeasuredPrefill` (a profile file), `PrefillTime` and `PrefillSource` (measured,
interpolated, extrapolated or estimated).

A hardware file (``configs/hardware/<name>.toml``) describes one prefill instance and how long it
takes to prefill ``l`` tokens of a model, in one of two ways:

- **measured**: a profile file named in ``prefill_profiles`` holds T_prefill at a few lengths for
  one model (e.g. the paper's Table 5 for ``prfaas-1t``); other lengths are interpolated linearly
  between the points and extrapolated along the end segments (`policy.profiles.Profile.table`);
- **estimate** (labelled as such): from the counted FLOPs of `prefill_cost.prefill_flops`,

      T_prefill(l) ≈ overhead_s + FLOPs(l) / (num_gpus · peak_tflops · 10¹² · efficiency).

Hardware keys: ``name``, ``num_gpus``, ``peak_tflops`` (per GPU), ``efficiency`` (0, 1],
``overhead_s``, ``prefill_profiles`` (paths relative to the file). Profile keys: ``model``,
``source``, ``lengths``, ``prefill_s``. An unknown or missing key, a value of the wrong type or
out of range is a `ConfigError` naming the file and the key (`toml_config`).
"""

from __future__ import annotations

import enum
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.prefill_cost import prefill_flops
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
    """Measured T_prefill of one model at a few lengths (a profile file)."""

    model: str
    source: str
    lengths: tuple[int, ...]
    seconds: tuple[float, ...] = field(metadata=toml_key("prefill_s"))

    def __post_init__(self) -> None:
        for key in ("model", "source"):
            if not getattr(self, key):
                raise ConfigError(f"{key}: must be a non-empty string")
        if not all(length > 0 for length in self.lengths):
            raise ConfigError("lengths: must be positive token counts")
        if any(b <= a for a, b in itertools.pairwise(self.lengths)):
            raise ConfigError("lengths: must increase strictly")
        if not len(self.seconds) == len(self.lengths) >= 2:
            raise ConfigError("prefill_s: must list one time per length (at least two)")
        for seconds in self.seconds:
            _in_range("prefill_s", seconds, 1e-9, 1e6)

    @property
    def profile(self) -> Profile:
        return Profile.table(self.lengths, self.seconds)


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
        if length in table.lengths:
            source = PrefillSource.MEASURED
        elif table.lengths[0] < length < table.lengths[-1]:
            source = PrefillSource.INTERPOLATED
        else:
            source = PrefillSource.EXTRAPOLATED
        return PrefillTime(table.profile(length), source)


def _measured(path: Path) -> MeasuredPrefill:
    return build(MeasuredPrefill, read(path, "prefill profile"), Where(str(path)))


def load_hardware(name_or_path: str | os.PathLike[str]) -> Hardware:
    """A hardware file by name (``configs/hardware/<name>.toml``) or by path."""
    path = resolve("hardware", name_or_path)
    where = Where(str(path))
    doc, profiles = split(
        read(path, "hardware file"), where, keys_of(Hardware, "measured"), ("prefill_profiles",)
    )
    paths = value(profiles, "prefill_profiles", tuple[str, ...], where)
    measured = {m.model: m for m in (_measured(path.parent / p) for p in paths)}
    return build(Hardware, doc, where, measured=measured)
