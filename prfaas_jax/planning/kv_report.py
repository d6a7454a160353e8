"""`prfaas kv` reports: S_kv, T_prefill and Φ_kv per length for one model or several side by side.

`kv_report(cfg, sizes, hardware)` pairs state sizes (computed by engine/kvsize.py and passed in as
plain objects, so this module stays free of JAX) with T_prefill from a `Hardware` (measured
profile or FLOP estimate) and Eq. 1, Φ_kv = S_kv / T_prefill, with S_kv = ``formula_bytes``. The
formatters turn reports into tables for humans and JSON with stable keys::

    {"model", "hardware", "rows": [{"length", "formula_bytes", "measured_bytes",
     "serialized_bytes", "growing_bytes", "windowed_bytes", "fixed_bytes", "by_kind_bytes",
     "prefill_seconds", "prefill_source", "kv_gbps"}]}

`--compare` wraps one such object per model as ``{"models": [...]}`` and adds ``bytes_ratio`` and
``kv_gbps_ratio`` (to the first model) to every row.

`select_kv` turns the command's flags into a `KvSelection`: which view (one model, ``--compare``
or ``--paper``), which models, which lengths, and whether the real prefill is traced.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.planning.hardware import Hardware, PrefillTime
from prfaas_jax.planning.paper_tables import MIB, TABLE3_GBPS, TABLE5_MODEL, kv_gbps
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.tables import table
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision

PAPER_MODELS = (*TABLE3_GBPS, TABLE5_MODEL)
DEFAULT_LENGTHS = "1K,8K,32K,128K"  # the paper's
MISMATCH = "MISMATCH: the real prefill or the codec disagrees with the formula (a bug)"
_LENGTH = re.compile(r"(\d+)([kKmM]?)")
_UNITS = {"": 1, "k": 2**10, "m": 2**20}


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"1K,8K,32K,128K"`` → (1024, 8192, 32768, 131072); K = 1024 tokens, M = 1024 K."""
    lengths = []
    for part in text.split(","):
        match = _LENGTH.fullmatch(part.strip())
        value = int(match[1]) * _UNITS[match[2].lower()] if match else 0
        if value < 1:
            raise UserError(
                f"--lengths: {part.strip()!r} is not a token count; use positive integers with an "
                "optional K (×1024) or M (×2^20), e.g. --lengths 1K,8K,32K,128K"
            )
        lengths.append(value)
    return tuple(lengths)


