"""Gated DeltaNet through the delta-rule Pallas kernel: ``gdn_pallas``.

GDN is KDA with one log decay per value head (see ``prfaas_jax.ops.kda.pallas``): the gate enters
the kernel as a tile of width 1, so each row's decay factor exp(g_t) broadcasts over the key
channels and P_i shrinks to a [C, 1] column.
"""

from __future__ import annotations

import functools

import jax

from prfaas_jax.ops.kda.pallas import delta_rule_pallas
from prfaas_jax.ops.kda.reference import check_gate_shapes
from prfaas_jax.ops.pallas_launch import STATE_KERNEL_STATICS


@functools.partial(jax.jit, static_argnames=STATE_KERNEL_STATICS)
def gdn_pallas(
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
    block_v: int = 64,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """GDN through the Pallas kernel; same contract as ``gdn_reference``."""
    check_gate_shapes(q, v, g, beta, per_channel=False)
    return delta_rule_pallas(
        q,
        k,
        v,
        g[..., None],
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        block_v=block_v,
        interpret=interpret,
    )
