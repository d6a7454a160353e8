"""Float64 NumPy oracles for the linear-attention ops, written apart from the package, plus the
realistic random inputs the op tests feed them and the error metric they use.

Plain loops over time, one explicit matrix per step, in the "transition matrix" form of each rule
(S_t = A_t S_{t-1} + B_t) rather than the package's predict-then-correct form, so a shared algebra
slip cannot hide. States are [B, HV, K, V]; o_t = S_t^T (scale q_t).
"""

import numpy as np


def _f64(*arrays):
    return [None if a is None else np.asarray(a, dtype=np.float64) for a in arrays]


def delta_rule_oracle(q, k, v, g, beta, *, scale=None, initial_state=None):
    """KDA when g is [B,T,HV,K]; GDN when g is [B,T,HV]. Returns (o [B,T,HV,V], S [B,HV,K,V])."""
    q, k, v, g, beta, S0 = _f64(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    scale = K**-0.5 if scale is None else scale
    S = np.zeros((B, HV, K, V)) if S0 is None else S0.copy()
    o = np.zeros((B, T, HV, V))
    eye = np.eye(K)
    for b in range(B):
        for hv in range(HV):
            h = hv // group
            for t in range(T):
                k_t = k[b, t, h]
                decay = np.exp(g[b, t, hv]) * np.ones(K)
                transition = (eye - beta[b, t, hv] * np.outer(k_t, k_t)) @ np.diag(decay)
                S[b, hv] = transition @ S[b, hv] + beta[b, t, hv] * np.outer(k_t, v[b, t, hv])
                o[b, t, hv] = S[b, hv].T @ (scale * q[b, t, h])
    return o, S


def lightning_oracle(q, k, v, decay, *, scale=None, initial_state=None, valid_len=None):
    """S_t = exp(decay_h) S_{t-1} + k_t v_t^T for t < valid_len[b]; padding leaves S alone."""
    q, k, v, decay, S0 = _f64(q, k, v, decay, initial_state)
    B, T, H, K = q.shape
    V = v.shape[3]
    scale = K**-0.5 if scale is None else scale
    lengths = [T] * B if valid_len is None else [int(n) for n in valid_len]
    S = np.zeros((B, H, K, V)) if S0 is None else S0.copy()
    o = np.zeros((B, T, H, V))
    for b in range(B):
        for h in range(H):
            for t in range(min(T, lengths[b])):
                S[b, h] = np.exp(decay[h]) * S[b, h] + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, h])
    return o, S


def rel_rms(actual, expected) -> float:
    """rms(actual - expected) / rms(expected), in float64 (fla's ``get_err_ratio``)."""
    actual, expected = _f64(actual, expected)
    return float(np.sqrt(np.mean((actual - expected) ** 2) / np.mean(expected**2)))


def _l2_normalised(x):
    # The delta rule is only contractive for ||k|| <= 1; the layers normalise q and k per head.
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def delta_rule_inputs(
    rng, *, length, per_channel, batch=1, heads=2, v_heads=4, extreme=False, value_dim=40
):
    """Float32 (q, k, v, g, beta) as the KDA/GDN layers produce them; K = 24, V = 40 unless
    ``value_dim`` says otherwise.

    ``extreme`` replaces a third of the gates with draws from uniform[-2000, 0], the range real
    checkpoints reach.
    """
    key_dim = 24
    q = _l2_normalised(rng.standard_normal((batch, length, heads, key_dim)))
    k = _l2_normalised(rng.standard_normal((batch, length, heads, key_dim)))
    v = rng.standard_normal((batch, length, v_heads, value_dim))
    g_shape = (batch, length, v_heads) + ((key_dim,) if per_channel else ())
    g = _log_sigmoid(rng.standard_normal(g_shape))
    if extreme:
        g = np.where(rng.random(g_shape) < 1 / 3, -2000.0 * rng.random(g_shape), g)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((batch, length, v_heads))))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


def lightning_inputs(rng, *, length, batch=1, heads=4, value_dim=40):
    """Float32 (q, k, v) with per-head L2-normalised q, k; K = 24, V = 40 unless ``value_dim``
    says otherwise."""
    q = _l2_normalised(rng.standard_normal((batch, length, heads, 24)))
    k = _l2_normalised(rng.standard_normal((batch, length, heads, 24)))
    v = rng.standard_normal((batch, length, heads, value_dim))
    return tuple(x.astype(np.float32) for x in (q, k, v))


def random_state(rng, batch, heads, key_dim=24, value_dim=40):
    return rng.standard_normal((batch, heads, key_dim, value_dim)).astype(np.float32)
