"""``decode_weights(cfg, params)``: ``Params`` as a decode engine holds them — each MLA layer's
``kv_b`` split once into its absorbing halves, laid out head-major (`AbsorbedKvB`).

The absorbed decode multiplies the queries by ``W_UK[h]`` and the attended latents by
``W_UV[h]``; sliced and regrouped per head out of ``kv_b`` inside the step, those are copies
XLA:CPU makes on every call (they cost the MLA mixer about as much as its attention at one row:
docs/performance.md). Done once here, the step reads them in place. Every other leaf is the
caller's own array; prefill on these weights (e.g. a mixed step's block) regroups them back.
"""

from __future__ import annotations

import jax

from prfaas_jax.config import ModelConfig
from prfaas_jax.model.hybrid import Params
from prfaas_jax.model.mixers.mla import AbsorbedKvB


def decode_weights(cfg: ModelConfig, params: Params) -> Params:
    """``params`` with every MLA ``kv_b`` as an `AbsorbedKvB` (a copy of the tree; its other
    leaves shared). A model without MLA comes back as it went in."""
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
