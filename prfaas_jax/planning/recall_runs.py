"""Recall of a toy layout over seeds, at a learning rate chosen per layout: `seeded_recall(...)`
-> `SeededRecall`, and `RecallSchedule`, the plan of training runs held against a time budget.

A layout is trained once per rate of the toy's ``learning_rates`` with the first seed; the rate
whose run scores best on the validation split (ties: the first listed) is kept, and the layout
is trained again at it with each further seed (``seed + 1``, ``seed + 2``, …). The held-out
recall of a length is the mean over the seeds' runs at the kept rate with its Student-t
interval (planning/recall_stats.py); the held-out examples never enter the choice. A layout
thus costs ``rates + seeds − 1`` runs.

This module stays free of JAX: one training run is the caller's callable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prfaas_jax.errors import UserError
from prfaas_jax.planning.codesign_config import ToySpec
from prfaas_jax.planning.recall_stats import Interval, mean_interval


class RunLike(Protocol):
    """What is read from one training run (train/recall_probe.py's `RecallResult`)."""

    accuracy: dict[int, float]  # held-out accuracy by evaluation length
    seconds: float
    validation: float  # accuracy on the validation split, at the trained length


@dataclass(frozen=True)
class SeededRecall:
    """The runs of one layout at its chosen rate, one per seed (``specs[i]`` trained
    ``runs[i]``); ``accuracy`` is their mean per length."""

    specs: tuple[ToySpec, ...]
    runs: tuple[RunLike, ...]
    validation: dict[float, float]  # the first seed's validation accuracy at every rate tried
    selection_seconds: float = 0.0  # the runs at the rates not kept

    @property
    def lr(self) -> float:
        return self.specs[0].lr

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(spec.seed for spec in self.specs)

    def samples(self, length: int) -> list[float]:
        return [run.accuracy[length] for run in self.runs]

    def interval(self, length: int) -> Interval:
        """Mean held-out accuracy at ``length`` and its 95 % Student-t interval."""
        return mean_interval(self.samples(length))

    @property
    def accuracy(self) -> dict[int, float]:
        return {length: self.interval(length).mean for length in self.runs[0].accuracy}

    @property
    def seconds(self) -> float:
        return self.selection_seconds + sum(run.seconds for run in self.runs)

    def map(self, measure: Callable[[ToySpec, RunLike], RunLike]) -> SeededRecall:
        """Every run re-measured (the same weights evaluated another way, e.g. through a wire
        precision); the choice of rate stays."""
        runs = tuple(measure(spec, run) for spec, run in zip(self.specs, self.runs, strict=True))
        return dataclasses.replace(self, runs=runs, selection_seconds=0.0)


class RecallSchedule:
    """The training runs of a sweep: ``layouts × (rates + seeds − 1)``; with a budget in
    minutes, the first run's time sets the minutes per run, and the seeds are trimmed to what
    fits (at least two, the fewest that give an interval) or the sweep is refused."""

    def __init__(self, layouts: int, rates: int, seeds: int, budget_min: float | None = None):
        if seeds < 1:
            raise UserError(f"--seeds must be at least 1, got {seeds}")
        if budget_min is not None and not budget_min > 0:
            raise UserError(f"--budget must be a positive number of minutes, got {budget_min}")
        self.layouts, self.rates, self.seeds, self.budget_min = layouts, rates, seeds, budget_min
        self.done = 0

    def runs(self, seeds: int | None = None) -> int:
        return self.layouts * (self.rates + (self.seeds if seeds is None else seeds) - 1)

    def plan(self) -> str:
        """The plan, before any run: layouts × (rates + further seeds) = runs."""
        return (
            f"plan: {self.layouts} toy layout(s) × ({self.rates} learning rate(s) + "
            f"{self.seeds - 1} further seed(s)) = {self.runs()} training runs"
        )

    def first_run(self, seconds: float) -> str:
        """After the first run: the time the plan takes at that pace, checked against the
        budget; trims ``seeds`` or raises `UserError` (one line)."""
        per_run = seconds / 60.0
        total = self.runs() * per_run
        line = f"{self.runs()} runs × {per_run:.2f} min (the first run) ≈ {total:.1f} min"
        if self.budget_min is None or total <= self.budget_min:
            return line + ("" if self.budget_min is None else f", within {self.budget_min:g} min")
        least = min(2, self.seeds)
        fits = [s for s in range(least, self.seeds) if self.runs(s) * per_run <= self.budget_min]
        if not fits:
            raise UserError(
                f"--budget {self.budget_min:g} min: {line}, and --seeds {least} still needs "
                f"{self.runs(least) * per_run:.1f} min; raise --budget or use --toy quick"
            )
        requested, self.seeds = self.seeds, max(fits)
        return (
            f"{line}, over --budget {self.budget_min:g} min: --seeds {requested} trimmed to "
            f"{self.seeds} ({self.runs()} runs ≈ {self.runs() * per_run:.1f} min)"
        )


# (toy layout, toy spec with the run's seed and rate): one training run.
Train = Callable[[object, ToySpec], RunLike]


def seeded_recall(
    train: Train, toy_cfg: object, toy: ToySpec, schedule: RecallSchedule
) -> SeededRecall:
    """``toy_cfg`` trained at each of ``toy.learning_rates`` with ``toy.seed``, the rate best on
    validation kept, then at ``schedule.seeds − 1`` further seeds (read after the first runs,
    which may trim it)."""
    rates = toy.learning_rates
    tried = {lr: train(toy_cfg, dataclasses.replace(toy, lr=lr)) for lr in rates}
    validation = {lr: run.validation for lr, run in tried.items()}
    best = max(rates, key=lambda lr: (validation[lr], -rates.index(lr)))
    chosen = dataclasses.replace(toy, lr=best)
    specs = [chosen] + [
        dataclasses.replace(chosen, seed=toy.seed + i) for i in range(1, schedule.seeds)
    ]
    runs = [tried[best]] + [train(toy_cfg, spec) for spec in specs[1:]]
    unused = sum(run.seconds for lr, run in tried.items() if lr != best)
    return SeededRecall(tuple(specs), tuple(runs), validation, unused)
