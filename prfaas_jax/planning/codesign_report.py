"""What `prfaas codesign` prints: `row_json` (one JSON object per point, also the CSV's columns),
`codesign_json`, `format_codesign` (the table), `write_csv` and `draw_codesign` (recall against
the Λ_max gain over homogeneous PD, markers sized by bytes per token; needs matplotlib).

JSON keys of a row: ``label``, ``layout`` (model name), ``layers`` (count per kind),
``state_dtype``, ``wire`` (the precision the state crosses the link in; the byte columns and the
plan are of the state in it), ``kv_bytes`` (S_kv per length of ``kv_lengths``),
``recurrent_bytes`` (the fixed part), ``bytes_per_token`` (the growing part), ``kv_gbps`` (Φ_kv
per length on the PrfaaS hardware),
``threshold_tokens``, ``n_prfaas``, ``n_pd_prefill``, ``n_pd_decode``, ``lambda_max``,
``speedup_vs_homogeneous``, ``speedup_vs_naive``, ``homogeneous_lambda_max``,
``naive_lambda_max``, ``egress_gbps`` (at Λ_max), ``egress_per_instance_gbps`` (Eq. 2),
``toy_layout``, ``recall`` (held-out accuracy per evaluation length, the mean over seeds),
``recall_low`` / ``recall_high`` (its 95 % Student-t interval; null from one seed),
``recall_runs`` (per length, each seed's accuracy), ``seeds``, ``lr`` (the learning rate chosen),
``validation`` (validation accuracy of the first seed at each rate tried), ``recall_mean``,
``recall_seconds``, ``recall_shared_with``, ``exposed_s`` (per length of ``kv_lengths``: the
transfer layer-wise emission leaves after the prefill, planning/codesign_emission.py),
``link_share_gbps`` (the link it is modelled on), ``toy_exposed_s`` and ``toy_prefill_s`` (the
toy's, from its timed layer-wise prefill; null untimed), ``toy_layer_s``.

`differences` tests every two rows trained apart (Welch's t-test at each evaluation length,
significant at p < 0.05); `codesign_json` holds them under ``differences``, the table's notes
name the significant ones.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.planning.codesign import CodesignRow, mean_recall, recall_interval
from prfaas_jax.planning.codesign_config import Sweep, ToySpec
from prfaas_jax.planning.kv_report import format_length
from prfaas_jax.planning.paper_tables import MIB
from prfaas_jax.planning.recall_stats import Welch, welch
from prfaas_jax.tables import table


def _layers(cfg: ModelConfig) -> dict[str, int]:
    return {kind.value: cfg.layers.count(kind) for kind in dict.fromkeys(cfg.layers)}


def _layers_text(cfg: ModelConfig | None) -> str:
    if cfg is None:
        return "—"
    return " + ".join(f"{n} {kind}" for kind, n in _layers(cfg).items())


SIGNIFICANCE = 0.05  # two-sided p below which two rows' recalls differ


def _per_length(row: CodesignRow, of) -> dict[str, object] | None:
    if row.recall is None:
        return None
    return {str(n): of(n) for n in row.recall.accuracy}


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def row_json(row: CodesignRow) -> dict[str, object]:
    plan, best = row.plan, row.plan.best
    recall, seeded = _per_length(row, lambda n: row.recall.accuracy[n]), row.recall
    toy_exposed = row.toy_exposed()
    return {
        "label": row.label,
        "layout": row.layout.name,
        "layers": _layers(row.layout),
        "state_dtype": row.layout.state_dtype,
        "wire": str(row.precision),
        "kv_bytes": {str(s.length): s.formula_bytes for s in row.kv},
        "recurrent_bytes": row.fixed_bytes,
        "bytes_per_token": row.bytes_per_token,
        "kv_gbps": {str(s.length): row.kv_gbps(s) for s in row.kv},
        "threshold_tokens": best.routing.threshold,
        "n_prfaas": best.num_prfaas,
        "n_pd_prefill": best.num_pd_prefill,
        "n_pd_decode": best.num_pd_decode,
        "lambda_max": best.lambda_max,
        "speedup_vs_homogeneous": plan.speedup_vs_homogeneous,
        "speedup_vs_naive": plan.speedup_vs_naive,
        "homogeneous_lambda_max": plan.homogeneous_pd.lambda_max,
        "naive_lambda_max": plan.naive_heterogeneous.lambda_max,
        "egress_gbps": best.egress_gbps,
        "egress_per_instance_gbps": row.egress_per_instance_gbps,
        "toy_layout": None if row.toy is None else _layers(row.toy),
        "recall": recall,
        "recall_low": _per_length(row, lambda n: _finite(seeded.interval(n).low)),
        "recall_high": _per_length(row, lambda n: _finite(seeded.interval(n).high)),
        "recall_runs": _per_length(row, seeded.samples) if seeded else None,
        "seeds": None if seeded is None else list(seeded.seeds),
        "lr": None if seeded is None else seeded.lr,
        "validation": None if seeded is None else {str(k): v for k, v in seeded.validation.items()},
        "recall_mean": None if row.recall is None else mean_recall(row),
        "recall_seconds": None if row.recall is None else row.recall.seconds,
        "recall_shared_with": row.recall_shared_with,
        "exposed_s": {str(s.length): row.exposed_s(s.length) for s in row.kv},
        "link_share_gbps": row.link_share_gbps,
        "toy_exposed_s": None if toy_exposed is None else toy_exposed[0],
        "toy_prefill_s": None if toy_exposed is None else toy_exposed[1],
        "toy_layer_s": None if row.toy_layer_s is None else list(row.toy_layer_s),
    }


def differences(rows: Sequence[CodesignRow]) -> list[tuple[str, str, int, Welch]]:
    """Welch's t-test of every two rows with at least two seeds each, at every evaluation
    length: ``(label, label, length, test)``. Rows of one toy layout are left out (their runs
    are the same trainings, not independent samples)."""
    tested, seen = [], set()
    for row in rows:  # one row per toy layout and precision: its others repeat its runs
        key = None if row.toy is None else (row.toy.fingerprint(), str(row.precision))
        if row.recall is not None and len(row.recall.runs) > 1 and key not in seen:
            tested.append(row)
            seen.add(key)
    found = []
    for i, a in enumerate(tested):
        for b in tested[i + 1 :]:
            if a.toy.fingerprint() == b.toy.fingerprint():
                continue
            for n in a.recall.accuracy:
                found.append((a.label, b.label, n, welch(a.recall.samples(n), b.recall.samples(n))))
    return found


def codesign_json(sweep: Sweep, rows: Sequence[CodesignRow], toy: ToySpec | None) -> dict:
    return {
        "sweep": str(sweep.path),
        "plan": str(sweep.plan_path),
        "toy": None if toy is None else {k: getattr(toy, k) for k in toy.__dataclass_fields__},
        "rows": [row_json(row) for row in rows],
        "differences": [
            {
                "a": a,
                "b": b,
                "length": n,
                "t": _finite_or_inf(w.t),
                "df": w.df,
                "p": w.p,
                "significant": w.p < SIGNIFICANCE,
            }
            for a, b, n, w in differences(rows)
        ],
    }


def _finite_or_inf(value: float) -> float | str:
    """JSON has no infinity: ±inf as the strings "inf" / "-inf"."""
    return value if math.isfinite(value) else str(value)


def write_csv(rows: Sequence[CodesignRow], path: str | Path) -> None:
    """One line per point; nested JSON values (per length, per kind) become ``key_sub`` columns."""
    flat_rows = []
    for row in rows:
        flat: dict[str, object] = {}
        for key, value in row_json(row).items():
            if isinstance(value, dict):
                flat.update({f"{key}_{sub}": v for sub, v in value.items()})
            else:
                flat[key] = value
        flat_rows.append(flat)
    columns = list(dict.fromkeys(key for flat in flat_rows for key in flat))
    try:
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns)
            writer.writeheader()
            writer.writerows(flat_rows)
    except OSError as err:
        raise UserError(f"--csv: cannot write {path}: {err.strerror}") from None


def _pct(value: float) -> str:
    return "—" if math.isnan(value) else f"{100 * value:.1f}"


def _recall_cell(row: CodesignRow, length: int) -> str:
    """Mean recall in %, ± the 95 % interval's half-width over seeds (none from one seed)."""
    interval = row.recall.interval(length)
    if math.isnan(interval.half_width):
        return _pct(interval.mean)
    return f"{_pct(interval.mean)} ± {100 * interval.half_width:.1f}"


