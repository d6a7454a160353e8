"""Token-by-token Gated DeltaNet in fp32: ``gdn_reference``.

GDN is the KDA delta rule with one log decay per value head instead of one per key channel:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

so it runs KDA's scan with g broadcast over the key channels (a trailing axis of 1).
"""

import jax

from prfaas_jax.ops.kda.reference import check_gate_shapes, delta_rule_reference


def gdn_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """GDN, token by token. q, k [B,T,H,K]; v [B,T,HV,V]; g, beta [B,T,HV] (g log, <= 0).

    Returns o [B,T,HV,V] in v's dtype and the final state [B,HV,K,V] fp32 (None unless
    ``output_final_state``).
    """
    check_gate_shapes(q, v, g, beta, per_channel=False)
    return delta_rule_reference(
        q,
        k,
        v,
        g[..., None],
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
