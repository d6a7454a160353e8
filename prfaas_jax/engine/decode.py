"""``DecodeEngine``: fixed slots, continuous batching, one compiled step for the busy rows.

Also exposes ``NoFreeSlotError``.

A request lives in a slot from ``insert`` to ``free``. ``insert`` copies a batch-1 state into its
slot (one compiled function, the slot index a traced argument; the lowest free slot is taken); each
``step`` runs one compiled ``decode_step`` over the first ``rows`` slots, the smallest power of two
that holds every active slot, masking empty and finished slots with ``active`` (their state is
untouched). A step's cost grows with its rows, so a lightly loaded engine does not pay for its idle
slots; the rows beyond are neither read nor written. It then samples every row with its own
settings and key (``sampling.draw_tokens``: token ``i`` of a request uses
``fold_in(request_key(seed), i)``). So a request yields the same tokens alone or interleaved with
others, in any slot, inserted at any step. A slot finishes on its EOS token or when its
``max_new_tokens`` are out; it keeps its slot until ``free``. A request inserted with ``logprobs``
(its top count) also gets each token's log-probability (engine/logprobs.py) from ``logprobs(slot)``
after each step: a step with such a slot runs the compiled variant that computes them, so other
batches pay nothing. Per-slot controls (last token, token index, key, knobs) live on the host and
travel with each step; only the state stays on the device, donated from step to step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.decode_slots import NoFreeSlotError as NoFreeSlotError  # re-exported
from prfaas_jax.engine.decode_slots import SlotControls
from prfaas_jax.engine.logprobs import log_softmax_top
from prfaas_jax.engine.sampling import GREEDY, SamplingParams, draw_tokens
from prfaas_jax.engine.state_resize import with_capacity
from prfaas_jax.model import ModelState, decode_step, init_state
from prfaas_jax.model.decode_weights import decode_weights
from prfaas_jax.model.narrow_weights import narrow_weights
from prfaas_jax.model.sharding import shard_params, shard_state
from prfaas_jax.ops.dispatch import Impl


def _decode_and_sample(
    params: dict,
    state: ModelState,
    tokens_S: jax.Array,
    active_S: jax.Array,
    keys_S2: jax.Array,
    index_S: jax.Array,
    temperature_S: jax.Array,
    top_k_S: jax.Array,
    top_p_S: jax.Array,
    *,
    cfg: ModelConfig,
    impl: Impl,
    top: int = 0,
    rows: int | None = None,
) -> tuple[ModelState, jax.Array] | tuple[ModelState, jax.Array, tuple]:
    """The next state and token of the first ``rows`` slots (all when None; the controls hold
    ``rows`` entries); with ``top`` > 0 also their log-probabilities (`log_softmax_top`,
    ``top`` wide). The other slots' state comes back as it went in."""
    part = state if rows is None else jax.tree.map(lambda x: x[:rows], state)
    logits, part = decode_step(params, cfg, tokens_S, part, impl=impl, active=active_S)
    if rows is not None:  # written back in place: the state is donated
        part = jax.tree.map(lambda x, p: x.at[:rows].set(p), state, part)
    drawn = draw_tokens(logits, keys_S2, index_S, temperature_S, top_k_S, top_p_S)
    if not top:
        return part, drawn
    return part, drawn, log_softmax_top(logits, drawn, top)


def _insert_row(slots: ModelState, row: ModelState, slot: jax.Array) -> ModelState:
    return jax.tree.map(
        lambda dst, src: jax.lax.dynamic_update_slice_in_dim(dst, src, slot, axis=0), slots, row
    )


# Module-level jits: engines of the same (cfg, impl) share JAX's compile cache.
_STEP = jax.jit(
    _decode_and_sample, static_argnames=("cfg", "impl", "top", "rows"), donate_argnums=(1,)
)


def step_rows(active_slots: list[int], max_slots: int) -> int:
    """The rows a step runs: the smallest power of two that holds every active slot, at most
    ``max_slots`` (so a step compiles for at most log2(max_slots) + 1 row counts)."""
    return min(1 << max(active_slots).bit_length(), max_slots)


_INSERT = jax.jit(_insert_row, donate_argnums=(0,))