def format_codesign(sweep: Sweep, rows: Sequence[CodesignRow], toy: ToySpec | None) -> str:
    kv_at = rows[0].kv[-1].length if rows else 0
    eval_lengths = list(toy.eval_lengths) if toy is not None else []
    # The exposed transfer at every length when placement is swept (what it moves), else the last.
    exposed_at = [s.length for s in rows[0].kv] if "placement" in sweep.varying and rows else []
    exposed_at = exposed_at or [kv_at]
    timed = any(row.toy_layer_s is not None for row in rows)
    headers = [
        "point",
        "layers",
        f"S_kv@{format_length(kv_at)} MiB",
        "B/token",
        "fixed MiB",
        f"Φ_kv@{format_length(kv_at)} Gbps",
        "t*",
        "N_pf/N_p/N_d",
        "Λ_max",
        "× homog.",
        "× naive",
        "egress Gbps",
        "Eq.2 Gbps/inst",
        *(f"exposed@{format_length(n)} ms" for n in exposed_at),
        "toy layers",
        *(["toy exposed %"] if timed else []),
        *(["lr"] if toy is not None else []),
        *(f"recall@{n} %" for n in eval_lengths),
    ]
    lines = []
    for row in rows:
        best = row.plan.best
        recall = [] if row.recall is None else [_recall_cell(row, n) for n in eval_lengths]
        lr = [] if toy is None else ["—" if row.recall is None else f"{row.recall.lr:g}"]
        lines.append(
            [
                row.label,
                _layers_text(row.layout),
                f"{row.kv[-1].formula_bytes / MIB:,.1f}",
                f"{row.bytes_per_token:,}",
                f"{row.fixed_bytes / MIB:,.1f}",
                f"{row.kv_gbps(row.kv[-1]):.2f}",
                f"{best.routing.threshold:,.0f}",
                f"{best.num_prfaas}/{best.num_pd_prefill}/{best.num_pd_decode}",
                f"{best.lambda_max:.3f}",
                f"{row.plan.speedup_vs_homogeneous:.2f}",
                f"{row.plan.speedup_vs_naive:.2f}",
                f"{best.egress_gbps:.1f}",
                f"{row.egress_per_instance_gbps:.2f}",
                *(f"{1e3 * row.exposed_s(n):,.1f}" for n in exposed_at),
                _layers_text(row.toy),
                *([_toy_exposed_cell(row)] if timed else []),
                *lr,
                *recall,
                *(["—"] * (len(eval_lengths) - len(recall))),
            ]
        )
    notes = [
        f"prfaas codesign: {sweep.path} (deployment {sweep.plan_path})",
        "",
        table(lines, headers=headers, align="ll" + "r" * (len(headers) - 2)),
        "",
        "S_kv: state of one sequence from the real prefill (abstract evaluation) = the formula;",
        "T_prefill: the plan's profiles of the base layout, carried over by counted FLOPs term by",
        "term; t*, split, Λ_max (req/s): the planner's optimum (prfaas plan) with these profiles;",
        "× homog. / × naive: Λ_max over homogeneous PD / naive heterogeneous of the same layout;",
        "Eq.2: E[S_kv | L > t*] / E[T_prefill | L > t*] per PrfaaS instance.",
        "exposed: transfer left after the prefill with layer-wise emission (one group per layer, "
        f"compute split by FLOPs), on one PrfaaS instance's share of the link "
        f"({rows[0].link_share_gbps:.2f} Gbps for the first row)."
        if rows
        else "",
    ]
    if timed:
        notes.append(
            "toy exposed: the toy's layer-wise prefill timed at "
            f"{rows[0].emission_length} tokens (engine/emission_timing.py), the transfer it "
            "leaves on a link of its Φ_kv = S_kv / T_prefill, in % of its prefill time."
        )
    if any(not row.precision.is_native for row in rows):
        notes.append(
            "wire: the state as it crosses the link in that precision (docs/wire-format.md): its "
            "bytes, the plan made with them, and the toy's recall with each held-out context "
            "shipped in it."
        )
    if toy is not None:
        notes.append(
            f"recall: held-out {toy.task} accuracy of the toy layout trained {toy.steps} steps "
            f"(V={toy.vocab_size}, L={toy.seq_len}, N={toy.num_pairs}); lengths > {toy.seq_len} "
            "are longer than trained on."
        )
        seeded = next((r.recall for r in rows if r.recall is not None), None)
        if seeded is not None:
            notes.append(_seeds_note(toy, seeded.seeds))
        shared = [f"{r.label} = {r.recall_shared_with}" for r in rows if r.recall_shared_with]
        if shared:
            notes.append(f"same toy layout, the same training runs: {'; '.join(shared)}")
        notes.extend(_differences_note(rows))
    return "\n".join(notes)


