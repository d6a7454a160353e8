"""``narrow_weights(params, dtype)``: ``Params`` with every projection matrix cast to a narrower
dtype (bfloat16), for a decode engine that streams half the bytes per step; ``NARROWED`` names
them.

Only the matrices the model multiplies through ``ops/weight_dot.weight_dot`` are narrowed: the
mixers' and MLPs' projections, the experts and a separate LM head. Everything read another way
keeps its width — the embedding table (rows gathered; a tied head stays wide with it), MLA's
``kv_b`` (split per head and absorbed in fp32), the short convolution, the MoE router (its logits
decide near-ties in fp32), norms, biases and gates' decay rates — and so does the state: the
activations, recurrences and logits still compute in the model's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from prfaas_jax.model.hybrid import Params

NARROWED = frozenset(
    {
        # mixers
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",
        "gate_proj",
        "f_proj",
        "g_proj",
        "f_a",
        "f_b",
        "g_a",
        "g_b",
        "a_proj",
        "b_proj",
        "z_proj",
        "q_a",
        "q_b",
        "kv_a",
        # MLPs
        "gate",
        "up",
        "down",
        "experts_gate",
        "experts_up",
        "experts_down",
        "shared_gate",
        # the separate LM head
        "lm_head",
    }
)


def narrow_weights(params: Params, dtype: jnp.dtype | str) -> Params:
    """``params`` with the ``NARROWED`` matrices cast to ``dtype`` (a copy; others shared)."""
    dtype = jnp.dtype(dtype)

    def cast(path, leaf: jax.Array) -> jax.Array:
        name = getattr(path[-1], "key", None)
        if name in NARROWED and jnp.dtype(leaf.dtype).itemsize > dtype.itemsize:
            return leaf.astype(dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(cast, params)
