"""Chunked Gated DeltaNet: ``gdn_chunk``.

The WY / UT-transform chunking of KDA (see ``prfaas_jax.ops.kda.chunk``) with a per-head gate: g
gets a trailing axis of 1, which the shared code takes as "one decay for all key channels" and
turns into a single [C, C] decay matrix per head and chunk instead of per-channel ones.
"""

import jax

from prfaas_jax.ops.kda.chunk import delta_rule_chunked
from prfaas_jax.ops.kda.reference import check_gate_shapes


def gdn_chunk(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """GDN by chunks; same contract as ``gdn_reference``. ``chunk_size`` is static under jit."""
    check_gate_shapes(q, v, g, beta, per_channel=False)
    return delta_rule_chunked(
        q,
        k,
        v,
        g[..., None],
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )
