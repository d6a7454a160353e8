"""``with_capacity``: the same sequences of a ``ModelState`` in caches of another capacity;
``check_fits``: its checks alone; ``fresh_state``: a new working state of a given capacity;
``state_shapes``: the shapes and dtypes of an empty state.

Attention caches (MLA, GQA, SWA) have a capacity axis (axis 1); recurrent states do not. Engines
resize states when a prefix is continued, when a state moves from a prefill engine's bucket to a
decode slot, and when a cached prefix is reused; this module is the one place that does it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.errors import EngineError
from prfaas_jax.model import MlaState, ModelState, init_state
from prfaas_jax.model.state import KvState, WindowKvState

_TOKEN_AXIS_LAYERS = (MlaState, KvState, WindowKvState)  # axis 1 counts positions


@functools.lru_cache(maxsize=256)
def state_shapes(cfg: ModelConfig, batch: int, capacity: int) -> ModelState:
    """The ``jax.ShapeDtypeStruct`` of every array of ``init_state(cfg, batch, capacity)``.

    Cached: tracing ``init_state`` costs milliseconds per call (a few per prompt when every
    prefill resizes its result), and the answer depends only on these three values.
    """
    return jax.eval_shape(functools.partial(init_state, cfg, batch, capacity))


def _check_fits(state: ModelState, want: ModelState, cfg: ModelConfig) -> None:
    def fail(what: str) -> None:
        raise EngineError(f"the state does not fit model {cfg.name!r}: {what}")

    if len(state.layers) != len(want.layers) or np.ndim(state.lengths) != 1:
        fail(f"it has {len(state.layers)} layers, the model {len(want.layers)}")
    for index, (have, need) in enumerate(zip(state.layers, want.layers, strict=True)):
        if type(have) is not type(need):
            fail(f"layer {index} is a {type(have).__name__}, the model has a {type(need).__name__}")
        for field in dataclasses.fields(need):
            a, b = getattr(have, field.name), getattr(need, field.name)
            # Axis 1 of an attention cache is its capacity; every other axis is fixed by cfg.
            free = isinstance(need, _TOKEN_AXIS_LAYERS)
            shapes = [list(a.shape), list(b.shape)]
            if free and a.ndim == b.ndim:
                shapes = [shape[:1] + shape[2:] for shape in shapes]
            if a.dtype != b.dtype or shapes[0] != shapes[1]:
                fail(
                    f"layer {index} {field.name} is {a.dtype}{list(a.shape)}, the model needs "
                    f"{b.dtype}{list(b.shape)}" + (" (any size on axis 1)" if free else "")
                )


def _fitting(state: ModelState, cfg: ModelConfig, capacity: int) -> tuple[ModelState, int]:
    """The shapes of ``state`` at ``capacity``, and its longest sequence; raises
    ``EngineError`` when it does not fit ``cfg`` or ``capacity``."""
    want = state_shapes(cfg, state.batch_size, capacity)
    _check_fits(state, want, cfg)
    longest = int(np.max(np.asarray(state.lengths), initial=0))
    if longest > capacity:
        raise EngineError(f"the state holds {longest} tokens, more than capacity {capacity}")
    return want, longest


def check_fits(state: ModelState, cfg: ModelConfig, capacity: int) -> None:
    """Raise ``EngineError`` when ``state`` does not fit ``cfg`` or ``capacity``: the checks of
    `with_capacity`, without moving a byte."""
    _fitting(state, cfg, capacity)


def with_capacity(
    state: ModelState, cfg: ModelConfig, capacity: int, *, copy: bool = False
) -> ModelState:
    """``state``'s sequences in caches of ``capacity`` positions.

    Growing caches keep their first positions; SWA rings keep position ``p`` in slot
    ``p mod W'``, where it already is whenever both rings hold every live position or both are
    whole windows. Arrays of the right shape are reused unless ``copy``; the others are rebuilt
    in host memory and put back with ``device_put``, which compiles nothing (an on-device slice
    or pad, or ``jnp.asarray``, would compile once per distinct shape).
    Raises ``EngineError`` when the state does not fit ``cfg`` or ``capacity``.
    """
    want, longest = _fitting(state, cfg, capacity)

    def resize(have: jax.Array, need: jax.ShapeDtypeStruct) -> jax.Array:
        if have.shape == need.shape:
            return jax.device_put(have, may_alias=False) if copy else have
        keep = min(have.shape[1], need.shape[1])
        if longest > keep:
            raise EngineError(
                f"a {have.shape[1]}-slot cache cannot hold the {longest} positions the state's "
                "lengths claim: the state is inconsistent"
            )
        out = np.zeros(need.shape, need.dtype)
        out[:, :keep] = np.asarray(have)[:, :keep]
        return jax.device_put(out)

    return jax.tree.map(resize, state, want)


def fresh_state(
    cfg: ModelConfig, capacity: int, prefix: ModelState | None, *, batch: int = 1
) -> ModelState:
    """A working state of ``batch`` rows (1 with a ``prefix``, which it holds) in new buffers (so
    donating it never frees a caller's arrays); zeros come from the host, where they cost no
    compile."""
    if prefix is not None:
        return with_capacity(prefix, cfg, capacity, copy=True)
    want = state_shapes(cfg, batch, capacity)
    return jax.tree.map(lambda w: jax.device_put(np.zeros(w.shape, w.dtype)), want)
