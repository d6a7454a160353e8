"""The bandwidth drop with and without adaptive wire precision: `compare` runs the same load
through the same `[link] schedule` twice — every state native, then with the router's `[wire]`
policy (policy/wire_choice.py) narrowing offloaded states while the PrfaaS egress runs at ≥ 85 %
of the capacity it learned, back to native at ≤ 60 % — and `table` prints, per run, throughput,
TTFT (P50, P90, and P90 of the requests sent during the drop), the share offloaded and the share
narrowed. `bench/bandwidth_drop.py --adaptive-wire` and `--recall` call it.

Two settings:

- fake engines (``--adaptive-wire``): the states are real codec streams of the ``tiny`` layout
  and the decode engine checks each bit for bit, so the narrowing is ``bf16``, exact on the fake
  states' values (a 1/64 grid in [−2, 2)) and half the bytes of tiny's float32 state; its recall
  cost is 0 in `prfaas codesign`'s wire axis (docs/codesign.md, "Wire precision as an axis":
  3:1 bf16 91.9 / 92.1 / 91.4 % against native's 91.9 / 92.0 / 91.4 %).
- the recall model (``--recall``): the JAX engines serve ``recall-tiny`` (the model `prfaas
  demo` checks recall with), every prompt a retrieval question of its training task whose answer
  is the second generated token, the one the decode worker computes from the state it received.
  The narrowing is ``int8`` (0.30 of native's bytes at these lengths), whose recall cost in the
  codesign table is at most 0.1 points, within the budget of 1 point per narrowed request. Both
  runs send the same prompts at the same times, so each narrowed request's answer is compared
  with the same prompt's answer in the native run, where every state crossed exact.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

RECALL_BUDGET = 0.01  # one point of recall per narrowed request at most
HIGH, LOW = 0.85, 0.6
# Each setting's narrowing: its bytes over native's and its recall cost (codesign's wire axis).
FAKE_OPTION = {"precision": "bf16", "byte_ratio": 0.5, "recall_loss": 0.0}
RECALL_OPTION = {"precision": "int8", "byte_ratio": 0.3, "recall_loss": 0.001}
RECALL_PRESET = "recall-tiny"


def wire_section(option: dict, window_s: float) -> dict:
    """`[wire]` for the cluster config, in the simulator's keys
    (configs/sim/bandwidth-drop-wire.toml)."""
    return {
        "recall_budget": RECALL_BUDGET,
        "high_utilization": HIGH,
        "low_utilization": LOW,
        "window_s": window_s,
        "options": [option],
    }


def recall_sections() -> dict:
    """The recall model on the JAX engines, in place of the fake ones: prompts of 25–85 tokens
    (the task's), t = 40 so most of them cross the link, a 4 KiB burst so a 5–23 KB state
    does not pass the dropped link in its bucket alone."""
    return {
        "model": {"preset": RECALL_PRESET, "engine": "jax"},
        "engine": {"max_len": 128, "chunk_len": 128, "buckets": [32, 64, 128], "max_slots": 16},
        "router": {"threshold": 40.0},
        "controller": {"threshold_step": 8},
        "link": {"burst_kib": 4.0},
    }


def recall_workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """``n`` retrieval prompts of the recall model's training task and each one's answer, cut
    as `train.tasks.recall_prompt` cuts one (up to the first asked key; the answer the second
    token of its value), from one compiled batch rather than ``n`` calls op by op."""
    import jax

    from prfaas_jax.serving.loadgen.demo import recall_task
    from prfaas_jax.train.tasks import make_batch

    task = recall_task(RECALL_PRESET)
    if task is None:
        raise SystemExit(f"{RECALL_PRESET} has no retrieval task in its run.json")
    batch = make_batch(jax.random.PRNGKey(seed), task, n)
    tokens, targets = np.asarray(batch.tokens), np.asarray(batch.targets)
    firsts = np.asarray(batch.answer).argmax(axis=1)
    prompts = [tokens[i, :first].tolist() for i, first in enumerate(firsts)]
    return prompts, [int(targets[i, first]) for i, first in enumerate(firsts)]


def compare(
    root: Path,
    args: argparse.Namespace,
    measure: Callable[..., tuple[list, list[dict], dict]],
    n_requests: int,
    window_s: float,
) -> dict:
    """Both runs (`measure` is bandwidth_drop.py's, ``n_requests`` each; `[wire]` measures the
    egress over ``window_s``, as the threshold controller does); the per-run rows and, with
    ``--recall``, the paired recall of the narrowed requests."""
    prompts = answers = None
    extra: dict = {}
    option = FAKE_OPTION
    if args.recall:
        prompts, answers = recall_workload(n_requests, args.seed)
        extra, option = recall_sections(), RECALL_OPTION
    runs = {}
    for name, wire in (("native", None), ("adaptive", wire_section(option, window_s))):
        sections = {**extra, **({"wire": wire} if wire else {})}
        output_len = 2 if args.recall else 4  # the recall answer is the second token
        # A request refused under overload (a full prefill queue) is counted, not fatal: what
        # each run sheds is part of the comparison.
        runs[name] = measure(root / name, args, sections, prompts, output_len, name, True)
    rows = [row(name, *runs[name], args, answers) for name in runs]
    out = {"narrowing": option, "recall_budget": RECALL_BUDGET, "runs": rows}
    if answers is not None:
        out["paired_recall"] = paired_recall(runs["native"][0], runs["adaptive"][0], answers)
    return out


def row(name: str, records: list, trace: list, context: dict, args, answers) -> dict:
    """One run's throughput (completed requests over first send → last token), TTFT and
    shares of the completed requests, the failed ones; its recall (a failed request is not
    right) when the prompts have answers."""
    start = min(r.sent for r in records) - context["sent0"]  # the schedule's t = 0
    drop = (args.drop_at, args.drop_at + args.drop_for)
    done = [r for r in records if r.error is None]
    ttft = [r.ttft for r in done]
    during = [r.ttft for r in done if drop[0] <= r.sent - start < drop[1]]
    first, last = min(r.sent for r in records), max(r.sent + r.e2el for r in done)
    offloaded = [r for r in done if r.route == "prfaas"]
    narrowed = [r for r in offloaded if r.wire_precision]
    out = {
        "run": name,
        "requests": len(records),
        "failed": len(records) - len(done),
        "throughput_req_s": len(done) / (last - first),
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p90_ms": 1e3 * float(np.percentile(ttft, 90)),
        "ttft_p90_drop_ms": 1e3 * float(np.percentile(during, 90)) if during else float("nan"),
        "offloaded": len(offloaded) / len(done),
        "narrowed": len(narrowed) / len(done),
        "narrowed_of_offloaded": len(narrowed) / len(offloaded) if offloaded else 0.0,
        "state_bytes_offloaded": sum(r.state_bytes for r in offloaded),
        "threshold_mean_drop": _mean(
            t["threshold"] for t in trace if drop[0] <= t["time_s"] < drop[1]
        ),
    }
    if answers is not None:
        right = [recalled(r, a) for r, a in zip(records, answers, strict=True)]
        out["recall"] = statistics.fmean(right)
        marks = [ok for r, ok in zip(records, right, strict=True) if r.wire_precision]
        out["recall_narrowed"] = statistics.fmean(marks) if marks else float("nan")
    return out


def recalled(record, answer: int) -> bool:
    """The cluster's answer is right: the second generated token is the value asked for (a
    failed request's is not)."""
    return record.error is None and record.token_ids[1:2] == [answer]


def paired_recall(native: list, adaptive: list, answers: list[int]) -> dict:
    """The requests the adaptive run narrowed, each against the same prompt's native answer
    (where the native run completed it):
    how many were right each way, and the loss in points (per narrowed request) against the
    budget."""
    pairs = [
        (recalled(n, a), recalled(w, a))
        for n, w, a in zip(native, adaptive, answers, strict=True)
        if w.wire_precision and n.error is None
    ]
    if not pairs:
        return {"narrowed": 0}
    right_native = sum(n for n, _ in pairs)
    right_narrowed = sum(w for _, w in pairs)
    loss = (right_native - right_narrowed) / len(pairs)
    return {
        "narrowed": len(pairs),
        "right_native": right_native,
        "right_narrowed": right_narrowed,
        "changed": sum(n != w for n, w in pairs),
        "loss_points": 100 * loss,
        "within_budget": loss <= RECALL_BUDGET,
    }


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def table(result: dict) -> str:
    """The runs side by side (Markdown), and the recall lines."""
    recall = "recall" in result["runs"][0]
    head = "| run | failed | req/s | TTFT P50 ms | TTFT P90 ms | P90 in the drop ms | offloaded |"
    head += " narrowed | t in the drop |" + (" recall |" if recall else "")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in result["runs"]:
        line = (
            f"| {r['run']} | {r['failed']} | {r['throughput_req_s']:.2f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['ttft_p90_drop_ms']:.0f} | "
            f"{r['offloaded']:.0%} | "
            f"{r['narrowed']:.0%} | {r['threshold_mean_drop']:.0f} |"
        )
        lines.append(line + (f" {100 * r['recall']:.1f} % |" if recall else ""))
    option = result["narrowing"]
    lines.append(
        f"\nnarrowing: {option['precision']} ({option['byte_ratio']:g} of native's bytes, "
        f"recall cost {100 * option['recall_loss']:g} points), budget "
        f"{100 * result['recall_budget']:g} point per narrowed request"
    )
    paired = result.get("paired_recall")
    if paired and paired["narrowed"]:
        lines.append(
            f"the {paired['narrowed']} narrowed requests: {paired['right_narrowed']} right in "
            f"{option['precision']}, {paired['right_native']} right native ({paired['changed']} "
            f"answers changed): {paired['loss_points']:+.1f} points, "
            f"{'within' if paired['within_budget'] else 'OVER'} the budget"
        )
    return "\n".join(lines)
