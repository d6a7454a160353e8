"""``PrefillEngine``: a prompt in, a ``ModelState`` and the first sampled token out.

Also exposes ``PrefillResult`` and ``PrefillPlan``. The sampling-key schedule it shares with the
decode engine is in ``engine/sampling.py``; moving a state between capacities in
``engine/state_resize.py``.

Bounded recompiles. One compiled function absorbs a block of ``block_len`` tokens into a batch-1
state of ``capacity`` positions, ``valid_len`` marking the block's padding. For a prompt of ``T``
tokens after a prefix of ``P`` (``L = P + T``)::

    capacity  = max_len if given, else the smallest bucket ≥ L
    block_len = min(smallest bucket ≥ T, chunk_len)
    calls     = positions [P, L) cut at multiples of chunk_len, one call each, the last padded

Without a prefix or ``max_len`` both sizes are functions of ``bucket(L)``, so any number of
distinct prompt lengths costs at most one compile per bucket (``compile_count``). Cuts sit at
*absolute* multiples of ``chunk_len``: after a prefix that ends mid-chunk the first call only
completes that chunk, so every ``on_chunk`` state ends on a chunk boundary or at the prompt's
end — where a block-granular prefix cache can checkpoint it.

Prompt log-probabilities. ``score`` runs one prefill over a whole sequence that keeps every
position's logits (``prefill`` above keeps the last alone), padded to a bucket like a prompt, and
returns each token's log-probability after the tokens before it (engine/logprobs.py): asked for
per request, so a request that does not ask costs nothing more.

Batched prefill. ``prefill_batch`` runs several prompts per compiled call, each row in the shape
its prompt would compile alone but padded to a finer size than the bucket
(engine/batched_prefill.py), within a budget of padded tokens per call — at most four compiles per
bucket and power-of-two row count (``compile_batch`` compiles one ahead) — and, on a CPU, the
prompts in shares whose calls run in threads at once, one per core. Every row's first token is that
of ``prefill`` on its prompt, and its state too, up to fp32 rounding where a call holds several
rows (XLA rounds a matmul differently at another batch size). How several prompts are packed and
dealt between threads is engine/batched_prefill.py's.

Layer-wise streaming. With ``layer_groups = G > 1`` and an ``on_layers`` callback, the last call
runs as G compiled segments over consecutive groups of layers (``model.prefill_layers``), and
``on_layers(state, tokens_done, layers)`` runs after each with the group whose states just
became final — while the next group computes (JAX dispatches it first), so a caller that ships
those states overlaps the wire with the rest of the stack. Earlier calls stay whole: their KV
rows leave through ``on_chunk`` anyway. G segments cost G compiles per block shape.

The module is over 500 lines long because prefill, scoring, batched prefill and layer-wise
streaming are one engine's calls, planned alike and sharing its table of compiled executables,
its compile lock and its first-token sampler.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.api import OnLayers
from prfaas_jax.engine.api import split_layers as split_layers  # re-exported
from prfaas_jax.engine.batched_prefill import (
    BatchCall,
    batch_threads,
    plan_shares,
    row_size,
    row_states,
    sampling_args,
)
from prfaas_jax.engine.logprobs import TokenLogprobs, as_token_logprobs, log_softmax_top, top_width
from prfaas_jax.engine.sampling import (
    GREEDY,
    SamplingParams,
    draw_tokens,
    request_key,
    sampling_knobs,
)
from prfaas_jax.engine.state_resize import fresh_state, state_shapes, with_capacity
from prfaas_jax.errors import EngineError, LengthLimitError
from prfaas_jax.model import ModelState, prefill, prefill_layers
from prfaas_jax.model.sharding import shard_params, shard_state, to_host
from prfaas_jax.ops.dispatch import Impl

DEFAULT_CHUNK_LEN = 512
DEFAULT_BATCH_TOKENS = 4096  # padded tokens per batched call


# --- the engine ------------------------------------------------------------------------------


def default_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two from 16 below ``max_len``, then ``max_len``: one compile per doubling."""
    sizes = [16]
    while sizes[-1] < max_len:
        sizes.append(sizes[-1] * 2)
    return (*(s for s in sizes if s < max_len), max_len)


