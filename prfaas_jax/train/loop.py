"""Training a hybrid model on a synthetic task: ``TrainConfig``, ``train_step``, ``evaluate`` and
``Trainer``.

The model trained is the one the engines serve: the loss runs ``model.prefill`` with the
``chunk`` ops (the form whose gradients tests/model/test_gradients.py checks against finite
differences) from an empty state over each example, so what is learned is exactly what the
prefill and decode engines compute. The optimizer is optax's AdamW
behind global-norm clipping, with a linear warm-up to ``lr`` and a cosine decay to
``lr · final_lr_ratio``. Cross-entropy and accuracy are taken only where the task scores an
answer (``Batch.mask``; accuracy counts the answers, ``Batch.answer``).

Determinism. Parameters come from ``PRNGKey(seed)``; the batch of step ``s`` is
``make_batch(fold_in(train_key, s))`` and the evaluation set is drawn once from a separate key,
so a run is a function of its flags, and a run resumed from a checkpoint at step ``s`` continues
with the very batches an uninterrupted run would use.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import UserError
from prfaas_jax.model import init_state, prefill
from prfaas_jax.model.checkpoint import load_checkpoint
from prfaas_jax.model.hybrid import Params
from prfaas_jax.model.seeded_weights import seeded_params
from prfaas_jax.ops.dispatch import Impl
from prfaas_jax.train.tasks import Batch, TaskSpec, make_batch

TRAINABLE_IMPLS = (Impl.CHUNK, Impl.REFERENCE)


def default_train_impl() -> Impl:
    """The ops a run trains with unless told: on a CPU the token scans (``reference``), whose
    forward and backward through KDA and GDN layers run 2-5x faster there than the chunked
    form's at the sizes this project trains (bench/train.py, bench/train_profile.py); on an
    accelerator the chunked form, which is made for it."""
    return Impl.REFERENCE if jax.default_backend() == "cpu" else Impl.CHUNK


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and schedule; hashable so it can be a ``jax.jit`` static argument."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 50
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    eval_examples: int = 512
    eval_every: int = 100
    impl: Impl | None = None  # None: `default_train_impl()`
    init_from: str | None = None  # a model checkpoint to start from instead of random weights

    def __post_init__(self) -> None:
        impl = default_train_impl() if self.impl is None else Impl(self.impl)
        object.__setattr__(self, "impl", impl)
        if impl not in TRAINABLE_IMPLS:
            raise UserError(
                f"training runs the chunk or reference ops; --impl {impl.value} is for serving "
                "(Pallas kernels define no backward pass)"
            )
        for name in ("steps", "batch_size", "eval_examples", "eval_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.lr > 0:
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise UserError(f"warm-up steps must be ≥ 0, got {self.warmup_steps}")

    def for_step(self) -> TrainConfig:
        """The fields one step depends on, the others at fixed values: runs that differ only in
        seed or evaluation share one compiled ``train_step``."""
        return dataclasses.replace(self, seed=0, eval_examples=1, eval_every=1, init_from=None)


def optimizer(config: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=min(config.warmup_steps, config.steps - 1),
        decay_steps=config.steps,
        end_value=config.lr * config.final_lr_ratio,
    )
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay),
    )


def loss_and_accuracy(
    params: Params, cfg: ModelConfig, batch: Batch, impl: Impl = Impl.CHUNK
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over the scored positions of ``batch``, and accuracy over its answers."""
    batch_size, seq_len = batch.tokens.shape
    state = init_state(cfg, batch_size, seq_len)
    logits, _ = prefill(params, cfg, batch.tokens, state, impl=impl)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
    scored, answers = batch.mask.astype(nll.dtype), batch.answer.astype(nll.dtype)
    correct = (jnp.argmax(logits, axis=-1) == batch.targets).astype(nll.dtype)
    loss = (nll * scored).sum() / jnp.maximum(scored.sum(), 1.0)
    return loss, (correct * answers).sum() / jnp.maximum(answers.sum(), 1.0)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "config"), donate_argnums=(0, 1))
