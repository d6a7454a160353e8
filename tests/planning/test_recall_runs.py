"""Recall over seeds at a learning rate chosen per layout (planning/recall_runs.py), through
`run_codesign` and its report, with a stand-in for the training run whose numbers are set by
hand: which rate is kept, which seeds run, the mean and interval of each row, the Welch test
between rows and the budget's plan, trim and refusal. The real training is
tests/train/test_recall_probe.py's and tests/train/test_loop.py's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from prfaas_jax.config import LayerKind, load_model_config
from prfaas_jax.engine.kvsize import state_sizes
from prfaas_jax.errors import UserError
from prfaas_jax.planning import codesign_report
from prfaas_jax.planning.codesign import mean_recall, recall_interval, run_codesign
from prfaas_jax.planning.codesign_config import ToySpec, load_sweep
from prfaas_jax.planning.recall_runs import RecallSchedule
from prfaas_jax.planning.recall_stats import mean_interval, welch

PLAN = Path(__file__).resolve().parents[2] / "configs" / "plans" / "case-study-1t.toml"
# Held-out accuracy at length 8 by seed: with an MLA block, and without.
WITH_MLA, WITHOUT = [0.90, 0.92, 0.95], [0.80, 0.85, 0.83]


@dataclasses.dataclass
class Run:
    accuracy: dict[int, float]
    seconds: float
    validation: float


def _train(calls):
    def train(cfg, spec: ToySpec) -> Run:
        calls.append((cfg.name, spec.lr, spec.seed))
        has_mla = LayerKind.MLA in cfg.layers
        # Validation prefers 1e-3 with MLA and 3e-3 without; the held-out accuracy of the rate
        # not kept is higher still, so a choice made on it would show.
        best = 1e-3 if has_mla else 3e-3
        if spec.lr != best:
            return Run({8: 0.99, 16: 0.99}, 30.0, validation=0.1)
        held_out = (WITH_MLA if has_mla else WITHOUT)[spec.seed]
        return Run({8: held_out, 16: held_out / 2}, 30.0, validation=0.5)

    return train


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    path = tmp_path_factory.mktemp("seeds") / "sweep.toml"
    path.write_text(
        f'[model]\nbase = "prfaas-1t"\nplacement = "kimi"\n[axes]\n'
        f'ratio = ["3:1", "all-linear", "7:1"]\n[deployment]\nplan = "{PLAN}"\n'
        "kv_lengths = [1024, 131072]\n[toy]\nnum_layers = 2\nseq_len = 8\n"
        "lr_grid = [3e-3, 1e-3]\neval_lengths = [8, 16]\n"
    )
    sweep, calls, told = load_sweep(path), [], []
    rows = run_codesign(
        sweep,
        load_model_config("prfaas-1t"),
        measure=lambda cfg, lengths, trace: state_sizes(cfg, lengths, measure=False),
        recall=_train(calls),
        toy_base=load_model_config("tiny"),
        seeds=3,
        tell=told.append,
    )
    return sweep, rows, calls, told


def test_the_rate_is_chosen_on_validation_and_the_seeds_follow(swept):
    _, rows, calls, told = swept
    mla, linear, shared = rows
    # Each toy layout: both rates at seed 0, then seeds 1 and 2 at the kept rate; 7:1 is 3:1's
    # toy layout (one MLA block of two) and trains nothing.
    assert [(lr, seed) for _, lr, seed in calls] == [
        (3e-3, 0), (1e-3, 0), (1e-3, 1), (1e-3, 2),
        (3e-3, 0), (1e-3, 0), (3e-3, 1), (3e-3, 2),
    ]  # fmt: skip
    assert (mla.recall.lr, linear.recall.lr) == (1e-3, 3e-3)
    assert mla.recall.seeds == (0, 1, 2) and mla.recall.validation == {3e-3: 0.1, 1e-3: 0.5}
    assert shared.recall is mla.recall and shared.recall_shared_with == "3:1"
    assert mla.recall.samples(8) == WITH_MLA
    assert mla.recall.accuracy[8] == pytest.approx(sum(WITH_MLA) / 3)
    assert mla.recall.interval(8) == mean_interval(WITH_MLA)
    assert told == [
        "plan: 2 toy layout(s) × (2 learning rate(s) + 2 further seed(s)) = 8 training runs",
        "8 runs × 0.50 min (the first run) ≈ 4.0 min",
    ]


def test_the_report_carries_intervals_and_the_significant_differences(swept):
    sweep, rows, _, _ = swept
    data = json.loads(json.dumps(codesign_report.codesign_json(sweep, rows, sweep.toy)))
    row = data["rows"][0]
    interval = mean_interval(WITH_MLA)
    assert (row["recall_low"]["8"], row["recall_high"]["8"]) == (interval.low, interval.high)
    assert row["recall_runs"]["8"] == WITH_MLA and row["lr"] == 1e-3 and row["seeds"] == [0, 1, 2]
    # 3:1 against all-linear at both lengths; 7:1 repeats 3:1's runs and is not tested again.
    tests = {(d["a"], d["b"], d["length"]): d for d in data["differences"]}
    assert set(tests) == {("3:1", "all-linear", 8), ("3:1", "all-linear", 16)}
    by_hand = welch(WITH_MLA, WITHOUT)
    assert tests["3:1", "all-linear", 8]["p"] == by_hand.p < 0.05
    assert tests["3:1", "all-linear", 8]["significant"]
    text = codesign_report.format_codesign(sweep, rows, sweep.toy)
    assert f"{100 * interval.mean:.1f} ± {100 * interval.half_width:.1f}" in text
    assert f"3:1 vs all-linear @8 (p {by_hand.p:.2g})" in text


def test_the_plotted_recall_has_its_interval_over_seeds(swept, tmp_path):
    _, rows, _, _ = swept
    codesign_report.draw_codesign(rows, tmp_path / "codesign.png")  # with its error bars
    assert (tmp_path / "codesign.png").stat().st_size > 0
    # Each seed's recall over lengths 8 and 16 (the second half the first), then their interval.
    per_seed = [(a + a / 2) / 2 for a in WITH_MLA]
    interval = recall_interval(rows[0])
    assert interval == mean_interval(per_seed)
    assert interval.mean == pytest.approx(mean_recall(rows[0]))
    # By hand: t(0.975, 2) = 4.3027, s of (0.675, 0.69, 0.7125) = 0.018875.
    assert interval.half_width == pytest.approx(4.3027 * 0.018875 / 3**0.5, rel=1e-3)


def test_the_budget_plans_trims_the_seeds_or_refuses():
    schedule = RecallSchedule(layouts=4, rates=3, seeds=5, budget_min=20)
    assert schedule.runs() == 4 * (3 + 4) == 28
    # 28 one-minute runs do not fit in 20; 4 × (3 + s − 1) ≤ 20 holds up to s = 3.
    verdict = schedule.first_run(60.0)
    assert schedule.seeds == 3 and schedule.runs() == 20
    assert verdict.endswith("--seeds 5 trimmed to 3 (20 runs ≈ 20.0 min)")
    # At two seeds (16 runs) 10 minutes are too few: refused, in one line.
    with pytest.raises(UserError, match=r"--seeds 2 still needs 16\.0 min") as refused:
        RecallSchedule(layouts=4, rates=3, seeds=5, budget_min=10).first_run(60.0)
    assert "\n" not in str(refused.value)
    assert RecallSchedule(4, 3, 5, budget_min=30).first_run(60.0).endswith("within 30 min")
