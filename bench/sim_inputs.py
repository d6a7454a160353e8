"""The simulator's inputs taken from a run of the real cluster, shared by bench/sim_vs_measured.py
and bench/bandwidth_drop.py: a TOML writer for flat tables, least-squares prefill profiles, and
the planner file and request trace that replay a measured workload (`plan_and_trace`).

The simulator is given only what the run and the config say: T_prefill(l) = c0 + c1·l fitted to
each route's (prompt length, prefill time on the engine); the decode step = the mean TPOT; the
handoff (what handing any state to decode costs besides its bytes) = the median exposed transfer
of the local route, whose bytes take no time; S_kv(l) = the model's `state_nbytes`; the
requests' send times, prompt lengths and output lengths as they were sent.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from prfaas_jax.config import load_model_config
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.loadgen.bench import BenchResult
from prfaas_jax.toml_config import dumps

ROUTES = ("prfaas", "pd")


def toml_text(sections: dict[str, dict]) -> str:
    """A TOML document of tables named with dots ("workload.input_len"): `toml_config.dumps`
    of the same tables nested."""
    nested: dict[str, dict] = {}
    for name, keys in sections.items():
        table = nested
        for part in name.split("."):
            table = table.setdefault(part, {})
        table.update(keys)
    return dumps(nested)


def fit_line(lengths: list[int], seconds: list[float]) -> list[float]:
    """[c0, c1] of the least-squares line; a constant when the lengths do not vary."""
    if len(set(lengths)) < 2:
        return [statistics.fmean(seconds), 0.0]
    c1, c0 = np.polyfit(np.asarray(lengths, float), np.asarray(seconds, float), 1)
    return [max(float(c0), 0.0), max(float(c1), 0.0)]


def plan_and_trace(root: Path, records: list[BenchResult], toy: dict, tag: str) -> dict:
    """Write ``plan-<tag>.toml`` (profiles fitted to ``records``, the config ``toy``'s model and
    slots) and ``trace-<tag>.jsonl`` (the requests as sent) under ``root``; returns the fitted
    values: ``profile`` (per route), ``decode_step_s``, ``handoff_s`` and ``trace`` (its path)."""
    cfg = load_model_config(toy["model"]["preset"])
    max_len = toy["engine"]["max_len"]
    profile = {}
    for route in ROUTES:
        done = [r for r in records if r.route == route and r.prefill_s is not None]
        profile[route] = fit_line([r.prompt_len for r in done], [r.prefill_s for r in done])
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    local = [r.exposed_transfer for r in records if r.route == "pd" and r.exposed_transfer]
    handoff_s = statistics.median(local) if local else 0.0
    start = min(r.sent for r in records)
    trace = root / f"trace-{tag}.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": (r.sent - start) * 1e3,
                    "input_length": r.prompt_len,
                    "output_length": r.output_tokens,
                    "hash_ids": [],
                }
            )
            + "\n"
            for r in sorted(records, key=lambda r: r.sent)
        )
    )
    lengths = root / f"lengths-{tag}.txt"
    lengths.write_text("".join(f"{r.prompt_len}\n" for r in records))
    decode_step_s = statistics.fmean(tpot)
    plan = {
        "workload": {"output_len": statistics.fmean(r.output_tokens for r in records)},
        "workload.input_len": {"distribution": "trace", "path": str(lengths)},
        "prfaas": {"instances": 1, "gpus_per_instance": 1, "egress_gbps": 1.0},
        "prfaas.prefill_time_s": {"kind": "polynomial", "coeffs": profile["prfaas"]},
        "local": {
            "instances": 2,
            "gpus_per_instance": 1,
            "decode_max_batch_size": toy["engine"]["max_slots"],
            "decode_step_s": decode_step_s,
        },
        "local.prefill_time_s": {"kind": "polynomial", "coeffs": profile["pd"]},
        "kv_size_mib": {
            "kind": "table",
            "lengths": [1, max_len],
            "values": [state_nbytes(cfg, n) / 2**20 for n in (1, max_len)],
        },
        "search": {"threshold_step": toy.get("controller", {}).get("threshold_step", 16)},
    }
    (root / f"plan-{tag}.toml").write_text(toml_text(plan))
    return {
        "profile": profile,
        "decode_step_s": decode_step_s,
        "handoff_s": handoff_s,
        "trace": trace,
    }