def format_length(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else f"{length:,}"


class KvView(enum.StrEnum):
    MODEL = "model"  # one model's full table
    COMPARE = "compare"  # several models side by side, with ratios to the first
    PAPER = "paper"  # the paper's models against its Tables 3 and 5 (planning/kv_vs_paper.py)


@dataclass(frozen=True)
class KvSelection:
    view: KvView
    models: tuple[str, ...]  # preset names or model TOML paths
    lengths: tuple[int, ...]  # prompt lengths in tokens
    measure: bool  # trace the real prefill at every length (engine/kvsize.py)


def select_kv(
    *,
    model: str | None = None,
    compare: str | None = None,
    paper: bool = False,
    lengths: str | None = None,
    measure: bool = True,
) -> KvSelection:
    """What `prfaas kv` reports: ``model``, the comma-separated ``compare`` list (at least two)
    or the ``paper``'s models, at ``lengths`` (default 1K,8K,32K,128K; the paper's only)."""
    if paper:
        if lengths is not None:
            raise UserError("--paper uses the paper's lengths 1K,8K,32K,128K; drop --lengths")
        # The paper's numbers come from the formula; tracing would add minutes and no check.
        return KvSelection(KvView.PAPER, PAPER_MODELS, parse_lengths(DEFAULT_LENGTHS), False)
    parsed = parse_lengths(DEFAULT_LENGTHS if lengths is None else lengths)
    if compare is not None:
        names = tuple(name.strip() for name in compare.split(",") if name.strip())
        if len(names) < 2:
            raise UserError("--compare needs at least two models, e.g. --compare A,B")
        return KvSelection(KvView.COMPARE, names, parsed, measure)
    if model is None:
        raise UserError("say which model: --model, --compare or --paper")
    return KvSelection(KvView.MODEL, (model,), parsed, measure)


class SizeLike(Protocol):
    """What `kv_report` reads from engine/kvsize.py's `StateSize`."""

    length: int
    formula_bytes: int
    measured_bytes: int | None
    serialized_bytes: int
    growing_bytes: int
    windowed_bytes: int
    fixed_bytes: int
    by_kind: dict[str, int]


@dataclass(frozen=True)
class KvRow:
    size: SizeLike
    prefill: PrefillTime
    wire_bytes: int | None = None  # on the wire in the report's precision (None: native only)

    @property
    def kv_gbps(self) -> float:
        return kv_gbps(self.size.formula_bytes, self.prefill.seconds)

    @property
    def wire_kv_gbps(self) -> float | None:
        """Φ_kv of the bytes that cross the link in the report's precision."""
        if self.wire_bytes is None:
            return None
        return kv_gbps(self.wire_bytes, self.prefill.seconds)

    @property
    def consistent(self) -> bool:
        """Measured (if measured) and serialized bytes both equal the formula."""
        size = self.size
        measured_ok = size.measured_bytes in (None, size.formula_bytes)
        return measured_ok and size.serialized_bytes == size.formula_bytes

    def to_json(self) -> dict[str, object]:
        size = self.size
        return {
            "length": size.length,
            "formula_bytes": size.formula_bytes,
            "measured_bytes": size.measured_bytes,
            "serialized_bytes": size.serialized_bytes,
            "growing_bytes": size.growing_bytes,
            "windowed_bytes": size.windowed_bytes,
            "fixed_bytes": size.fixed_bytes,
            "by_kind_bytes": dict(size.by_kind),
            "prefill_seconds": self.prefill.seconds,
            "prefill_source": self.prefill.source,
            "kv_gbps": self.kv_gbps,
            "wire_bytes": self.wire_bytes,
            "wire_kv_gbps": self.wire_kv_gbps,
        }


@dataclass(frozen=True)
class ModelReport:
    cfg: ModelConfig
    hardware: Hardware
    rows: tuple[KvRow, ...]
    precision: WirePrecision = WIRE_NATIVE  # rows' wire_bytes are in this precision

    @property
    def consistent(self) -> bool:
        return all(row.consistent for row in self.rows)

    def row_at(self, length: int) -> KvRow:
        for row in self.rows:
            if row.size.length == length:
                return row
        raise KeyError(f"no row for length {length} in the {self.cfg.name} report")


def kv_report(
    cfg: ModelConfig,
    sizes: Sequence[SizeLike],
    hardware: Hardware,
    *,
    estimate: bool = False,
    precision: WirePrecision = WIRE_NATIVE,
) -> ModelReport:
    """Rows of S_kv, T_prefill (measured profile, or the estimate) and Φ_kv for ``cfg``; with a
    ``precision`` other than native, also the bytes and Φ_kv of the state in it on the wire."""
    rows = tuple(
        KvRow(
            s,
            hardware.prefill_time(cfg, s.length, estimate=estimate),
            None if precision.is_native else state_nbytes(cfg, s.length, precision),
        )
        for s in sizes
    )
    return ModelReport(cfg, hardware, rows, precision)


def report_json(report: ModelReport) -> dict[str, object]:
    return {
        "model": report.cfg.name,
        "hardware": report.hardware.name,
        "wire_precision": str(report.precision),
        "rows": [row.to_json() for row in report.rows],
    }


def compare_json(reports: Sequence[ModelReport]) -> dict[str, object]:
    first = reports[0]
    models = []
    for report in reports:
        entry = report_json(report)
        for row_json, row, base in zip(entry["rows"], report.rows, first.rows, strict=True):
            row_json["bytes_ratio"] = row.size.formula_bytes / base.size.formula_bytes
            row_json["kv_gbps_ratio"] = row.kv_gbps / base.kv_gbps
        models.append(entry)
    return {"models": models}


# --- tables for humans ----------------------------------------------------------------------


def mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.2f}"


def _check(value: int | None, formula: int) -> str:
    if value is None:
        return "not run"
    return "= formula" if value == formula else f"{value:,} B ≠"


