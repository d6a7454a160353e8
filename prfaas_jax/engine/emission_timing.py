"""When a layer-wise prefill's states become final: `layer_seconds(cfg, params, length)`.

The prefill engine runs the prompt as one call in ``cfg.num_layers`` segments, one per layer
(``layer_groups``, engine/prefill.py), the way a prefill worker streams a state layer by layer;
the ``on_layers`` callback waits for each layer's states and stamps the time. A layer's seconds
are the time from the previous stamp (the first: from the start of the call) to its own — its
compute as the worker sees it, dispatch included; the LM head runs in the last segment. The
first prefill compiles the segments and is not timed; of ``repeats`` timed runs the fastest is
kept (the least disturbed on a shared machine).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.hybrid import Params
from prfaas_jax.ops.dispatch import Impl


def layer_seconds(
    cfg: ModelConfig, params: Params, length: int, *, impl: Impl = Impl.CHUNK, repeats: int = 3
) -> list[float]:
    """Seconds each layer of a ``length``-token layer-wise prefill took, in order."""
    engine = PrefillEngine(
        cfg, params, impl=impl, buckets=(length,), chunk_len=length, layer_groups=cfg.num_layers
    )
    tokens = np.arange(length) % cfg.vocab_size
    best: list[float] | None = None
    for run in range(repeats + 1):
        stamps: list[float] = []

        def on_layers(state, tokens_done, layers, stamps=stamps) -> None:
            jax.block_until_ready([state.layers[i] for i in layers])
            stamps.append(time.perf_counter())

        start = time.perf_counter()
        engine.prefill(tokens, on_layers=on_layers)
        seconds = list(np.diff([start, *stamps]))
        if len(seconds) != cfg.num_layers:
            raise RuntimeError(f"{len(seconds)} layer stamps for {cfg.num_layers} layers")
        if run and (best is None or sum(seconds) < sum(best)):
            best = seconds
    assert best is not None
    return [float(s) for s in best]