def pick_bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket ≥ ``size``; past the largest, a whole multiple of it (so compiles
    stay bounded per multiple)."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return -(-size // buckets[-1]) * buckets[-1]


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """How a prompt is run: the compiled shape and the absolute positions each call absorbs."""

    block_len: int  # tokens per call (padded)
    capacity: int  # positions of the working state's growing caches
    chunks: tuple[tuple[int, int], ...]  # [start, end) absolute positions, one per call


@dataclasses.dataclass(frozen=True)
class PrefillResult:
    state: ModelState  # batch 1, lengths [P + T], capacity max_len (if given) or P + T
    first_token: int  # sampled from logits_last: token 0 of the request's key schedule
    logits_last: np.ndarray  # [V] fp32 logits at the prompt's last position
    prefix_len: int  # P
    num_tokens: int  # T: prompt tokens absorbed
    plan: PrefillPlan
    timings: dict[str, float]  # compile_s (0 when cached), run_s, total_s


def _prefill_block(
    params: dict,
    tokens_1T: jax.Array,
    valid_len_1: jax.Array,
    state: ModelState,
    targets_1T: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    impl: Impl,
    k: int = 0,
) -> tuple[jax.Array | tuple, ModelState]:
    """The last position's logits and the state; with ``k`` > 0 (`score`), every position's
    `log_softmax_top` of its target (the token after it), ``k`` wide, in place of the logits."""
    logits, state = prefill(
        params, cfg, tokens_1T, state, impl=impl, valid_len=valid_len_1, last_only=not k
    )
    if not k:
        return logits, state
    assert targets_1T is not None
    return log_softmax_top(logits[0], targets_1T[0], k), state


# Module-level jits: engines of the same (cfg, impl) share JAX's compile cache. The working state
# is always ours (built by fresh_state), so every call donates it.
_PREFILL_BLOCK = jax.jit(_prefill_block, static_argnames=("cfg", "impl", "k"), donate_argnums=(3,))


def _prefill_group(
    params: dict,
    inputs: jax.Array,
    states: tuple,
    lengths: jax.Array,
    valid_len: jax.Array,
    *,
    cfg: ModelConfig,
    start: int,
    impl: Impl,
) -> tuple[jax.Array, tuple]:
    return prefill_layers(params, cfg, inputs, states, lengths, valid_len, start=start, impl=impl)


# A group's states are the working state's (made by fresh_state or an earlier call): donated.
_PREFILL_GROUP = jax.jit(
    _prefill_group, static_argnames=("cfg", "start", "impl"), donate_argnums=(2,)
)
_DRAW_TOKENS = jax.jit(draw_tokens)


