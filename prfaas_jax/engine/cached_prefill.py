"""``CachedPrefill``: prefill that computes only the part of a prompt no cached prefix covers.

Also exposes ``ReuseStats`` (what the reuse saved) and ``REUSE_SOURCES`` (where a reused prefix
came from: none, host memory, the disk tier, imported). It drives any ``PrefillEngineLike``
(engine/api.py): ``PrefillEngine``, or the fake engine.

For a prompt ``x`` of ``L`` tokens and a ``PrefixCache``::

    hit   = cache.match(x)                      longest P < L with its KV blocks *and* a
                                                linear checkpoint at exactly P
    state = engine.prefill(x[P:], prefix=cache.build_state(hit))
    while prefilling, at every chunk end e in cache.checkpoint_lengths(L):
          cache.insert(x[:e], state_e)          e = multiples of block_size·checkpoint_every, and L

Outputs do not change: the prefix state is the exact canonical state the cold prefill had after
``P`` tokens (host copies, no recomputation), and prefilling the rest from it is the model's
"split at any boundary" invariant. The engine cuts its calls at absolute multiples of
``chunk_len``, so a checkpoint is saved at a block boundary only when a chunk ends there; with
``chunk_len`` a multiple of the checkpoint stride, every stride boundary is a chunk end. The end
of every prompt is always saved, so a multi-turn follow-up (previous prompt + reply + new
tokens) hits the whole previous prompt exactly.

A ``prefix`` state handed in (a prefix fetched from another instance) is used instead of the
local hit when it is longer, and stored in the cache for the next request — but only once the
engine has taken it: at the first chunk end, or when the prefill returns. An engine that refuses
it (the fake engines check every bit of a prefix against its tokens) raises before either, so a
bad fetched prefix fails its own request and never reaches the cache, where every later request
of that prefix would hit it. The engine copies a prefix into its own working state, so the
imported arrays are still whole when they are stored. The caller's ``on_chunk`` runs first at
each chunk end, then the cache copies the state to host memory: both only read the engine's
working buffer, which is donated to the next call right after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from prfaas_jax.engine.api import OnChunk, OnLayers, PrefillEngineLike, PrefillOutput
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.engine.sampling_params import GREEDY, SamplingParams
from prfaas_jax.errors import EngineError
from prfaas_jax.model.state import ModelState
from prfaas_jax.prefix_events import DISK, HOST

# Where a prefill's reused prefix came from, beside the cache's tiers (HOST, DISK).
NOT_REUSED = ""  # nothing: the whole prompt was computed
IMPORTED = "imported"  # a prefix state handed in (fetched from another instance)
REUSE_SOURCES = (NOT_REUSED, HOST, DISK, IMPORTED)


@dataclasses.dataclass
class ReuseStats:
    prompts: int = 0
    prompt_tokens: int = 0  # tokens of every prompt prefilled
    reused_tokens: int = 0  # of those, taken from a cached or imported prefix
    computed_tokens: int = 0  # of those, run through the model
    imported: int = 0  # prompts that reused a prefix fetched from another instance


class CachedPrefill:
    """Prefill through a ``PrefixCache`` (or, with ``cache=None``, plain prefill that still
    counts ``ReuseStats``, so a disabled cache is measured the same way)."""

    def __init__(self, cache: PrefixCache | None) -> None:
        self.cache = cache
        self.stats = ReuseStats()

    def cached_len(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` a prefill now would reuse (a read-only probe)."""
        return 0 if self.cache is None else self.cache.probe(tokens)

    def _start(
        self, ids: list[int], imported: ModelState | None, max_len: int | None
    ) -> tuple[ModelState | None, int, str]:
        """The state to continue from, its length, and where it came from (`REUSE_SOURCES`:
        IMPORTED when it is ``imported``)."""
        hit = None if self.cache is None else self.cache.match(ids)
        local_len = 0 if hit is None else hit.length
        if imported is not None:
            imported_len = int(np.asarray(imported.lengths)[0])
            if imported.batch_size != 1 or not 0 < imported_len < len(ids):
                raise EngineError(
                    f"an imported prefix must be one sequence shorter than the {len(ids)}-token "
                    f"prompt, got {imported.batch_size} × {imported_len} tokens"
                )
            if imported_len > local_len:
                return imported, imported_len, IMPORTED  # stored once the engine has taken it
        if hit is None:
            return None, 0, NOT_REUSED
        assert self.cache is not None
        # Built at the engine's fixed capacity when there is one: moving the host arrays to the
        # device compiles one small copy per shape, so per-hit-length shapes would recompile.
        capacity = hit.length if max_len is None else max_len
        return self.cache.build_state(hit, capacity), hit.length, hit.tier

    def prefill(
        self,
        engine: PrefillEngineLike,
        tokens: Sequence[int],
        *,
        prefix: ModelState | None = None,
        on_chunk: OnChunk | None = None,
        sampling: SamplingParams = GREEDY,
        max_len: int | None = None,
        on_layers: OnLayers | None = None,
        on_reuse: Callable[[str], None] | None = None,
    ) -> PrefillOutput:
        """``engine.prefill`` of ``tokens`` from the longest reusable prefix; the engine's result
        (its ``prefix_len`` is the reused length, ``num_tokens`` the computed ones).

        ``prefix`` is an imported state that should hold exactly ``tokens[:len]``; it goes into
        the cache only after the engine has taken it (module docstring). ``on_reuse`` is told,
        before the engine runs, where the reused prefix came from (`REUSE_SOURCES`).
        """
        ids = [int(t) for t in tokens]
        if not ids:
            raise EngineError("the prompt is empty")
        start, reused, source = self._start(ids, prefix, max_len)
        imported = source == IMPORTED
        if on_reuse is not None:
            on_reuse(source)
        cache = self.cache
        saves = set() if cache is None else set(cache.checkpoint_lengths(len(ids)))
        # The imported prefix, until the engine has taken it and it is in the cache.
        unstored = start if imported and cache is not None else None

        def store_import() -> None:
            nonlocal unstored
            if unstored is not None:
                assert cache is not None
                cache.insert(ids[:reused], unstored)
                unstored = None

        def chunk_done(state: ModelState, done: int) -> None:
            store_import()  # a chunk is done: the engine took the prefix
            if on_chunk is not None:
                on_chunk(state, done)
            if cache is not None and done in saves:
                cache.insert(ids[:done], state)

        wants_chunks = on_chunk is not None or cache is not None
        result = engine.prefill(
            ids[reused:],
            prefix=start,
            on_chunk=chunk_done if wants_chunks else None,
            sampling=sampling,
            max_len=max_len,
            on_layers=on_layers,
        )
        store_import()
        self._count(len(ids), reused, imported)
        return result

    def computed(self, tokens: Sequence[int], state: ModelState) -> None:
        """Count a prompt computed in full outside ``prefill`` (a row of a batched call, in one
        chunk) and keep the state at its end, as ``prefill``'s last chunk would."""
        ids = [int(t) for t in tokens]
        if self.cache is not None:
            self.cache.insert(ids, state)
        self._count(len(ids), 0, False)

    def _count(self, length: int, reused: int, imported: bool) -> None:
        stats = self.stats
        stats.prompts += 1
        stats.prompt_tokens += length
        stats.reused_tokens += reused
        stats.computed_tokens += length - reused
        stats.imported += imported
