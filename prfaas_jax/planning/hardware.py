"""Prefill hardware and its T_prefill profiles: `load_hardware(name_or_path) -> Hardware`.

A hardware file (``configs/hardware/<name>.toml``) describes one prefill instance and how long it
takes to prefill ``l`` tokens of a model, in one of two ways:

- **measured**: a profile file named in ``prefill_profiles`` holds T_prefill at a few lengths for
  one model (e.g. the paper's Table 5 for ``prfaas-1t``); other lengths are interpolated linearly
  between the points and extrapolated along the end segments (`policy.profiles.Profile.table`);
- **estimate** (labelled as such): from the counted FLOPs of `prefill_cost.prefill_flops`,

      T_prefill(l) ≈ overhead_s + FLOPs(l) / (num_gpus · peak_tflops · 10¹² · efficiency).

Hardware keys: ``name``, ``num_gpus``, ``peak_tflops`` (per GPU), ``efficiency`` (0, 1],
``overhead_s``, ``prefill_profiles`` (paths relative to the file). Profile keys: ``model``,
``source``, ``lengths``, ``prefill_s``. Unknown or missing keys raise `ConfigError`.
"""

from __future__ import annotations

import itertools
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prfaas_jax.config import ModelConfig, config_dir
from prfaas_jax.errors import ConfigError
from prfaas_jax.planning.prefill_cost import prefill_flops
from prfaas_jax.policy.profiles import Profile


@dataclass(frozen=True)
class MeasuredPrefill:
    """Measured T_prefill of one model at a few lengths."""

    model: str
    source: str
    lengths: tuple[int, ...]
    seconds: tuple[float, ...]

    @property
    def profile(self) -> Profile:
        return Profile.table(self.lengths, self.seconds)


@dataclass(frozen=True)
class PrefillTime:
    seconds: float
    source: str  # "measured", "interpolated", "extrapolated" (from a measured table), "estimate"


@dataclass(frozen=True)
class Hardware:
    name: str
    num_gpus: int
    peak_tflops: float  # dense BF16 per GPU
    efficiency: float  # achieved fraction of the peak during prefill
    overhead_s: float  # length-independent cost of one prefill request
    measured: dict[str, MeasuredPrefill] = field(default_factory=dict)  # by model name

    def estimate_s(self, cfg: ModelConfig, length: int) -> float:
        rate = self.num_gpus * self.peak_tflops * 1e12 * self.efficiency
        return self.overhead_s + prefill_flops(cfg, length) / rate

    def prefill_time(self, cfg: ModelConfig, length: int, *, estimate: bool = False) -> PrefillTime:
        """T_prefill(length): the measured profile of ``cfg.name`` if any, else the estimate."""
        table = None if estimate else self.measured.get(cfg.name)
        if table is None:
            return PrefillTime(self.estimate_s(cfg, length), "estimate")
        if length in table.lengths:
            source = "measured"
        elif table.lengths[0] < length < table.lengths[-1]:
            source = "interpolated"
        else:
            source = "extrapolated"
        return PrefillTime(table.profile(length), source)


def _read(path: Path, what: str) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def _only(doc: dict[str, Any], path: Path, keys: tuple[str, ...]) -> None:
    unknown = sorted(set(doc) - set(keys))
    missing = sorted(set(keys) - set(doc))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; expected {list(keys)}")
    if missing:
        raise ConfigError(f"{path}: missing key(s) {missing}")


def _number(value: Any, path: Path, key: str, *, low: float, high: float) -> float:
    """A finite number in [low, high] (bools, strings and NaN are rejected)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise ConfigError(f"{path}: '{key}' must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _measured(path: Path) -> MeasuredPrefill:
    doc = _read(path, "prefill profile")
    _only(doc, path, ("model", "source", "lengths", "prefill_s"))
    for key in ("model", "source"):
        if not isinstance(doc[key], str) or not doc[key]:
            raise ConfigError(f"{path}: '{key}' must be a non-empty string")
    lengths, seconds = doc["lengths"], doc["prefill_s"]
    if not (isinstance(lengths, list) and all(type(x) is int and x > 0 for x in lengths)):
        raise ConfigError(f"{path}: 'lengths' must be a list of positive token counts")
    if any(b <= a for a, b in itertools.pairwise(lengths)):
        raise ConfigError(f"{path}: 'lengths' must increase strictly")
    if not (isinstance(seconds, list) and len(seconds) == len(lengths) >= 2):
        raise ConfigError(f"{path}: 'prefill_s' must list one time per length (at least two)")
    times = tuple(_number(t, path, "prefill_s", low=1e-9, high=1e6) for t in seconds)
    return MeasuredPrefill(doc["model"], doc["source"], tuple(lengths), times)


def load_hardware(name_or_path: str | os.PathLike[str]) -> Hardware:
    """A hardware file by name (``configs/hardware/<name>.toml``) or by path."""
    path = Path(name_or_path)
    if path.suffix != ".toml" and not path.exists():
        path = config_dir() / "hardware" / f"{name_or_path}.toml"
        if not path.exists():
            known = sorted(p.stem for p in (config_dir() / "hardware").glob("*.toml"))
            raise ConfigError(
                f"unknown hardware {str(name_or_path)!r}; files in configs/hardware/: "
                + ", ".join(known)
            )
    doc = _read(path, "hardware file")
    keys = ("name", "num_gpus", "peak_tflops", "efficiency", "overhead_s", "prefill_profiles")
    _only(doc, path, keys)
    num_gpus = doc["num_gpus"]
    if type(num_gpus) is not int or num_gpus < 1:
        raise ConfigError(f"{path}: 'num_gpus' must be a positive integer, got {num_gpus!r}")
    profiles = doc["prefill_profiles"]
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise ConfigError(f"{path}: 'prefill_profiles' must be a list of file paths")
    measured = {m.model: m for m in (_measured(path.parent / p) for p in profiles)}
    return Hardware(
        name=str(doc["name"]),
        num_gpus=num_gpus,
        peak_tflops=_number(doc["peak_tflops"], path, "peak_tflops", low=1e-9, high=1e6),
        efficiency=_number(doc["efficiency"], path, "efficiency", low=1e-9, high=1.0),
        overhead_s=_number(doc["overhead_s"], path, "overhead_s", low=0.0, high=1e3),
        measured=measured,
    )
