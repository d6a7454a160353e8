"""Token-by-token gated delta rule in fp32: ``delta_rule_reference``, ``kda_reference`` and
``gdn_reference``; and what every form of the rule shares: ``check_shapes``, ``prepare_qkv`` and
``gate_form``, which makes the KDA and GDN ops out of a delta-rule implementation.

Per value head, with state S in K x V, log decay g_t <= 0 and beta_t in (0, 1):

    S' = Diag(exp(g_t)) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T (scale q_t)

KDA (Kimi Delta Attention) has one log decay per key channel, g [B,T,HV,K]. GDN (Gated DeltaNet)
has one per value head, g [B,T,HV]: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t
v_t^T, which is the same rule with g[..., None] broadcast over the key channels. So every
implementation is written once, as ``delta_rule_*`` taking g with a last axis of K or 1, and
``gate_form`` makes ``kda_*`` and ``gdn_*`` of it.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from prfaas_jax.ops.precision import compute_dtype
from prfaas_jax.ops.recurrence import initial_state_or_zeros

_HIGHEST = jax.lax.Precision.HIGHEST
DeltaRuleOp = Callable[..., tuple[jax.Array, jax.Array | None]]


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array) -> None:
    """q, k [B,T,H,K]; v [B,T,HV,V] with HV a multiple of H (GVA); g [B,T,HV,K] or [B,T,HV,1];
    beta [B,T,HV]. Anything else is a ``ValueError``."""
    if k.shape != q.shape or v.shape[2] % q.shape[2]:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape} do not fit GVA")
    B, T, HV = v.shape[:3]
    if g.shape not in ((B, T, HV, q.shape[-1]), (B, T, HV, 1)) or beta.shape != (B, T, HV):
        raise ValueError(f"g {g.shape} / beta {beta.shape} do not match v {v.shape}, q {q.shape}")


def gate_form(core: DeltaRuleOp, *, per_channel: bool) -> DeltaRuleOp:
    """``core`` (a ``delta_rule_*`` implementation) as KDA or GDN, with ``core``'s keywords.

    ``per_channel``: KDA, g [B,T,HV,K], passed on as is. Otherwise GDN, g [B,T,HV], passed on
    as g[..., None]. The other op's gate is a ``ValueError``; ``core`` checks the rest. The
    result is named after ``core`` with ``kda`` / ``gdn`` for ``delta_rule``.
    """
    name = "kda" if per_channel else "gdn"
    gate = "[B,T,HV,K], one per key channel" if per_channel else "[B,T,HV], one per value head"

    @functools.wraps(core)
    def op(
        q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, **options
    ) -> tuple[jax.Array, jax.Array | None]:
        g_shape = (*v.shape[:3], q.shape[-1]) if per_channel else v.shape[:3]
        if g.shape != g_shape:
            raise ValueError(f"{name}: g {g.shape} does not match v {v.shape}, q {q.shape}")
        return core(q, k, v, g if per_channel else g[..., None], beta, **options)

    op.__name__ = op.__qualname__ = core.__name__.replace("delta_rule", name)
    op.__doc__ = f"{name.upper()}: ``{core.__name__}`` with log decays g {gate}."
    return op


def prepare_qkv(
    q_BTHK: jax.Array, k_BTHK: jax.Array, v_BTHV: jax.Array, scale: float | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Upcasts to fp32 (or wider: ops/precision.py), scales q and repeats q/k heads onto the value
    heads (GVA).

    Value head j reads q/k head j // (HV // H), torch ``repeat_interleave`` semantics.
    """
    if scale is None:
        scale = q_BTHK.shape[-1] ** -0.5
    group = v_BTHV.shape[2] // q_BTHK.shape[2]
    # All recurrence math runs in fp32 whatever the model dtype: the state accumulates over T.
    f32 = compute_dtype(q_BTHK, k_BTHK, v_BTHV)
    q = jnp.repeat(q_BTHK.astype(f32) * scale, group, axis=2)
    k = jnp.repeat(k_BTHK.astype(f32), group, axis=2)
    return q, k, v_BTHV.astype(f32)


def delta_rule_reference(
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
    """Gated delta rule, one token per scan step (shapes: ``check_shapes``).

    Returns o [B,T,HV,V] in v's dtype and the final state [B,HV,K,V] fp32 (None unless
    ``output_final_state``); ``initial_state`` None means a zero state.
    """
    check_shapes(q, k, v, g, beta)
    q_BTHK, k_BTHK, v_BTHV = prepare_qkv(q, k, v, scale)
    B, _, HV, K = q_BTHK.shape
    S0_BHKV = initial_state_or_zeros(initial_state, (B, HV, K, v.shape[-1]), q_BTHK.dtype)

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

    xs = (q_BTHK, k_BTHK, v_BTHV, g.astype(q_BTHK.dtype), beta.astype(q_BTHK.dtype))
    S_BHKV, o_TBHV = jax.lax.scan(step, S0_BHKV, tuple(jnp.moveaxis(x, 1, 0) for x in xs))
    o_BTHV = jnp.moveaxis(o_TBHV, 0, 1).astype(v.dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)


kda_reference = gate_form(delta_rule_reference, per_channel=True)
gdn_reference = gate_form(delta_rule_reference, per_channel=False)
