"""Token-by-token Lightning attention in fp32: ``lightning_reference``.

Per head h, with a constant log decay ``decay_h <= 0`` and state S in K x V:

    S_t = exp(decay_h) S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t)

Positions t >= valid_len[b] are padding (a prefill padded to a length bucket): they neither decay
nor update the state, so the final state is exactly that of the unpadded row.
"""

import jax
import jax.numpy as jnp

from prfaas_jax.ops.precision import compute_dtype
from prfaas_jax.ops.recurrence import initial_state_or_zeros

_HIGHEST = jax.lax.Precision.HIGHEST


def prepare_lightning(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    decay: jax.Array,
    scale: float | None,
    valid_len: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Checks shapes; returns fp32 (scaled q, k, v, decay [H]) and the token mask [B, T]."""
    B, T, H, K = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or decay.shape != (H,):
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}, decay {decay.shape} mismatch")
    if scale is None:
        scale = K**-0.5
    valid_BT = jnp.ones((B, T), bool)
    if valid_len is not None:
        valid_BT = jnp.arange(T)[None, :] < jnp.asarray(valid_len).reshape(B, 1)
    # The state accumulates over T tokens: the recurrence runs in fp32 (or wider, ops/precision.py)
    # whatever the model dtype.
    f32 = compute_dtype(q, k, v)
    return q.astype(f32) * scale, k.astype(f32), v.astype(f32), decay.astype(f32), valid_BT


def lightning_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    decay: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    valid_len: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Lightning, token by token. q, k [B,T,H,K]; v [B,T,H,V]; decay [H]; valid_len [B] or None.

    Returns o [B,T,H,V] in v's dtype (unspecified but finite on padding) and the final state
    [B,H,K,V] fp32 (None unless ``output_final_state``).
    """
    q_BTHK, k_BTHK, v_BTHV, decay_H, valid_BT = prepare_lightning(q, k, v, decay, scale, valid_len)
    B, _, H, K = q_BTHK.shape
    S0_BHKV = initial_state_or_zeros(initial_state, (B, H, K, v.shape[-1]), q_BTHK.dtype)
    lam_H11 = jnp.exp(decay_H)[:, None, None]

    def step(S_BHKV, xs):
        q_BHK, k_BHK, v_BHV, valid_B = xs
        S_next = lam_H11 * S_BHKV + k_BHK[..., None] * v_BHV[..., None, :]
        S_BHKV = jnp.where(valid_B[:, None, None, None], S_next, S_BHKV)
        return S_BHKV, jnp.einsum("bhk,bhkv->bhv", q_BHK, S_BHKV, precision=_HIGHEST)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q_BTHK, k_BTHK, v_BTHV, valid_BT))
    S_BHKV, o_TBHV = jax.lax.scan(step, S0_BHKV, xs)
    o_BTHV = jnp.moveaxis(o_TBHV, 0, 1).astype(v.dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)