class DecodeEngine(SlotControls):
    """``max_slots`` concurrent requests, each up to ``max_len`` tokens of state.

    ``weight_dtype`` (e.g. ``"bfloat16"``) narrows the projection matrices for decode
    (model/narrow_weights.py): half the bytes per step, activations and state unchanged, tokens
    within rounding of the full-width weights (docs/performance.md has where it pays on CPU).
    Off a mesh the engine holds MLA's ``kv_b`` split once for the absorbed decode
    (model/decode_weights.py); every other weight is the caller's array.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        max_slots: int,
        max_len: int,
        impl: Impl | str = Impl.CHUNK,
        mesh: jax.sharding.Mesh | None = None,
        weight_dtype: str | None = None,
    ) -> None:
        super().__init__(cfg, max_slots, max_len)
        if weight_dtype is not None:
            params = narrow_weights(params, weight_dtype)
        # On a mesh params and slots are placed once by the sharding rules; jit propagates them.
        self.mesh = mesh
        if mesh is not None:
            params = shard_params(params, cfg, mesh)
        else:  # MLA's kv_b split once for decode (the sharding rules place kv_b as loaded)
            params = decode_weights(cfg, params)
        self.params, self.impl = params, Impl(impl)
        shapes = jax.eval_shape(functools.partial(init_state, cfg, max_slots, max_len))
        # Zeros from the host: jnp.zeros would compile a fill per shape for nothing.
        self._state = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), shapes)
        if mesh is not None:
            self._state = shard_state(self._state, cfg, mesh)

    def insert(
        self,
        state: ModelState,
        first_token: int,
        sampling: SamplingParams = GREEDY,
        *,
        max_new_tokens: int,
        eos_id: int | None = None,
        logprobs: int | None = None,
    ) -> int:
        """Start decoding a prefilled request; returns its slot.

        ``state`` is one sequence of any capacity ≤ ``max_len`` (a state already of capacity
        ``max_len``, e.g. ``codec.decode(..., max_len=engine.max_len)``, skips a host copy);
        ``first_token`` was sampled by prefill (token 0 of the request); the slot then yields up
        to ``max_new_tokens`` more, stopping early after ``eos_id``.
        """
        self._check_insert(state, first_token, max_new_tokens)
        row = with_capacity(state, self.cfg, self.max_len)
        if self.mesh is not None:
            # Resharding on load: whatever layout (or host) the state came from, the row takes
            # this engine's layout, so a state prefilled on one mesh decodes on another.
            row = shard_state(row, self.cfg, self.mesh)
        slot = self._free_slot()
        self._state = _INSERT(self._state, row, np.int32(slot))
        self._admit(slot, first_token, sampling, max_new_tokens, eos_id, logprobs)
        return slot

    def step(self) -> list[tuple[int, int]]:
        """One token for every active slot, as ``(slot, token)``; ``[]`` when none is active.

        A slot whose token is its EOS, or whose budget this token exhausts, is finished
        (``is_finished``) and produces nothing more.
        """
        return self.step_with(_STEP)[0]

    def step_with(self, program: Callable, *extra: object) -> tuple[list[tuple[int, int]], object]:
        """``step`` through ``program``, a jitted function called as this engine's step program
        is, with ``extra`` after the controls, that returns what the step program returns and
        then its own outputs (one compiled call that steps the slots and does more:
        engine/mixed_step.py). Returns the step's ``(slot, token)`` pairs and those outputs
        (None without ``extra``); ``([], None)`` when no slot is active, calling nothing.
        """
        active_slots = self.active_slots
        if not active_slots:
            return [], None
        asked, top = self._top(active_slots)
        rows = self.rows()
        self._state, tokens, *rest = program(
            self.params,
            self._state,
            *(c[:rows] for c in self._controls(active_slots)),
            *extra,
            cfg=self.cfg,
            impl=self.impl,
            top=top,
            rows=None if rows == self.max_slots else rows,
        )
        beside = rest.pop() if extra else None
        tokens = np.asarray(tokens)
        self._keep_logprobs(asked, {slot: slot for slot in asked}, tokens, rest)
        return self._advance(active_slots, tokens), beside

    def rows(self) -> int:
        """The rows the next ``step`` runs (0: no active slot)."""
        active_slots = self.active_slots
        if not active_slots:
            return 0
        # On a mesh the batch axis may be sharded: every step keeps the whole batch.
        return step_rows(active_slots, self.max_slots) if self.mesh is None else self.max_slots

    def free(self, slot: int) -> None:
        """Release ``slot`` (finished or not); its state is overwritten by the next insert."""
        self._release(slot)
