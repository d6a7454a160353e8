"""Synthetic recall tasks, generated in JAX: ``Task``, ``TaskSpec``, ``Batch``, ``make_batch`` and
``recall_prompt``.

``mqar`` — multi-query associative recall in the standard (Zoology) form. A sequence of ``L``
tokens over a vocabulary of ``V``: first ``N`` key–value pairs ``k₁ v₁ … k_N v_N`` (keys drawn
without replacement from ``[1, V/2)``, values from ``[V/2, V)``), then the ``N`` keys again as
queries, in a random order, at even offsets ``2g`` of the remaining ``L − 2N`` positions, the
gaps ``g`` drawn without replacement with probability ∝ ``a·g^(a−1)`` (``a = power_a``: most
queries come soon, some come late). Every other position holds a random token. The target at a
query's position is its value; no other position is scored.

``retrieval`` — long-context retrieval, asked the way a served request asks it. The sequence
opens with ``N`` facts ``k v w`` — a key from ``[1, V/2)`` and its two-token value, ``v`` and
``w`` drawn without replacement from ``[V/2, V)`` — then filler from ``[1, V/2)`` (never one of
the keys) up to a query point ``q`` (uniform in ``[L/4, L − 3Q]``); from ``q`` on come ``Q``
questions about distinct keys, each the fact again (``k v w``), then filler. The model is scored
on ``v`` after each asked key and on ``w`` after its ``v``; accuracy counts the ``w``. Both are
recall steps of MQAR's kind (what followed this token in the facts), across up to ``L − 3Q``
tokens of filler; but a prompt that ends with an asked key (``recall_prompt``) is answered by
the *second* generated token: ``v`` comes from prefill, ``w`` from the first decode step — so in
a disaggregated cluster the answer is right only if the state shipped to the decode worker
really holds the prompt.

A batch is a pure function of its key, so training data is ``make_batch(fold_in(key, step))``
and a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools

import jax
import jax.numpy as jnp

from prfaas_jax.errors import UserError


class Task(enum.StrEnum):
    MQAR = "mqar"
    RETRIEVAL = "retrieval"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The shape of a task's examples; ``__post_init__`` rejects what cannot be generated."""

    task: Task = Task.MQAR
    vocab_size: int = 256
    seq_len: int = 64
    num_pairs: int = 4
    num_queries: int = 2  # retrieval: questions per example
    power_a: float = 0.01  # mqar: the gaps' power law

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", Task(self.task))
        v, l, n = self.vocab_size, self.seq_len, self.num_pairs
        if n < 1:
            raise UserError(f"--num-pairs must be at least 1, got {n}")
        if v < 4 or v % 2:
            raise UserError(f"--vocab-size must be an even number ≥ 4, got {v}")
        if n > v // 2 - 1:
            raise UserError(f"{n} pairs need {n} distinct keys, but keys come from [1, {v // 2})")
        if self.task is Task.RETRIEVAL and 2 * n > v // 2:
            raise UserError(
                f"retrieval with {n} facts needs {2 * n} distinct values, but values come from "
                f"[{v // 2}, {v})"
            )
        if self.task is Task.MQAR and 4 * n > l:
            raise UserError(f"mqar needs --seq-len ≥ 4·num_pairs = {4 * n}, got {l}")
        if self.task is Task.RETRIEVAL:
            if not 1 <= self.num_queries <= n:
                raise UserError(f"retrieval asks 1 to num_pairs questions, got {self.num_queries}")
            if not _retrieval_fits(self, l):
                need = next(m for m in itertools.count(l) if _retrieval_fits(self, m))
                raise UserError(
                    f"retrieval with {n} facts and {self.num_queries} questions needs --seq-len ≥ "
                    f"{need}, got {l}"
                )
        if not 0 < self.power_a <= 1:
            raise UserError(f"power_a must be in (0, 1], got {self.power_a}")

    @property
    def answers_per_example(self) -> int:
        return self.num_pairs if self.task is Task.MQAR else self.num_queries


def _retrieval_fits(spec: TaskSpec, length: int) -> bool:
    """Room for the facts before the earliest query point and for the questions after it."""
    return length // 4 >= 3 * spec.num_pairs and length - length // 4 >= 3 * spec.num_queries


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """``tokens [B, L]`` int32 input; ``targets [B, L]`` int32, in the loss where ``mask [B, L]``;
    the answers (the accuracy's positions) where ``answer [B, L]``."""

    tokens: jax.Array
    targets: jax.Array
    mask: jax.Array
    answer: jax.Array


def _pairs(key: jax.Array, spec: TaskSpec) -> tuple[jax.Array, jax.Array]:
    half = spec.vocab_size // 2
    k_keys, k_values = jax.random.split(key)
    keys = jax.random.choice(k_keys, jnp.arange(1, half), (spec.num_pairs,), replace=False)
    values = jax.random.choice(
        k_values, jnp.arange(half, spec.vocab_size), (spec.num_pairs,), replace=False
    )
    return keys.astype(jnp.int32), values.astype(jnp.int32)


