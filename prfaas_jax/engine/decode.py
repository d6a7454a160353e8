"""``DecodeEngine``: fixed slots, continuous batching, one compiled step for the whole batch.

Also exposes ``NoFreeSlotError``.

A request lives in a slot from ``insert`` to ``free``. ``insert`` copies a batch-1 state into its
slot (one compiled function, the slot index a traced argument); each ``step`` runs one compiled
``decode_step`` over all ``max_slots`` rows, masking empty and finished slots with ``active``
(their state is untouched), then samples every row with its own settings and key
(``sampling.draw_tokens``: token ``i`` of a request uses ``fold_in(request_key(seed), i)``). So a
request yields the same tokens alone or interleaved with others, in any slot, inserted at any
step. A slot finishes on its EOS token or when its ``max_new_tokens`` are out; it keeps its slot
until ``free``. A request inserted with ``logprobs`` (its top count) also gets each token's
log-probability (engine/logprobs.py) from ``logprobs(slot)`` after each step: a step with such
a slot runs the compiled variant that computes them, so other batches pay nothing. Per-slot
controls (last token, token index, key, knobs) live on the host and travel with each step;
only the state stays on the device, donated from step to step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.logprobs import TokenLogprobs, as_token_logprobs, log_softmax_top, top_width
from prfaas_jax.engine.sampling import (
    GREEDY,
    SamplingParams,
    draw_tokens,
    request_key,
    sampling_knobs,
)
from prfaas_jax.engine.state_resize import check_fits, with_capacity
from prfaas_jax.errors import EngineError, LengthLimitError
from prfaas_jax.model import ModelState, decode_step, init_state
from prfaas_jax.model.sharding import shard_params, shard_state
from prfaas_jax.ops.dispatch import Impl


class NoFreeSlotError(EngineError):
    """Every slot holds a request: ``free`` one (or wait for one to finish) first."""


@dataclasses.dataclass
class _Request:
    remaining: int  # tokens this slot may still produce
    eos_id: int | None
    logprobs: int | None = None  # alternatives to report per token; None: no log-probabilities
    finished: bool = False


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
) -> tuple[ModelState, jax.Array] | tuple[ModelState, jax.Array, tuple]:
    """The next state and token of every slot; with ``top`` > 0 also their log-probabilities
    (`log_softmax_top`, ``top`` wide)."""
    logits, state = decode_step(params, cfg, tokens_S, state, impl=impl, active=active_S)
    drawn = draw_tokens(logits, keys_S2, index_S, temperature_S, top_k_S, top_p_S)
    if not top:
        return state, drawn
    return state, drawn, log_softmax_top(logits, drawn, top)


def _insert_row(slots: ModelState, row: ModelState, slot: jax.Array) -> ModelState:
    return jax.tree.map(
        lambda dst, src: jax.lax.dynamic_update_slice_in_dim(dst, src, slot, axis=0), slots, row
    )


# Module-level jits: engines of the same (cfg, impl) share JAX's compile cache.
_STEP = jax.jit(_decode_and_sample, static_argnames=("cfg", "impl", "top"), donate_argnums=(1,))
_INSERT = jax.jit(_insert_row, donate_argnums=(0,))


class DecodeEngine:
    """``max_slots`` concurrent requests, each up to ``max_len`` tokens of state."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        max_slots: int,
        max_len: int,
        impl: Impl | str = Impl.CHUNK,
        mesh: jax.sharding.Mesh | None = None,
    ) -> None:
        if max_slots < 1 or max_len < 1:
            raise EngineError(f"max_slots and max_len must be ≥ 1, got {max_slots}, {max_len}")
        # On a mesh params and slots are placed once by the sharding rules; jit propagates them.
        self.mesh = mesh
        if mesh is not None:
            params = shard_params(params, cfg, mesh)
        self.cfg, self.params, self.impl = cfg, params, Impl(impl)
        self.max_slots, self.max_len = max_slots, max_len
        shapes = jax.eval_shape(functools.partial(init_state, cfg, max_slots, max_len))
        # Zeros from the host: jnp.zeros would compile a fill per shape for nothing.
        self._state = jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), shapes)
        if mesh is not None:
            self._state = shard_state(self._state, cfg, mesh)
        self._tokens = np.zeros(max_slots, np.int32)  # last token of each slot: the next input
        self._index = np.zeros(max_slots, np.int32)  # key-schedule index of the next token
        self._keys = np.zeros((max_slots, 2), np.uint32)
        self._temperature = np.zeros(max_slots, np.float32)
        self._top_k = np.zeros(max_slots, np.int32)
        self._top_p = np.ones(max_slots, np.float32)
        self._requests: list[_Request | None] = [None] * max_slots
        self._logprobs: dict[int, TokenLogprobs] = {}  # the last step's, of slots that asked

    @property
    def free_slots(self) -> list[int]:
        return [slot for slot, req in enumerate(self._requests) if req is None]

    @property
    def active_slots(self) -> list[int]:
        """Slots that will produce a token on the next ``step``."""
        return [slot for slot, req in enumerate(self._requests) if req and not req.finished]

    def check_state(self, state: ModelState) -> None:
        """What ``insert`` checks of a state alone, without a slot or a copy: one sequence of
        this model, at most ``max_len`` long. A real state has nothing else to be checked
        against; the codec has checked its bytes."""
        if state.batch_size != 1:
            raise EngineError(f"insert takes one sequence, got a batch of {state.batch_size}")
        check_fits(state, self.cfg, self.max_len)

    def is_finished(self, slot: int) -> bool:
        """True once ``slot``'s request hit its EOS or budget (it holds the slot until ``free``)."""
        return self._request(slot).finished

    def _request(self, slot: int) -> _Request:
        req = self._requests[slot] if 0 <= slot < self.max_slots else None
        if req is None:
            raise EngineError(f"slot {slot} holds no request")
        return req

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
        vocab = self.cfg.vocab_size
        if not 0 <= first_token < vocab:
            raise EngineError(f"first token {first_token} outside the vocabulary [0, {vocab})")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if state.batch_size != 1:
            raise EngineError(f"insert takes one sequence, got a batch of {state.batch_size}")
        length = int(np.asarray(state.lengths)[0])
        # Each step absorbs the previous token, so n new tokens need L + n positions.
        if length + max_new_tokens > self.max_len:
            raise LengthLimitError(
                f"state ({length} tokens) + max_new_tokens ({max_new_tokens}) exceed the decode "
                f"engine's max_len {self.max_len}"
            )
        row = with_capacity(state, self.cfg, self.max_len)
        if self.mesh is not None:
            # Resharding on load: whatever layout (or host) the state came from, the row takes
            # this engine's layout, so a state prefilled on one mesh decodes on another.
            row = shard_state(row, self.cfg, self.mesh)
        free = self.free_slots
        if not free:
            raise NoFreeSlotError(f"all {self.max_slots} slots are busy")
        slot = free[0]
        key = request_key(sampling.seed)
        self._state = _INSERT(self._state, row, np.int32(slot))
        self._tokens[slot], self._keys[slot] = first_token, key
        self._index[slot] = sampling.first_index + 1
        knobs = sampling_knobs(sampling)
        self._temperature[slot], self._top_k[slot], self._top_p[slot] = (k[0] for k in knobs)
        self._requests[slot] = _Request(max_new_tokens, eos_id, logprobs)
        return slot

    def step(self) -> list[tuple[int, int]]:
        """One token for every active slot, as ``(slot, token)``; ``[]`` when none is active.

        A slot whose token is its EOS, or whose budget this token exhausts, is finished
        (``is_finished``) and produces nothing more.
        """
        active_slots = self.active_slots
        if not active_slots:
            return []
        active = np.zeros(self.max_slots, bool)
        active[active_slots] = True
        controls = (self._tokens, active, self._keys, self._index)
        knobs = (self._temperature, self._top_k, self._top_p)
        asked = [
            s for s in active_slots if getattr(self._requests[s], "logprobs", None) is not None
        ]
        top = top_width(self.cfg.vocab_size) if asked else 0
        self._state, tokens, *scored = _STEP(
            self.params, self._state, *controls, *knobs, cfg=self.cfg, impl=self.impl, top=top
        )
        tokens = np.asarray(tokens)
        self._logprobs = {}
        if asked:
            chosen, top_ids, top_logprobs = jax.device_get(scored[0])
            for slot in asked:
                req = self._requests[slot]
                assert req is not None and req.logprobs is not None
                row = slice(slot, slot + 1)
                (self._logprobs[slot],) = as_token_logprobs(
                    tokens[row], chosen[row], top_ids[row], top_logprobs[row], req.logprobs
                )
        out = []
        for slot in active_slots:
            req, token = self._requests[slot], int(tokens[slot])
            assert req is not None
            self._tokens[slot] = token
            self._index[slot] += 1
            req.remaining -= 1
            req.finished = req.remaining == 0 or token == req.eos_id
            out.append((slot, token))
        return out

    def logprobs(self, slot: int) -> TokenLogprobs | None:
        """The log-probabilities of the token the last ``step`` made for ``slot``; None when its
        request did not ask for them."""
        return self._logprobs.get(slot)

    def free(self, slot: int) -> None:
        """Release ``slot`` (finished or not); its state is overwritten by the next insert."""
        self._request(slot)
        self._requests[slot] = None
