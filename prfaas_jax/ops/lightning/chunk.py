"""Chunked Lightning attention (Lightning Attention-2 intra/inter blocks): ``lightning_chunk``.

Lightning is simple GLA with a scalar per-token log gate g_t = decay_h, and g_t = 0 on padding
(t >= valid_len[b], or past T), where k_t is zeroed too so padding neither decays nor updates S.
Per chunk, with G_i = sum_{s<=i} g_s:

    O = (exp(G) ⊙ Q) S + ((Q K^T) ⊙ M) V,    M[i, j] = exp(G_i - G_j) for j <= i, else 0
    S <- exp(G_last) S + (exp(G_last - G_j) k_j)^T V

Every exponent is a segment sum of g (<= 0), masked before ``exp``; the decay-matrix and chunk
layout helpers are the delta rule's too (``prfaas_jax.ops.recurrence``).
"""

import jax
import jax.numpy as jnp

from prfaas_jax.ops.lightning.reference import prepare_lightning
from prfaas_jax.ops.recurrence import (
    from_chunks,
    initial_state_or_zeros,
    log_decay_matrix,
    sum_after,
    to_chunks,
)

_HIGHEST = jax.lax.Precision.HIGHEST


def _chunk_step(S_BHKV, xs):
    q_BHCK, k_BHCK, v_BHCV, g_BHC1 = xs
    decay_BHCC = jnp.exp(log_decay_matrix(g_BHC1)[..., 0])
    A_BHCC = jnp.einsum("bhik,bhjk->bhij", q_BHCK, k_BHCK, precision=_HIGHEST) * decay_BHCC
    decay_in = jnp.exp(jnp.cumsum(g_BHC1, axis=-2))  # exp(G_i): decay from chunk start
    o_BHCV = jnp.einsum(
        "bhck,bhkv->bhcv", q_BHCK * decay_in, S_BHKV, precision=_HIGHEST
    ) + jnp.einsum("bhij,bhjv->bhiv", A_BHCC, v_BHCV, precision=_HIGHEST)
    k_out = k_BHCK * jnp.exp(sum_after(g_BHC1))  # exp(G_last - G_j)
    S_BHKV = jnp.exp(jnp.sum(g_BHC1, axis=-2))[..., None] * S_BHKV + jnp.einsum(
        "bhck,bhcv->bhkv", k_out, v_BHCV, precision=_HIGHEST
    )
    return S_BHKV, o_BHCV


def lightning_chunk(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    decay: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    valid_len: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """Lightning by chunks; same contract as ``lightning_reference``. ``chunk_size`` is static."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q_BTHK, k_BTHK, v_BTHV, decay_H, valid_BT = prepare_lightning(q, k, v, decay, scale, valid_len)
    B, T, H, K = q_BTHK.shape
    S0_BHKV = initial_state_or_zeros(initial_state, (B, H, K, v.shape[-1]), q_BTHK.dtype)
    # Padding gets g = 0 and k = 0: the state passes through it unchanged.
    g_BTH1 = jnp.where(valid_BT[:, :, None], decay_H, 0.0)[..., None]
    k_BTHK = jnp.where(valid_BT[:, :, None, None], k_BTHK, 0.0)
    xs = tuple(to_chunks(x, chunk_size) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH1))
    S_BHKV, o_NBHCV = jax.lax.scan(_chunk_step, S0_BHKV, xs)
    o_BTHV = from_chunks(o_NBHCV, T).astype(v.dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)