def _mqar_example(
    key: jax.Array, spec: TaskSpec
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    n, length = spec.num_pairs, spec.seq_len
    k_pairs, k_gaps, k_noise = jax.random.split(key, 3)
    keys, values = _pairs(k_pairs, spec)
    context = jnp.stack([keys, values], axis=1).reshape(-1)  # k1 v1 k2 v2 …
    space = (length - 2 * n) // 2
    gap = jnp.arange(1, space + 1, dtype=jnp.float32)
    prob = spec.power_a * gap ** (spec.power_a - 1)
    gaps = jax.random.choice(k_gaps, space, (n,), replace=False, p=prob / prob.sum())
    where = 2 * n + 2 * gaps  # a query's position; the pair order is random already
    tokens = jax.random.randint(k_noise, (length,), 0, spec.vocab_size, jnp.int32)
    tokens = tokens.at[: 2 * n].set(context).at[where].set(keys)
    targets = jnp.zeros((length,), jnp.int32).at[where].set(values)
    mask = jnp.zeros((length,), bool).at[where].set(True)
    return tokens, targets, mask, mask


def _retrieval_example(
    key: jax.Array, spec: TaskSpec, point: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    n, q, length, half = spec.num_pairs, spec.num_queries, spec.seq_len, spec.vocab_size // 2
    k_keys, k_values, k_point, k_noise, k_ask = jax.random.split(key, 5)
    keys = jax.random.choice(k_keys, jnp.arange(1, half), (n,), replace=False).astype(jnp.int32)
    values = jax.random.choice(k_values, jnp.arange(half, 2 * half), (2, n), replace=False)
    first, second = values.astype(jnp.int32)
    facts = jnp.stack([keys, first, second], axis=1).reshape(-1)  # k1 v1 w1 k2 v2 w2 …
    # Filler never repeats a key, so the only earlier occurrence of an asked key is its fact.
    filler = jax.random.randint(k_noise, (length,), 1, half - n, jnp.int32)
    filler = filler + jnp.sum(filler[:, None] >= jnp.sort(keys)[None, :] - jnp.arange(n), axis=1)
    if point is None:
        point = jax.random.randint(k_point, (), length // 4, length - 3 * q + 1)
    asked = jax.random.choice(k_ask, n, (q,), replace=False)
    at = point + 3 * jnp.arange(q)
    tokens = filler.at[: 3 * n].set(facts).at[at].set(keys[asked])
    tokens = tokens.at[at + 1].set(first[asked]).at[at + 2].set(second[asked])
    targets = jnp.zeros((length,), jnp.int32).at[at].set(first[asked])
    targets = targets.at[at + 1].set(second[asked])
    mask = jnp.zeros((length,), bool).at[at].set(True).at[at + 1].set(True)
    answer = jnp.zeros((length,), bool).at[at + 1].set(True)
    return tokens, targets, mask, answer


@functools.partial(jax.jit, static_argnames=("spec", "batch_size"))
def make_batch(key: jax.Array, spec: TaskSpec, batch_size: int) -> Batch:
    """``batch_size`` independent examples of ``spec``, a pure function of ``key`` (one compiled
    call: drawn op by op, a held-out set costs seconds of dispatch)."""
    example = _mqar_example if spec.task is Task.MQAR else _retrieval_example
    keys = jax.random.split(key, batch_size)
    tokens, targets, mask, answer = jax.vmap(lambda k: example(k, spec))(keys)
    return Batch(tokens=tokens, targets=targets, mask=mask, answer=answer)


def recall_prompt_lengths(spec: TaskSpec) -> tuple[int, int]:
    """The shortest and longest `recall_prompt` of a retrieval task."""
    if spec.task is not Task.RETRIEVAL:
        raise UserError(f"recall prompts are retrieval prompts, not {spec.task.value}")
    return spec.seq_len // 4 + 1, spec.seq_len - 3 * spec.num_queries + 1


def recall_prompt(
    key: jax.Array, spec: TaskSpec, length: int | None = None
) -> tuple[list[int], int]:
    """A ``retrieval`` prompt that ends with an asked key, and the second token of the value it asks
    for: the answer is the second token a model generates. ``length`` (default: drawn as in
    training) must be one a training example can have, in ``[L/4 + 1, L − 3Q + 1]``."""
    low, high = recall_prompt_lengths(spec)
    if length is not None and not low <= length <= high:
        raise UserError(f"a recall prompt of this task has {low} to {high} tokens, not {length}")
    point = None if length is None else length - 1
    tokens, targets, _, answer = _retrieval_example(key, spec, point)
    first = int(jnp.argmax(answer))  # where the first question's w is scored; its key is 1 before
    return [int(t) for t in tokens[:first]], int(targets[first])