class PrefillEngine:
    """Prefills a prompt (or several per call, ``prefill_batch``), with one executable per
    (rows, block_len, capacity) shape."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        *,
        impl: Impl | str = Impl.CHUNK,
        buckets: Sequence[int] | None = None,
        chunk_len: int = DEFAULT_CHUNK_LEN,
        mesh: jax.sharding.Mesh | None = None,
        layer_groups: int = 1,
    ) -> None:
        """``layer_groups``: segments of the last call when a caller streams layer by layer
        (module docstring); 1 runs every call whole."""
        buckets = default_buckets(cfg.max_len) if buckets is None else tuple(buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise EngineError(f"buckets must be increasing positive sizes, got {buckets}")
        if chunk_len < 1:
            raise EngineError(f"chunk_len must be ≥ 1, got {chunk_len}")
        # On a mesh the params are placed once by the sharding rules; jit propagates the rest.
        self.mesh = mesh
        if mesh is not None:
            params = shard_params(params, cfg, mesh)
        self.cfg, self.params, self.impl = cfg, params, Impl(impl)
        self.buckets, self.chunk_len = buckets, chunk_len
        if layer_groups < 1:
            raise EngineError(f"layer_groups must be ≥ 1, got {layer_groups}")
        self.groups = split_layers(cfg.num_layers, layer_groups)
        self._executables: dict[tuple, jax.stages.Compiled] = {}
        self._compiling = threading.Lock()  # prefill_batch's threads compile one at a time
        self._sampler: jax.stages.Compiled | None = None

    @property
    def compile_count(self) -> int:
        """Prefill executables this engine needed so far: each cost at most one compile (none
        when another engine in the process compiled it first). The first-token sampler, one
        program per vocabulary size, is not counted."""
        return len(self._executables)

    def bucket(self, size: int) -> int:
        """The capacity a state of ``size`` tokens is padded to."""
        return pick_bucket(self.buckets, size)

    def plan(
        self, num_tokens: int, *, prefix_len: int = 0, max_len: int | None = None
    ) -> PrefillPlan:
        """The ``PrefillPlan`` for ``num_tokens`` new tokens after ``prefix_len`` (no compile)."""
        total = prefix_len + num_tokens
        if num_tokens < 1:
            raise EngineError("the prompt is empty")
        if max_len is not None and max_len > self.cfg.max_len:
            # Never cut to the model's limit silently: the caller lifts it (cfg.with_max_len).
            raise EngineError(
                f"a capacity of {max_len} tokens exceeds the model's max_len {self.cfg.max_len}"
            )
        limit = self.cfg.max_len if max_len is None else max_len
        if total > limit:
            raise LengthLimitError(
                f"prefix ({prefix_len}) + prompt ({num_tokens}) = {total} tokens exceed "
                f"{'the model' if max_len is None else 'max_len'}'s limit of {limit}"
            )
        capacity = self.bucket(total) if max_len is None else max_len
        cuts = range(prefix_len // self.chunk_len * self.chunk_len, total, self.chunk_len)
        starts = [max(cut, prefix_len) for cut in cuts]
        chunks = tuple(zip(starts, [*starts[1:], total], strict=True))
        return PrefillPlan(min(self.bucket(num_tokens), self.chunk_len), capacity, chunks)

    def _executable(self, *args) -> tuple[jax.stages.Compiled, float]:
        # Keyed by shapes, not by plan: capacities past an SWA-only model's window share one.
        key = (args[1].shape[1], *(leaf.shape for leaf in jax.tree.leaves(args[3])))
        if key in self._executables:
            return self._executables[key], 0.0
        with self._compiling:
            if key in self._executables:  # another thread compiled it while this one waited
                return self._executables[key], 0.0
            start = time.perf_counter()
            compiled = _PREFILL_BLOCK.lower(*args, cfg=self.cfg, impl=self.impl).compile()
            self._executables[key] = compiled
            return compiled, time.perf_counter() - start

    def _segment(self, group: range, args: tuple) -> tuple[jax.stages.Compiled, float]:
        """The compiled segment of ``group``'s layers for these argument shapes."""
        key = ("layers", group.start, *(leaf.shape for leaf in jax.tree.leaves(args[1:4])))
        if key in self._executables:
            return self._executables[key], 0.0
        start = time.perf_counter()
        lowered = _PREFILL_GROUP.lower(*args, cfg=self.cfg, start=group.start, impl=self.impl)
        compiled = lowered.compile()
        self._executables[key] = compiled
        return compiled, time.perf_counter() - start

    def _run_by_layers(
        self, block: np.ndarray, valid: np.ndarray, state: ModelState, on_layers: OnLayers, end: int
    ) -> tuple[jax.Array, ModelState, float]:
        """One call as segments over ``self.groups``; ``on_layers`` sees each group's final
        states while the next group computes. Returns the logits, the state, compile seconds."""
        layers = list(state.layers)
        lengths = np.asarray(state.lengths)
        # A device array, as the whole call returns (device_put compiles nothing).
        done = ModelState(lengths=jax.device_put(lengths + valid), layers=state.layers)
        inputs, compile_s, ready = block, 0.0, None
        for group in self.groups:
            args = (self.params, inputs, tuple(layers[group.start : group.stop]), lengths, valid)
            compiled, seconds = self._segment(group, args)
            compile_s += seconds
            inputs, outputs = compiled(*args)  # dispatched: it computes while we ship
            layers[group.start : group.stop] = outputs
            if ready is not None:
                on_layers(dataclasses.replace(done, layers=tuple(layers)), end, ready)
            ready = group
        state = dataclasses.replace(done, layers=tuple(layers))
        on_layers(state, end, ready)
        return inputs, state, compile_s

    def _checked_ids(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """``tokens`` as a flat array; raises ``EngineError`` on an id outside the vocabulary."""
        ids = np.asarray(tokens, np.int64).reshape(-1)
        if ids.size and not (ids.min() >= 0 and ids.max() < self.cfg.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)][:5].tolist()
            raise EngineError(
                f"token id(s) {bad} outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        return ids

    def sample_first(self, logits_1V: jax.Array, sampling: SamplingParams) -> tuple[int, float]:
        """Token 0 of a request from its last prompt position's logits ``[1, V]``, and the
        seconds spent compiling the sampler (0 once it exists)."""
        index = np.array([sampling.first_index], np.int32)
        args = (logits_1V, request_key(sampling.seed)[None], index)
        args += sampling_knobs(sampling)
        compile_s = 0.0
        if self._sampler is None:
            start = time.perf_counter()
            self._sampler = _DRAW_TOKENS.lower(*args).compile()
            compile_s = time.perf_counter() - start
        return int(np.asarray(self._sampler(*args))[0]), compile_s

    def score(self, tokens: Sequence[int], top: int = 0) -> list[TokenLogprobs]:
        """The log-probability of each of ``tokens[1:]`` after the tokens before it, with the
        ``top`` most likely tokens at its position (module docstring). The last token is only
        scored, never read: a prompt of ``max_len`` tokens and the token after it fit."""
        ids = np.asarray(tokens, np.int32)
        n = len(ids) - 1  # positions read, each scoring the token after it
        if n < 1:
            return []
        if n > self.cfg.max_len:
            raise LengthLimitError(f"{n} tokens exceed max_len {self.cfg.max_len}")
        size = self.bucket(n)
        block, targets = np.zeros((2, 1, size), np.int32)
        block[0, :n], targets[0, :n] = ids[:-1], ids[1:]
        state = fresh_state(self.cfg, size, None)
        if self.mesh is not None:
            state = shard_state(state, self.cfg, self.mesh)
        valid = np.array([n], np.int32)
        k = top_width(self.cfg.vocab_size)
        args = (self.params, block, valid, state, targets)
        out, _ = _PREFILL_BLOCK(*args, cfg=self.cfg, impl=self.impl, k=k)
        chosen, top_ids, top_logprobs = (a[:n] for a in jax.device_get(out))
        return as_token_logprobs(ids[1:], chosen, top_ids, top_logprobs, top)

    def prefill(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        prefix: ModelState | None = None,
        on_chunk: Callable[[ModelState, int], None] | None = None,
        sampling: SamplingParams = GREEDY,
        max_len: int | None = None,
        on_layers: OnLayers | None = None,
    ) -> PrefillResult:
        """Absorb ``tokens`` (after ``prefix``, a batch-1 state) and sample the first token.

        ``on_chunk(state, tokens_done)`` runs after each call, once its KV is final:
        ``tokens_done`` counts every position in ``state`` (prefix included). That state is the
        engine's working buffer, donated to the next call: read it inside the callback (e.g.
        encode it) and keep no reference. ``max_len`` fixes the result's capacity (it then also
        sizes the compiled working state); by default the result holds just ``P + T``.
        ``on_layers`` (with ``layer_groups > 1``) streams the last call layer by layer (module
        docstring), before that call's ``on_chunk``.
        """
        start = time.perf_counter()
        ids = self._checked_ids(tokens)
        if prefix is not None and prefix.batch_size != 1:
            raise EngineError(f"a prefix must be one sequence, got a batch of {prefix.batch_size}")
        prefix_len = 0 if prefix is None else int(np.asarray(prefix.lengths)[0])
        plan = self.plan(ids.size, prefix_len=prefix_len, max_len=max_len)
        state = fresh_state(self.cfg, plan.capacity, prefix)
        if self.mesh is not None:
            state = shard_state(state, self.cfg, self.mesh)
        compile_s, logits = 0.0, None
        by_layers = on_layers is not None and len(self.groups) > 1
        for begin, end in plan.chunks:
            block = np.zeros((1, plan.block_len), np.int32)
            block[0, : end - begin] = ids[begin - prefix_len : end - prefix_len]
            valid = np.array([end - begin], np.int32)
            if by_layers and end == plan.chunks[-1][1]:
                assert on_layers is not None
                logits, state, seconds = self._run_by_layers(block, valid, state, on_layers, end)
            else:
                args = (self.params, block, valid, state)
                compiled, seconds = self._executable(*args)
                logits, state = compiled(*args)
            compile_s += seconds
            if on_chunk is not None:
                jax.block_until_ready(state)
                on_chunk(state, end)
        first_token, seconds = self.sample_first(logits, sampling)
        compile_s += seconds
        if self.mesh is not None:
            # The result is layout-free, as from one device: gathered (across hosts if the mesh
            # spans them) and put on this process's default device, whatever mesh decodes it.
            logits, state = to_host((logits, state))
            state = jax.device_put(state)
        run_s = time.perf_counter() - start - compile_s
        if max_len is None:
            state = with_capacity(state, self.cfg, prefix_len + ids.size)
        return PrefillResult(
            state=state,
            first_token=first_token,
            logits_last=np.asarray(logits)[0],
            prefix_len=prefix_len,
            num_tokens=int(ids.size),
            plan=plan,
            timings={
                "compile_s": compile_s,
                "run_s": run_s,
                "total_s": time.perf_counter() - start,
            },
        )

    def compile_batch(self, rows: int, block_len: int, capacity: int) -> None:
        """Compile, running nothing, `prefill_batch`'s call of ``rows`` rows of ``block_len``
        tokens into ``capacity`` positions, and the first-token sampler for ``rows`` rows."""
        block, valid = (jax.ShapeDtypeStruct(s, np.int32) for s in ((rows, block_len), (rows,)))
        state = state_shapes(self.cfg, rows, capacity)
        logits = self._executable(self.params, block, valid, state)[0].out_info[0]
        _DRAW_TOKENS(np.zeros(logits.shape, logits.dtype), *sampling_args([GREEDY] * rows))

    def prefill_batch(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        *,
        max_len: int | None = None,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
        sampling: Sequence[SamplingParams] | None = None,
        threads: int | None = None,
    ) -> list[PrefillResult]:
        """``prefill`` of each prompt (``sampling[i]`` for prompt ``i``, greedy by default), rows
        of one compiled shape sharing calls of at most ``max_batch_tokens`` padded tokens, the
        prompts split into ``threads`` shares (default ``batch_threads()``) whose calls run at
        once (engine/batched_prefill.py). No prefix, callbacks or mesh: those stay with
        ``prefill``."""
        start = time.perf_counter()
        if self.mesh is not None:
            raise EngineError("batched prefill runs on one device; prefill on a mesh one by one")
        rows = [self._checked_ids(tokens) for tokens in prompts]
        sampling = [GREEDY] * len(rows) if sampling is None else list(sampling)
        if len(sampling) != len(rows):
            raise EngineError(f"{len(sampling)} sampling settings for {len(rows)} prompts")
        sizes = [ids.size for ids in rows]
        plans = [self._batch_plan(n, max_len) for n in sizes]
        shares = self._batch_shares(sizes, max_len, max_batch_tokens, threads)
        results: list[PrefillResult | None] = [None] * len(rows)

        def run(calls: list[BatchCall]) -> float:
            """One share's calls, one after another; returns their compile seconds."""
            compile_s = 0.0
            for call in calls:
                outputs, seconds = self._batch_call(call, rows, plans, sampling, max_len)
                compile_s += seconds
                for row, result in zip(call.rows, outputs, strict=True):
                    results[row] = result
            return compile_s

        if len(shares) > 1:
            with ThreadPoolExecutor(len(shares)) as pool:
                compile_s = sum(pool.map(run, shares))
        else:
            compile_s = sum(map(run, shares))
        total_s = time.perf_counter() - start
        # The calls are shared: every row reports the whole batch's times.
        timings = {"compile_s": compile_s, "run_s": total_s - compile_s, "total_s": total_s}
        return [dataclasses.replace(r, timings=timings) for r in results if r is not None]

    def batch_shapes(
        self,
        lengths: Sequence[int],
        *,
        max_len: int | None = None,
        max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
        threads: int | None = None,
    ) -> set[tuple[int, int, int]]:
        """The ``(rows, block_len, capacity)`` — `compile_batch`'s arguments — of each call
        ``prefill_batch`` makes for prompts of ``lengths`` with these options; runs nothing."""
        shares = self._batch_shares(lengths, max_len, max_batch_tokens, threads)
        return {(len(c.rows), c.block_len, c.capacity) for calls in shares for c in calls}

    def _batch_shares(
        self,
        lengths: Sequence[int],
        max_len: int | None,
        max_batch_tokens: int,
        threads: int | None,
    ) -> list[list[BatchCall]]:
        """Each thread's calls for prompts of ``lengths`` (engine/batched_prefill.py)."""

        def shape_of(num_tokens: int) -> tuple[int, int]:
            plan = self._batch_plan(num_tokens, max_len)
            return plan.block_len, plan.capacity

        return plan_shares(
            lengths,
            shape_of,
            shares=batch_threads() if threads is None else threads,
            chunk_len=self.chunk_len,
            max_batch_tokens=max_batch_tokens,
        )

    def _batch_plan(self, num_tokens: int, max_len: int | None) -> PrefillPlan:
        """``plan``'s calls for a prompt, in the shape of a batched row (``row_size``)."""
        plan = self.plan(num_tokens, max_len=max_len)
        size = row_size(num_tokens, self.bucket(num_tokens))
        capacity = size if max_len is None else max_len
        return dataclasses.replace(plan, block_len=min(size, self.chunk_len), capacity=capacity)

    def _batch_call(
        self,
        call: BatchCall,
        rows: Sequence[np.ndarray],
        plans: Sequence[PrefillPlan],
        sampling: Sequence[SamplingParams],
        max_len: int | None,
    ) -> tuple[list[PrefillResult], float]:
        """The results of ``call``'s rows (prompts ``rows[r]``, planned ``plans[r]``), in its row
        order, without timings; and the seconds spent compiling."""
        sizes = [ids.size for ids in rows]
        state = fresh_state(self.cfg, call.capacity, None, batch=len(call.rows))
        last: dict[int, jax.Array] = {}  # slot -> the logits of the call that ended its row
        compile_s = 0.0
        for spans in call.windows(sizes, self.chunk_len):
            block = np.zeros((len(call.rows), call.block_len), np.int32)
            for slot, row in enumerate(call.rows):
                begin, end = spans[slot]
                block[slot, : end - begin] = rows[row][begin:end]
            valid = (spans[:, 1] - spans[:, 0]).astype(np.int32)
            args = (self.params, block, valid, state)
            compiled, seconds = self._executable(*args)
            compile_s += seconds
            logits, state = compiled(*args)
            for slot, row in enumerate(call.rows):
                if valid[slot] and spans[slot, 1] == sizes[row]:
                    last[slot] = logits
        # Each row's last logits, from the call that ended it, sampled in one call.
        host = {id(out): np.asarray(out) for out in last.values()}
        logits_BV = np.stack([host[id(last[slot])][slot] for slot in range(len(call.rows))])
        picks = [sampling[row] for row in call.rows]
        firsts = np.asarray(_DRAW_TOKENS(logits_BV, *sampling_args(picks)))
        capacities = [sizes[row] if max_len is None else max_len for row in call.rows]
        states = row_states(state, self.cfg, capacities)
        results = [
            PrefillResult(
                state=row_state,
                first_token=int(firsts[slot]),
                logits_last=logits_BV[slot],
                prefix_len=0,
                num_tokens=sizes[row],
                plan=plans[row],
                timings={},
            )
            for slot, (row, row_state) in enumerate(zip(call.rows, states, strict=True))
        ]
        return results, compile_s
