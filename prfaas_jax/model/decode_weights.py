"""``decode_weights(cfg, params)``: ``Params`` as a decode engine holds them — each MLA layer's
``kv_b`` split once into its absorbing halves, laid out head-major (`AbsorbedKvB`), and a
separate full-width LM head held in both layouts, ``[D, V]`` and ``[V, D]`` (`HeadLayouts`).

The absorbed decode multiplies the queries by ``W_UK[h]`` and the attended latents by
``W_UV[h]``; sliced and regrouped per head out of ``kv_b`` inside the step, those are copies
XLA:CPU makes on every call (they cost the MLA mixer about as much as its attention at one row:
docs/performance.md). Done once here, the step reads them in place. Every other leaf is the
caller's own array; prefill on these weights (e.g. a mixed step's block) regroups them back.

The LM head is a decode step's largest matrix (65 of its 108 MB in bench/engine.py's model).
Multiplied as ``x [M, D] @ W [D, V]`` from 2 rows up, XLA:CPU repacks it on every call; stored
``[V, D]`` and contracted on ``D`` it streams it (0.71× the time at 8 and 32 rows read from DRAM,
``python bench/weight_dots.py --cold``), while at one row the ``[D, V]`` product is the faster. The
engine keeps the head as loaded beside its transpose (the one extra copy) and each compiled
step reads the one for its row count; the logits differ by rounding (~1e-6 of the largest). A
head narrowed for decode (model/narrow_weights.py) stays ``[D, V]`` alone: a narrower dot has no
repacking to avoid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.config import ModelConfig
from prfaas_jax.model.hybrid import HeadLayouts, Params
from prfaas_jax.model.mixers.mla import AbsorbedKvB


def decode_weights(cfg: ModelConfig, params: Params) -> Params:
    """``params`` with every MLA ``kv_b`` as an `AbsorbedKvB` and a full-width separate LM head
    in both layouts, `HeadLayouts` (a copy of the tree; its other leaves shared)."""
    head = params.get("lm_head")
    if isinstance(head, jax.Array) and head.dtype == jnp.dtype(cfg.dtype):
        params = {**params, "lm_head": HeadLayouts(head, jax.jit(jnp.transpose)(head))}
    if cfg.mla is None:
        return params
    split = jax.jit(AbsorbedKvB.of, static_argnums=(1, 2))
    heads, nope = cfg.mla.num_heads, cfg.mla.qk_nope_head_dim

    def layer(block: dict) -> dict:
        mixer = block["mixer"]
        if "kv_b" not in mixer or isinstance(mixer["kv_b"], AbsorbedKvB):
            return block
        return {**block, "mixer": {**mixer, "kv_b": split(mixer["kv_b"], heads, nope)}}

    return {**params, "layers": tuple(layer(block) for block in params["layers"])}
