"""Recall of a layout, measured by training it: `measure_recall(cfg, spec, config, eval_lengths)`
-> `RecallResult`.

The layout is trained from seeded weights with the training loop of `prfaas train`
(train/loop.py: the same ``train_step``, optimizer and schedule) on ``spec``, then evaluated on
held-out examples at every length of ``eval_lengths`` — the task at that sequence length with
the same number of facts, drawn from the key `loop.eval_set` uses, which no training batch
uses. Lengths beyond ``spec.seq_len`` are longer than anything the model trained on: for MQAR
the queries come farther from their keys, for retrieval more filler lies between the facts and
the questions. Nothing is interpolated: every number is an evaluation of the trained weights.

A validation split (`validation_set`, at the trained length, from a third key) is evaluated
too: the caller chooses the learning rate on it, so the held-out examples stay out of every
choice.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine import codec
from prfaas_jax.model import init_state, prefill
from prfaas_jax.model.hybrid import Params
from prfaas_jax.ops.dispatch import Impl
from prfaas_jax.train.loop import (
    StepReport,
    TrainConfig,
    Trainer,
    eval_set,
    evaluate,
    initial_state,
)
from prfaas_jax.train.tasks import Batch, TaskSpec, make_batch
from prfaas_jax.wire_precision import WirePrecision


@dataclasses.dataclass(frozen=True)
class RecallResult:
    accuracy: dict[int, float]  # held-out accuracy by sequence length
    final_loss: float
    steps: int
    seconds: float  # training and evaluation, compiles included
    validation: float = float("nan")  # accuracy on the validation split (`validation_set`)
    params: Params | None = dataclasses.field(default=None, repr=False, compare=False)


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
    validation = evaluate(state.params, cfg, validation_set(spec, config), impl=config.impl)
    final_loss = trainer.history[-1].loss if trainer.history else float("nan")
    seconds = time.perf_counter() - start
    return RecallResult(
        accuracy, final_loss, config.steps, seconds, validation=validation, params=state.params
    )


def validation_set(spec: TaskSpec, config: TrainConfig) -> Batch:
    """Examples for choices made after training (the learning rate), at the trained length:
    drawn from a key neither the training batches (0) nor the held-out set (1) use."""
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 2)
    return make_batch(key, spec, config.eval_examples)


def shipped_recall(
    cfg: ModelConfig,
    spec: TaskSpec,
    config: TrainConfig,
    trained: RecallResult,
    eval_lengths: Sequence[int],
    precision: WirePrecision,
) -> RecallResult:
    """``trained``'s held-out accuracy at ``eval_lengths`` (the examples `measure_recall`
    evaluates) with each example's context state sent through the codec in ``precision``
    (`shipped_accuracy`)."""
    if trained.params is None:
        raise ValueError("the trained result holds no parameters")
    start = time.perf_counter()
    accuracy = {}
    for length in eval_lengths:
        held_out = eval_set(dataclasses.replace(spec, seq_len=length), config)
        accuracy[length] = shipped_accuracy(
            trained.params, cfg, held_out, precision, impl=config.impl
        )
    seconds = time.perf_counter() - start
    return dataclasses.replace(trained, accuracy=accuracy, seconds=seconds)


_prefill = jax.jit(prefill, static_argnames=("cfg", "impl"))


def shipped_accuracy(
    params: Params,
    cfg: ModelConfig,
    batch: Batch,
    precision: WirePrecision,
    *,
    impl: Impl = Impl.CHUNK,
    chunk: int = 128,
) -> float:
    """Accuracy over every answer of ``batch`` when each example's context crosses the wire:
    the tokens before the batch's first answer position are prefilled, each example's state is
    encoded in ``precision`` and decoded (engine/codec), and the rest of the example is absorbed
    from the decoded state — a PrfaaS request's prompt prefilled remotely and its answers made
    where the state arrived. With ``native`` it is `loop.evaluate`'s accuracy (the same logits,
    computed in two calls)."""
    answer = np.asarray(batch.answer)
    split = int(np.argmax(answer.any(axis=0)))
    if not answer.any() or split == 0:
        raise ValueError("the batch needs answers, and context before the first one")
    right = 0
    for start in range(0, answer.shape[0], chunk):
        tokens = batch.tokens[start : start + chunk]
        rows, length = tokens.shape
        _, state = _prefill(
            params, cfg, tokens[:, :split], init_state(cfg, rows, length), impl=impl
        )
        shipped = [
            codec.decode(
                codec.encode(state, cfg, row=row, precision=precision), cfg, max_len=length
            )
            for row in range(rows)
        ]
        state = jax.tree.map(lambda *parts: jnp.concatenate(parts), *shipped)
        logits, _ = _prefill(params, cfg, tokens[:, split:], state, impl=impl)
        targets = np.asarray(batch.targets[start : start + chunk, split:])
        asked = answer[start : start + chunk, split:]
        right += int(((np.asarray(jnp.argmax(logits, axis=-1)) == targets) & asked).sum())
    return right / int(answer.sum())
