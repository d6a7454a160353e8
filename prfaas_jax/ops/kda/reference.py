"""Token-by-token KDA in fp32: ``kda_reference`` and the gated delta rule it is built on.

Per value head, with state S in K x V, log decay g_t <= 0 (per key channel) and beta_t in (0, 1):

    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale q_t)

``delta_rule_reference`` accepts g with a last axis of K (KDA) or 1 (GDN: one decay per head,
broadcast over the key channels), so GDN's reference is the same scan.
"""

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def prepare_qkv(
    q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHV: jax.Array, scale: float | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Upcasts to fp32, scales q and repeats q/k heads onto the value heads (GVA).

    Value head j reads q/k head j // (HV // H), torch ``repeat_interleave`` semantics.
    """
    num_heads, num_v_heads = q_BTHK.shape[2], v_BTHV.shape[2]
    if k_BTHK.shape != q_BTHK.shape or num_v_heads % num_heads:
        raise ValueError(f"q {q_BTHK.shape}, k {k_BTHK.shape}, v {v_BTHV.shape} do not fit GVA")
    if scale is None:
        scale = q_BTHK.shape[-1] ** -0.5
    group = num_v_heads // num_heads
    # All recurrence math runs in fp32 whatever the model dtype: the state accumulates over T.
    q = jnp.repeat(q_BTHK.astype(jnp.float32) * scale, group, axis=2)
    k = jnp.repeat(k_BTHK.astype(jnp.float32), group, axis=2)
    return q, k, v_BTHV.astype(jnp.float32)


def initial_state_or_zeros(
    initial_state: jax.Array | None, shape: tuple[int, int, int, int]
) -> jax.Array:
    """The carried state as fp32 [B, HV, K, V]; ``None`` means a fresh (zero) state."""
    if initial_state is None:
        return jnp.zeros(shape, jnp.float32)
    if initial_state.shape != shape:
        raise ValueError(f"initial_state has shape {initial_state.shape}, expected {shape}")
    return initial_state.astype(jnp.float32)


def check_gate_shapes(
    q: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, per_channel: bool
) -> None:
    """g is [B,T,HV,K] (per channel) or [B,T,HV] (per head); beta is [B,T,HV]."""
    g_shape = v.shape[:3] + q.shape[-1:] if per_channel else v.shape[:3]
    if g.shape != g_shape or beta.shape != v.shape[:3]:
        raise ValueError(f"g {g.shape} / beta {beta.shape} do not match v {v.shape}, q {q.shape}")


def delta_rule_reference(
    q_BTHK: jax.Array,
    k_BTHK: jax.Array,
    v_BTHV: jax.Array,
    g_BTHD: jax.Array,
    beta_BTH: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Gated delta rule, one token per scan step; g's last axis is K or 1."""
    q, k, v = prepare_qkv(q_BTHK, k_BTHK, v_BTHV, scale)
    B, _, HV, K = q.shape
    S0_BHKV = initial_state_or_zeros(initial_state, (B, HV, K, v.shape[-1]))

    def step(S_BHKV, xs):
        q_BHK, k_BHK, v_BHV, g_BHD, beta_BH = xs
        # S' is never materialised: S'ᵀk = Sᵀ(exp(g) ⊙ k) and S_tᵀq = Sᵀ(exp(g) ⊙ q) + err (k·q),
        # so one read of S serves both products and S_t is one fused pass (2x faster on CPU).
        decay_BHD = jnp.exp(g_BHD)
        kq_BH2K = jnp.stack([decay_BHD * k_BHK, decay_BHD * q_BHK], axis=2)
        kq_BH2V = jnp.einsum("bhik,bhkv->bhiv", kq_BH2K, S_BHKV, precision=_HIGHEST)
        err_BHV = beta_BH[..., None] * (v_BHV - kq_BH2V[:, :, 0])
        o_BHV = kq_BH2V[:, :, 1] + jnp.sum(k_BHK * q_BHK, axis=-1)[..., None] * err_BHV
        S_BHKV = decay_BHD[..., None] * S_BHKV + k_BHK[..., None] * err_BHV[..., None, :]
        return S_BHKV, o_BHV

    xs = (q, k, v, g_BTHD.astype(jnp.float32), beta_BTH.astype(jnp.float32))
    S_BHKV, o_TBHV = jax.lax.scan(step, S0_BHKV, tuple(jnp.moveaxis(x, 1, 0) for x in xs))
    o_BTHV = jnp.moveaxis(o_TBHV, 0, 1).astype(v_BTHV.dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)


def kda_reference(
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
    """KDA, token by token. q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] (log, <= 0); beta [B,T,HV].

    Returns o [B,T,HV,V] in v's dtype and the final state [B,HV,K,V] fp32 (None unless
    ``output_final_state``).
    """
    check_gate_shapes(q, v, g, beta, per_channel=True)
    return delta_rule_reference(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