def _toy_exposed_cell(row: CodesignRow) -> str:
    measured = row.toy_exposed()
    return "—" if measured is None else f"{100 * measured[0] / measured[1]:.1f}"


def _seeds_note(toy: ToySpec, seeds: Sequence[int]) -> str:
    rates = ", ".join(f"{lr:g}" for lr in toy.learning_rates)
    spread = (
        f"mean ± 95 % Student-t half-width over seeds {', '.join(map(str, seeds))}"
        if len(seeds) > 1
        else f"one run, seed {seeds[0]}"
    )
    return (
        f"{spread}; lr: the rate of {{{rates}}} best on a validation split at "
        f"L={toy.seq_len} (seed {seeds[0]})."
    )


def _differences_note(rows: Sequence[CodesignRow]) -> list[str]:
    found = differences(rows)
    if not found:
        return []
    significant = [f"{a} vs {b} @{n} (p {w.p:.2g})" for a, b, n, w in found if w.p < SIGNIFICANCE]
    head = f"Welch t-test, p < {SIGNIFICANCE:g}, {len(found)} pairs × lengths tested: "
    return [head + ("; ".join(significant) if significant else "no significant difference")]


def draw_codesign(rows: Sequence[CodesignRow], path: str | Path, title: str = "") -> None:
    """Recall (mean over the evaluation lengths) against Λ_max / homogeneous PD, one marker per
    point, its area ∝ growing bytes per token (+ the fixed state at the longest length), with
    its 95 % interval over seeds as an error bar when there are two or more."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sizes = [row.kv[-1].formula_bytes for row in rows]
    largest = max(sizes) if sizes else 1
    for index, (row, nbytes) in enumerate(zip(rows, sizes, strict=True)):
        x, y = row.plan.speedup_vs_homogeneous, 100 * mean_recall(row)
        area = 40 + 900 * nbytes / largest
        points = ax.scatter([x], [0 if math.isnan(y) else y], s=area, alpha=0.5)
        interval = recall_interval(row)
        if interval is not None:  # over seeds: the 95 % interval of the plotted mean
            color = points.get_facecolor()[0][:3]
            ax.errorbar([x], [y], yerr=100 * interval.half_width, fmt="none", capsize=3, c=color)
        # Neighbouring points often share a Λ_max gain: labels alternate above and below.
        above = index % 2 == 0
        ax.annotate(
            f"{row.label}\n{row.bytes_per_token:,} B/tok",
            (x, 0 if math.isnan(y) else y),
            fontsize=8,
            ha="center",
            va="bottom" if above else "top",
            xytext=(0, 10 if above else -10),
            textcoords="offset points",
        )
    ax.set_xlabel("Λ_max gain over homogeneous PD (×)")
    ax.set_ylabel("toy-size held-out recall (%)")
    ax.set_ylim(-5, 115)
    ax.set_title(title or "co-design: recall vs cluster throughput (area ∝ S_kv at longest length)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise UserError(f"--plot: cannot write {path}: {err.strerror}") from None
    finally:
        plt.close(fig)