def train_step(
    params: Params,
    opt_state: optax.OptState,
    key: jax.Array,
    *,
    cfg: ModelConfig,
    spec: TaskSpec,
    config: TrainConfig,
) -> tuple[Params, optax.OptState, jax.Array, jax.Array]:
    """One update on the batch drawn from ``key``: ``(params, opt_state, loss, accuracy)``."""
    batch = make_batch(key, spec, config.batch_size)

    def loss_fn(p: Params) -> tuple[jax.Array, jax.Array]:
        return loss_and_accuracy(p, cfg, batch, config.impl)

    (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer(config).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, accuracy


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def _eval_batch(params: Params, batch: Batch, *, cfg: ModelConfig, impl: Impl) -> jax.Array:
    """``[B]`` number of correct answers per example."""
    state = init_state(cfg, *batch.tokens.shape)
    logits, _ = prefill(params, cfg, batch.tokens, state, impl=impl)
    correct = (jnp.argmax(logits, axis=-1) == batch.targets) & batch.answer
    return correct.sum(axis=1)


def eval_set(spec: TaskSpec, config: TrainConfig) -> Batch:
    """The held-out examples: drawn from a key no training batch uses."""
    key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 1)
    return make_batch(key, spec, config.eval_examples)


def evaluate(
    params: Params, cfg: ModelConfig, batch: Batch, *, impl: Impl = Impl.CHUNK, chunk: int = 128
) -> float:
    """Accuracy over every answer of ``batch`` (evaluated ``chunk`` examples at a time)."""
    total = 0
    for start in range(0, batch.tokens.shape[0], chunk):
        part = jax.tree.map(lambda a, s=start: a[s : s + chunk], batch)
        total += int(_eval_batch(params, part, cfg=cfg, impl=impl).sum())
    return total / int(np.asarray(batch.answer).sum())


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What a progress display needs after a step (``eval_accuracy`` only on evaluation steps)."""

    step: int
    loss: float
    accuracy: float
    tokens_per_s: float
    eval_accuracy: float | None = None


@dataclasses.dataclass
class TrainState:
    """Everything a run needs to continue: parameters, optimizer state and the next step."""

    params: Params
    opt_state: optax.OptState
    step: int = 0


def initial_state(cfg: ModelConfig, config: TrainConfig) -> TrainState:
    """Step 0: weights drawn from ``seed`` (model/seeded_weights.py), or those of the checkpoint
    ``init_from`` (which must hold this very layout), and a fresh optimizer state."""
    if config.init_from is None:
        params = seeded_params(cfg, config.seed)  # through the weights cache, if in use
    else:
        found, params = load_checkpoint(config.init_from)
        if found.fingerprint() != cfg.fingerprint():
            raise UserError(
                f"--init-from {config.init_from} holds another layout than {cfg.name} "
                f"(vocabulary {found.vocab_size} vs {cfg.vocab_size}, or its blocks differ)"
            )
    return TrainState(params=params, opt_state=optimizer(config).init(params), step=0)


@dataclasses.dataclass
class Trainer:
    """Runs ``train_step`` from ``state.step`` to ``config.steps``; ``on_step`` sees every step
    and ``on_checkpoint(state)`` is called every ``checkpoint_every`` steps and at the end."""

    cfg: ModelConfig
    spec: TaskSpec
    config: TrainConfig
    history: list[StepReport] = dataclasses.field(default_factory=list)

    def run(
        self,
        state: TrainState,
        *,
        on_step: Callable[[StepReport], None] | None = None,
        on_checkpoint: Callable[[TrainState], None] | None = None,
        checkpoint_every: int = 0,
        stop_at: int | None = None,
    ) -> TrainState:
        """Train until ``config.steps`` (or ``stop_at``, for a run cut short on purpose)."""
        config = self.config
        train_key = jax.random.fold_in(jax.random.PRNGKey(config.seed), 0)
        held_out = eval_set(self.spec, config)
        tokens_per_step = config.batch_size * self.spec.seq_len
        end = config.steps if stop_at is None else min(stop_at, config.steps)
        while state.step < end:
            start = time.perf_counter()
            key = jax.random.fold_in(train_key, state.step)
            params, opt_state, loss, accuracy = train_step(
                state.params,
                state.opt_state,
                key,
                cfg=self.cfg,
                spec=self.spec,
                config=config.for_step(),
            )
            loss, accuracy = float(loss), float(accuracy)
            state = TrainState(params=params, opt_state=opt_state, step=state.step + 1)
            rate = tokens_per_step / (time.perf_counter() - start)
            at_eval = state.step % config.eval_every == 0 or state.step == config.steps
            eval_accuracy = (
                evaluate(state.params, self.cfg, held_out, impl=config.impl) if at_eval else None
            )
            report = StepReport(state.step, loss, accuracy, rate, eval_accuracy)
            self.history.append(report)
            if on_step is not None:
                on_step(report)
            due = checkpoint_every and state.step % checkpoint_every == 0
            if on_checkpoint is not None and (due or state.step == end):
                on_checkpoint(state)
        return state
