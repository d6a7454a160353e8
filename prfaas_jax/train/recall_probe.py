"""Recall of a layout, measured by training it: `measure_recall(cfg, spec, config, eval_lengths)`
-> `RecallResult`.

The layout is trained from seeded weights with the training loop of `prfaas train`
(train/loop.py: the same ``train_step``, optimizer and schedule) on ``spec``, then evaluated on
held-out examples at every length of ``eval_lengths`` — the task at that sequence length with
the same number of facts, drawn from the key `loop.eval_set` uses, which no training batch
uses. Lengths beyond ``spec.seq_len`` are longer than anything the model trained on: for MQAR
the queries come farther from their keys, for retrieval more filler lies between the facts and
the questions. Nothing is interpolated: every number is an evaluation of the trained weights.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from prfaas_jax.config import ModelConfig
from prfaas_jax.train.loop import (
    StepReport,
    TrainConfig,
    Trainer,
    eval_set,
    evaluate,
    initial_state,
)
from prfaas_jax.train.tasks import TaskSpec


@dataclasses.dataclass(frozen=True)
class RecallResult:
    accuracy: dict[int, float]  # held-out accuracy by sequence length
    final_loss: float
    steps: int
    seconds: float  # training and evaluation, compiles included


def measure_recall(
    cfg: ModelConfig,
    spec: TaskSpec,
    config: TrainConfig,
    eval_lengths: Sequence[int],
    *,
    on_step: Callable[[StepReport], None] | None = None,
) -> RecallResult:
    """Train ``cfg`` on ``spec`` for ``config.steps`` and evaluate it at ``eval_lengths``."""
    start = time.perf_counter()
    # Held-out evaluation happens once, after training, at every length (below).
    config = dataclasses.replace(config, eval_every=config.steps + 1)
    trainer = Trainer(cfg, spec, config)
    state = trainer.run(initial_state(cfg, config), on_step=on_step)
    accuracy = {}
    for length in eval_lengths:
        held_out = eval_set(dataclasses.replace(spec, seq_len=length), config)
        accuracy[length] = evaluate(state.params, cfg, held_out, impl=config.impl)
    final_loss = trainer.history[-1].loss if trainer.history else float("nan")
    return RecallResult(accuracy, final_loss, config.steps, time.perf_counter() - start)
