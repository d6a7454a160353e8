"""`BatchWarmup`: compiles a prefill worker's batched prefill calls on a thread of its own, after
the worker reports ready, and tells the prefill queue which batches it may run (`ready`).

Also exposes `warm_shapes`, the calls it compiles, in the order it compiles them.

A batched call compiles per shape — rows, block size, capacity (engine/batched_prefill.py) —
seconds to tens of seconds each, and a node meets more shapes the busier it is. Compiling them
all before the worker serves would hold its start for as long; compiling one when a batch first
needs it would hold that batch's requests. So the worker serves once its one-prompt calls are
compiled, this thread compiles the batched shapes behind it, and until every call of a batch is
compiled the prefill queue runs that batch's prompts one by one (serving/worker/prefill_queue.py):
one-prompt calls are compiled already, and each row of a batch is what its prompt gives alone.

`stop` ends the thread between two shapes (a compile under way finishes). The thread is not a
daemon: JAX may crash when a daemon thread still compiles while the interpreter exits, and the
interpreter waits for this one, at most one compile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prfaas_jax.engine.batched_prefill import call_rows, row_size
from prfaas_jax.serving.cluster_sections import EngineSection

if TYPE_CHECKING:
    from prfaas_jax.engine.prefill import PrefillEngine

log = logging.getLogger(__name__)

STOP_S = 30.0  # how long `stop` waits for a compile under way


def warm_shapes(engine: PrefillEngine, section: EngineSection) -> list[tuple[int, int, int]]:
    """Every ``(rows, block_len, capacity)`` the prefill queue's batched calls can have under
    ``[engine]`` ``section``: each block a one-chunk prompt takes as a batched row (its
    `row_size`, finer than its bucket), at one row (the rest of a batch that is not a power of
    two) and each power of two of rows that `prefill_batch_rows` and `prefill_batch_tokens`
    allow, at capacity `max_len`. Fewest rows first, then shortest blocks: the order a node
    meets them as its queue grows, and the cheapest compiles first."""
    longest = min(section.chunk_len, section.max_len - 1)
    bucket = engine.bucket
    sizes = {min(row_size(n, bucket(n)), section.chunk_len) for n in range(1, longest + 1)}
    shapes = []
    for size in sizes:
        rows = call_rows(
            size,
            max_prompts=section.prefill_batch_rows,
            max_batch_tokens=section.prefill_batch_tokens,
        )
        shapes += [(count, size, section.max_len) for count in (1, *rows)]
    return sorted(shapes)


class BatchWarmup:
    """Compiles `warm_shapes` on a thread (`start`); `ready` says whether a batch may run now."""

    def __init__(self, engine: PrefillEngine, section: EngineSection) -> None:
        self.engine, self.section = engine, section
        self.shapes = warm_shapes(engine, section)
        self._warm: frozenset[tuple[int, int, int]] = frozenset()  # replaced whole: read unlocked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batch-warmup")

    def start(self) -> None:
        self._thread.start()

    def ready(self, lengths: Sequence[int]) -> bool:
        """Whether every call of one `prefill_batch` of prompts of ``lengths`` is compiled."""
        shapes = self.engine.batch_shapes(
            lengths,
            max_len=self.section.max_len,
            max_batch_tokens=self.section.prefill_batch_tokens,
        )
        return shapes <= self._warm

    @property
    def warming(self) -> int:
        """Shapes still to compile while the thread runs (0 once it has ended, stopped or
        failed: nothing more will compile)."""
        return len(self.shapes) - len(self._warm) if self._thread.is_alive() else 0

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (every shape compiled, or stopped); True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = STOP_S) -> bool:
        """End the thread before its next shape, waiting at most ``timeout`` s for a compile
        under way; True if it ended."""
        self._stop.set()
        if not self._thread.is_alive():
            return True
        if self.wait(timeout):
            return True
        log.warning("batched prefill warm-up still compiling after %.0f s", timeout)
        return False

    def _run(self) -> None:
        start = time.perf_counter()
        for shape in self.shapes:
            if self._stop.is_set():
                done, total = len(self._warm), len(self.shapes)
                log.info("batched prefill warm-up stopped: %d of %d compiled", done, total)
                return
            try:
                self.engine.compile_batch(*shape)
            except Exception:  # its batches keep running one prompt per call
                log.exception("batched prefill warm-up failed at %s", shape)
                return
            self._warm = self._warm | {shape}
        log.info(
            "%d batched prefill calls compiled in %.1f s",
            len(self.shapes),
            time.perf_counter() - start,
        )