def describe(cfg: ModelConfig) -> str:
    counts = {kind.value: cfg.layers.count(kind) for kind in dict.fromkeys(cfg.layers)}
    blocks = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    return (
        f"{cfg.name}: {cfg.num_layers} blocks ({blocks}), {cfg.dtype} caches, "
        f"{cfg.state_dtype} recurrent states"
    )


def describe_hardware(hardware: Hardware) -> str:
    measured = "; ".join(f"{m} from {p.source}" for m, p in hardware.measured.items())
    return (
        f"hardware {hardware.name}: T_prefill measured for {measured or 'no model'}\n"
        f"  other models: estimate = {hardware.overhead_s:g} s + FLOPs / ({hardware.num_gpus} × "
        f"{hardware.peak_tflops:g} TFLOPS × {hardware.efficiency:g})"
    )


def format_report(report: ModelReport) -> str:
    kinds = list(report.rows[0].size.by_kind) if report.rows else []
    header = ["length", "S_kv MiB", "growing", "windowed", "fixed", *kinds]
    header += ["measured", "serialized", "T_prefill s", "source", "Φ_kv Gbps"]
    wire = not report.precision.is_native
    if wire:
        header += ["wire MiB", "÷ S_kv", "wire Φ_kv Gbps"]
    rows = []
    for row in report.rows:
        size = row.size
        on_wire = []
        if wire and row.wire_bytes is not None and row.wire_kv_gbps is not None:
            ratio = row.wire_bytes / size.formula_bytes
            on_wire = [mib(row.wire_bytes), f"{ratio:.3f}", f"{row.wire_kv_gbps:.2f}"]
        rows.append(
            [
                format_length(size.length),
                mib(size.formula_bytes),
                mib(size.growing_bytes),
                mib(size.windowed_bytes),
                mib(size.fixed_bytes),
                *(mib(size.by_kind[kind]) for kind in kinds),
                _check(size.measured_bytes, size.formula_bytes),
                _check(size.serialized_bytes, size.formula_bytes),
                f"{row.prefill.seconds:.3f}",
                row.prefill.source,
                f"{row.kv_gbps:.2f}",
                *on_wire,
            ]
        )
    verdict = "measured == serialized == formula at every length" if report.consistent else MISMATCH
    if wire:
        verdict += (
            f"\nwire: the state on the link in precision {report.precision} "
            "(docs/wire-format.md), and its Φ_kv."
        )
    return "\n".join(
        [
            f"prfaas kv: {describe(report.cfg)}",
            describe_hardware(report.hardware),
            "",
            table(rows, headers=header),
            "",
            "S_kv: canonical state of one sequence in MiB (2^20 B): growing = MLA/GQA caches,",
            "windowed = SWA caches, fixed = linear-attention states, then per layer kind.",
            "measured: Σ nbytes of the state the real prefill returns (abstract evaluation);",
            "serialized: the codec's payload; Φ_kv = S_kv / T_prefill (Eq. 1), Gbps = 10^9 bit/s.",
            verdict,
        ]
    )


def format_compare(reports: Sequence[ModelReport]) -> str:
    first = reports[0]
    lengths = [format_length(row.size.length) for row in first.rows]

    def block(
        title: str, value: Callable[[KvRow], float], text: Callable[[float], str]
    ) -> list[str]:
        rows = []
        for report in reports:
            cells = [report.cfg.name]
            for row, base in zip(report.rows, first.rows, strict=True):
                ratio = value(row) / value(base)
                cells.append(text(value(row)) + ("" if report is first else f" ({ratio:.2f}×)"))
            rows.append(cells)
        return [title, table(rows, headers=["model", *lengths]), ""]

    sources = sorted({row.prefill.source for report in reports for row in report.rows})
    lines = [f"prfaas kv --compare (ratios to {first.cfg.name})", ""]
    lines += [describe(report.cfg) for report in reports]
    lines += [describe_hardware(first.hardware), ""]
    lines += block("S_kv (MiB)", lambda r: r.size.formula_bytes / MIB, lambda v: f"{v:,.2f}")
    lines += block(
        f"Φ_kv (Gbps), T_prefill: {', '.join(sources)}", lambda r: r.kv_gbps, "{:.2f}".format
    )
    if not all(report.consistent for report in reports):
        lines.append(MISMATCH)
    return "\n".join(lines).rstrip()
