"""State size of one sequence, by formula, by the real prefill and by the codec: `state_sizes`.

For a model config and a length L, `StateSize` holds three totals that must agree:

- ``formula_bytes`` = `state_nbytes(cfg, L)`, the canonical representation of model/state.py
  (docs/design.md §3.2), split into ``growing_bytes`` (MLA, GQA: L·bytes/token), ``windowed_bytes``
  (SWA: min(L, W)·bytes/token), ``fixed_bytes`` (KDA, GDN, Lightning recurrent states and conv
  tails) and ``by_kind`` (per layer kind);
- ``measured_bytes`` = Σ ``nbytes`` over the per-layer arrays of the `ModelState` that the real
  `prefill` returns for L tokens into `init_state(cfg, 1, L)` (capacity L). Obtained by abstract
  evaluation: `jax.eval_shape` of `param_specs` and of `prefill`, so nothing is materialised and
  the full-size configs (80 blocks, 1T parameters, 128K tokens) cost only a trace. The trace is
  the cost: ≈0.01–0.05 s per block on one CPU core, independent of L (≈1 s for Kimi-Linear's 27
  blocks, ≈5 s for Qwen3-235B's 94). ``lengths`` (4 B per row) is not counted: the codec sends L
  in its header;
- ``serialized_bytes`` = the codec's payload: Σ bytes of `codec.layout.canonical_tensors(cfg, L)`,
  the tensor list `codec.encode` writes (its payload is exactly these buffers). It comes from the
  layout function because `encode` needs concrete arrays; tests/model/test_state_real_tensors.py
  runs the real `encode` on real reduced-depth states and checks it against the same sum.

`mixers_only(cfg)` is ``cfg`` with the smallest dense MLPs and vocabulary: the state depends on
the mixers alone, and building even the abstract parameters of 384 experts in 56 blocks takes
minutes, so `state_sizes(..., only_mixers=True)` traces that config (`prfaas codesign`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from prfaas_jax.config import LayerKind, MlpKind, ModelConfig
from prfaas_jax.engine.codec.layout import canonical_tensors
from prfaas_jax.model.hybrid import Params, param_specs, prefill
from prfaas_jax.model.state import ModelState, init_state, layer_nbytes, state_nbytes

Progress = Callable[[ModelConfig, int, float], None]  # (cfg, length, seconds) after each trace


@dataclass(frozen=True)
class StateSize:
    """Bytes of one sequence's state at ``length`` tokens (module docstring)."""

    length: int
    formula_bytes: int
    growing_bytes: int
    windowed_bytes: int
    fixed_bytes: int
    serialized_bytes: int
    by_kind: dict[str, int] = field(default_factory=dict)  # formula bytes per layer kind
    measured_bytes: int | None = None  # None when not measured
    measured_by_kind: dict[str, int] | None = None
    measure_seconds: float | None = None  # wall time of the abstract prefill


def abstract_prefill_state(cfg: ModelConfig, length: int, params: Params) -> ModelState:
    """The state the real `prefill` returns for ``length`` tokens into an empty state of
    capacity ``length``, by abstract evaluation (shapes and dtypes only)."""
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    state = jax.eval_shape(lambda: init_state(cfg, 1, length))
    _, out = jax.eval_shape(lambda p, t, s: prefill(p, cfg, t, s), params, tokens, state)
    return out


def nbytes_by_kind(cfg: ModelConfig, state: ModelState) -> dict[str, int]:
    """Σ nbytes of each layer's arrays (concrete or abstract), summed per layer kind."""
    totals = dict.fromkeys(_kinds(cfg), 0)
    for kind, layer in zip(cfg.layers, state.layers, strict=True):
        totals[kind.value] += sum(
            leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(layer)
        )
    return totals


def serialized_nbytes(cfg: ModelConfig, length: int) -> int:
    """Payload bytes `codec.encode` writes for one sequence of ``length`` tokens."""
    return sum(spec.nbytes for spec in canonical_tensors(cfg, length))


def _kinds(cfg: ModelConfig) -> list[str]:
    return [kind.value for kind in dict.fromkeys(cfg.layers)]


def formula_size(cfg: ModelConfig, length: int) -> StateSize:
    """The formula side of `StateSize` (no tracing)."""
    by_kind = dict.fromkeys(_kinds(cfg), 0)
    split = {"growing": 0, "windowed": 0, "fixed": 0}
    for kind in cfg.layers:
        nbytes = layer_nbytes(cfg, kind, length)
        by_kind[kind.value] += nbytes
        if kind.is_linear:
            split["fixed"] += nbytes
        else:
            split["windowed" if kind is LayerKind.SWA else "growing"] += nbytes
    return StateSize(
        length=length,
        formula_bytes=state_nbytes(cfg, length),
        growing_bytes=split["growing"],
        windowed_bytes=split["windowed"],
        fixed_bytes=split["fixed"],
        serialized_bytes=serialized_nbytes(cfg, length),
        by_kind=by_kind,
    )


def mixers_only(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with every MLP a dense SwiGLU of width 1 and a vocabulary of 2: the same state."""
    return dataclasses.replace(
        cfg, mlps=(MlpKind.DENSE,) * cfg.num_layers, mlp_dim=1, moe=None, vocab_size=2
    )


def state_sizes(
    cfg: ModelConfig,
    lengths: Sequence[int],
    *,
    measure: bool = True,
    only_mixers: bool = False,
    progress: Progress | None = None,
) -> list[StateSize]:
    """`StateSize` of ``cfg`` at each length; ``measure`` traces the real prefill at each one
    (of `mixers_only(cfg)` when ``only_mixers``)."""
    if any(length < 1 for length in lengths):
        raise ValueError(f"lengths must be ≥ 1, got {list(lengths)}")
    traced = mixers_only(cfg) if only_mixers else cfg
    params = param_specs(traced) if measure else None
    sizes = []
    for length in lengths:
        size = formula_size(cfg, length)
        if params is not None:
            start = time.perf_counter()
            by_kind = nbytes_by_kind(cfg, abstract_prefill_state(traced, length, params))
            seconds = time.perf_counter() - start
            if progress is not None:
                progress(cfg, length, seconds)
            size = dataclasses.replace(
                size,
                measured_bytes=sum(by_kind.values()),
                measured_by_kind=by_kind,
                measure_seconds=seconds,
            )
        sizes.append(size)
    return sizes
