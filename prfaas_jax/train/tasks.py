"""Synthetic recall tasks, generated in JAX: ``Task``, ``TaskSpec``, ``Batch`` and ``make_batch``.

``mqar`` — multi-query associative recall in the standard (Zoology) form. A sequence of ``L``
tokens over a vocabulary of ``V``: first ``N`` key–value pairs ``k₁ v₁ … k_N v_N`` (keys drawn
without replacement from ``[1, V/2)``, values from ``[V/2, V)``), then the ``N`` keys again as
queries, in a random order, at even offsets ``2g`` of the remaining ``L − 2N`` positions, the
gaps ``g`` drawn without replacement with probability ∝ ``a·g^(a−1)`` (``a = power_a``: most
queries come soon, some come late). Every other position holds a random token. The target at a
query's position is its value; no other position is scored.

``needle`` — long-context retrieval. ``L − 1`` random filler tokens from ``[1, V/2)`` hold
``N`` key–value pairs at random non-overlapping places (keys from ``[1, V/2)``, distinct from
each other and from the filler at no other place, values from ``[V/2, V)``); the last position
repeats one of the keys and its target is that key's value. Answering needs a memory of the
whole prompt, not of its recent past.

A batch is a pure function of its key, so training data is ``make_batch(fold_in(key, step))``
and a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from prfaas_jax.errors import UserError


class Task(enum.StrEnum):
    MQAR = "mqar"
    NEEDLE = "needle"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The shape of a task's examples; ``__post_init__`` rejects what cannot be generated."""

    task: Task = Task.MQAR
    vocab_size: int = 256
    seq_len: int = 64
    num_pairs: int = 4
    power_a: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", Task(self.task))
        v, l, n = self.vocab_size, self.seq_len, self.num_pairs
        if n < 1:
            raise UserError(f"--num-pairs must be at least 1, got {n}")
        if v < 4 or v % 2:
            raise UserError(f"--vocab-size must be an even number ≥ 4, got {v}")
        if n > v // 2 - 1:
            raise UserError(f"{n} pairs need {n} distinct keys, but keys come from [1, {v // 2})")
        if self.task is Task.MQAR and 4 * n > l:
            raise UserError(f"mqar needs --seq-len ≥ 4·num_pairs = {4 * n}, got {l}")
        if self.task is Task.NEEDLE and 2 * n + 1 > l:
            raise UserError(f"needle needs --seq-len ≥ 2·num_pairs + 1 = {2 * n + 1}, got {l}")
        if not 0 < self.power_a <= 1:
            raise UserError(f"power_a must be in (0, 1], got {self.power_a}")

    @property
    def answers_per_example(self) -> int:
        return self.num_pairs if self.task is Task.MQAR else 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """``tokens [B, L]`` int32 input; ``targets [B, L]`` int32, scored where ``mask [B, L]``."""

    tokens: jax.Array
    targets: jax.Array
    mask: jax.Array


def _pairs(key: jax.Array, spec: TaskSpec) -> tuple[jax.Array, jax.Array]:
    half = spec.vocab_size // 2
    k_keys, k_values = jax.random.split(key)
    keys = jax.random.choice(k_keys, jnp.arange(1, half), (spec.num_pairs,), replace=False)
    values = jax.random.choice(
        k_values, jnp.arange(half, spec.vocab_size), (spec.num_pairs,), replace=False
    )
    return keys.astype(jnp.int32), values.astype(jnp.int32)


def _mqar_example(key: jax.Array, spec: TaskSpec) -> tuple[jax.Array, jax.Array, jax.Array]:
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
    return tokens, targets, mask


def _needle_example(key: jax.Array, spec: TaskSpec) -> tuple[jax.Array, jax.Array, jax.Array]:
    n, length, half = spec.num_pairs, spec.seq_len, spec.vocab_size // 2
    k_pairs, k_slots, k_noise, k_ask = jax.random.split(key, 4)
    keys, values = _pairs(k_pairs, spec)
    # Filler never repeats a key, so the only earlier occurrence of the query is its pair.
    filler = jax.random.randint(k_noise, (length,), 1, half - n, jnp.int32)
    filler = filler + jnp.sum(filler[:, None] >= jnp.sort(keys)[None, :] - jnp.arange(n), axis=1)
    slots = jax.random.choice(k_slots, (length - 1) // 2, (n,), replace=False)
    tokens = filler.at[2 * slots].set(keys).at[2 * slots + 1].set(values)
    ask = jax.random.randint(k_ask, (), 0, n)
    tokens = tokens.at[length - 1].set(keys[ask])
    targets = jnp.zeros((length,), jnp.int32).at[length - 1].set(values[ask])
    mask = jnp.zeros((length,), bool).at[length - 1].set(True)
    return tokens, targets, mask


def make_batch(key: jax.Array, spec: TaskSpec, batch_size: int) -> Batch:
    """``batch_size`` independent examples of ``spec``, a pure function of ``key``."""
    example = _mqar_example if spec.task is Task.MQAR else _needle_example
    keys = jax.random.split(key, batch_size)
    tokens, targets, mask = jax.vmap(lambda k: example(k, spec))(keys)
    return Batch(tokens=tokens, targets=targets, mask=mask)
