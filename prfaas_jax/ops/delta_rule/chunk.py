"""Chunked gated delta rule (WY / UT transform): ``delta_rule_chunk``, ``kda_chunk``, ``gdn_chunk``.

Within a chunk of C tokens starting from state S, with G_i = sum_{s<=i} g_s (chunk-local) and
D(i, j) = exp(G_i - G_j) per key channel (i >= j), the delta rule unrolls to

    L[i, j] = beta_i sum_d k_i[d] k_j[d] D(i, j)[d]   (j < i, else 0)
    A[i, j] = sum_d q_i[d] k_j[d] D(i, j)[d]          (j <= i, else 0)
    W = (I + L)^-1 Diag(beta) (exp(G) ⊙ K),   U = (I + L)^-1 Diag(beta) V
    V' = U - W S,   O = (exp(G) ⊙ Q) S + A V'
    S <- Diag(exp(G_last)) S + (exp(G_last - G_j) ⊙ k_j)^T V'

and a ``lax.scan`` carries S from chunk to chunk. Real gates reach -2000 per step, so every
exponent is a sum of g over exactly the segment it spans (<= 0, masked to -inf before ``exp``
where it is undefined; ``prfaas_jax.ops.recurrence``): never ``exp(-G_j)``, and never a difference
of two large prefix sums, whose fp32 rounding would be amplified by ``exp``. Gates with a last
axis of 1 (GDN) take a cheap [C, C] path; per-channel gates (KDA) factor pairs in earlier
sub-chunks through the sub-chunk start.
"""

import functools
import math

import jax
import jax.numpy as jnp

from prfaas_jax.ops.delta_rule.reference import check_shapes, gate_form, prepare_qkv
from prfaas_jax.ops.recurrence import (
    from_chunks,
    initial_state_or_zeros,
    log_decay_matrix,
    sum_after,
    to_chunks,
)

_HIGHEST = jax.lax.Precision.HIGHEST
# Per-channel decays are materialised only inside sub-chunks (C * 8 * K per chunk, not C * C * K);
# 8 measured fastest on CPU among 8, 16 and 32.
_SUB_CHUNK = 8


def gated_scores(
    a_XBHCK: jax.Array, b_BHCK: jax.Array, g_BHCD: jax.Array, sub_size: int
) -> jax.Array:
    """A[x, i, j] = sum_d a_x,i[d] b_j[d] exp(sum_{j<s<=i} g_s[d]) for j <= i, zero above."""
    X, B, H, C, K = a_XBHCK.shape
    if g_BHCD.shape[-1] == 1:  # one decay per head: a [C, C] matrix suffices
        decay_BHCC = jnp.exp(log_decay_matrix(g_BHCD)[..., 0])
        return jnp.einsum("xbhik,bhjk->xbhij", a_XBHCK, b_BHCK, precision=_HIGHEST) * decay_BHCC
    n, c = C // sub_size, sub_size
    a_blk = a_XBHCK.reshape(X, B, H, n, c, K)
    g_blk = g_BHCD.reshape(B, H, n, c, K)
    decay_BHncck = jnp.exp(log_decay_matrix(g_blk))
    diag = jnp.einsum(
        "xbhnik,bhnjk,bhnijk->xbhnij",
        a_blk,
        b_BHCK.reshape(B, H, n, c, K),
        decay_BHncck,
        precision=_HIGHEST,
    )
    if n == 1:
        return diag.reshape(X, B, H, C, C)
    # j before i's sub-chunk m: exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), r the position just
    # before sub-chunk m, so both factors are segment sums <= 0.
    a_hat = a_blk * jnp.exp(jnp.cumsum(g_blk, axis=-2))
    before_nC = jnp.arange(C)[None, :] < (jnp.arange(n) * c)[:, None]
    g_before = jnp.where(before_nC[:, :, None], g_BHCD[:, :, None], 0.0)
    b_hat = jnp.where(before_nC[:, :, None], b_BHCK[:, :, None] * jnp.exp(sum_after(g_before)), 0.0)
    off = jnp.einsum("xbhnik,bhnjk->xbhnij", a_hat, b_hat, precision=_HIGHEST)
    diag_blocks = jnp.einsum("xbhnij,nm->xbhnimj", diag, jnp.eye(n), precision=_HIGHEST)
    return (off.reshape(diag_blocks.shape) + diag_blocks).reshape(X, B, H, C, C)


def unit_lower_inverse(L_XCC: jax.Array) -> jax.Array:
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by blocked inversion: each pass
    joins two inverted diagonal blocks into one of twice the size,

        [[A, 0], [M, D]]^-1 = [[A^-1, 0], [-D^-1 M A^-1, D^-1]],

    from the 1 x 1 blocks (all ones) up. Matrix products only: XLA:CPU's triangular solve is
    10-70x slower at these sizes, forward and backward. C is padded to a power of two with
    identity rows, which leaves the leading C x C block of the inverse unchanged."""
    C = L_XCC.shape[-1]
    size = 1 << (C - 1).bit_length()
    pad = [(0, 0)] * (L_XCC.ndim - 2) + [(0, size - C)] * 2
    L_XSS = jnp.pad(L_XCC, pad)
    batch = L_XSS.shape[:-2]
    inv_XNbb = jnp.ones((*batch, size, 1, 1), L_XCC.dtype)  # inverses of the 1 x 1 blocks
    b = 1
    while b < size:
        n = size // (2 * b)
        pairs = inv_XNbb.reshape(*batch, n, 2, b, b)
        A_inv, D_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        # M: the lower-left b x b block of each 2b x 2b diagonal block of L.
        blocks = L_XSS.reshape(*batch, n, 2 * b, n, 2 * b)
        M = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)[..., b:, :b]
        lower = -jnp.einsum("...ij,...jk,...kl->...il", D_inv, M, A_inv, precision=_HIGHEST)
        top = jnp.concatenate([A_inv, jnp.zeros_like(A_inv)], axis=-1)
        inv_XNbb = jnp.concatenate([top, jnp.concatenate([lower, D_inv], axis=-1)], axis=-2)
        b *= 2
    return inv_XNbb[..., 0, :C, :C]


def _chunk_step(S_BHKV, xs, *, sub_size: int):
    q_BHCK, k_BHCK, v_BHCV, g_BHCD, beta_BHC1 = xs
    C, K = k_BHCK.shape[-2:]
    A_qk, A_kk = gated_scores(jnp.stack([q_BHCK, k_BHCK]), k_BHCK, g_BHCD, sub_size)
    strict_CC = jnp.arange(C)[:, None] > jnp.arange(C)[None, :]
    L_BHCC = jnp.where(strict_CC, A_kk, 0.0) * beta_BHC1
    decay_in = jnp.exp(jnp.cumsum(g_BHCD, axis=-2))  # exp(G_i): decay from chunk start
    rhs = beta_BHC1 * jnp.concatenate([k_BHCK * decay_in, v_BHCV], axis=-1)
    wu = jnp.einsum("bhij,bhjd->bhid", unit_lower_inverse(L_BHCC), rhs, precision=_HIGHEST)
    w_BHCK, u_BHCV = wu[..., :K], wu[..., K:]
    v_new = u_BHCV - jnp.einsum("bhck,bhkv->bhcv", w_BHCK, S_BHKV, precision=_HIGHEST)
    o_BHCV = jnp.einsum(
        "bhck,bhkv->bhcv", q_BHCK * decay_in, S_BHKV, precision=_HIGHEST
    ) + jnp.einsum("bhij,bhjv->bhiv", A_qk, v_new, precision=_HIGHEST)
    k_out = k_BHCK * jnp.exp(sum_after(g_BHCD))  # exp(G_last - G_j)
    S_BHKV = jnp.exp(jnp.sum(g_BHCD, axis=-2))[..., None] * S_BHKV + jnp.einsum(
        "bhck,bhcv->bhkv", k_out, v_new, precision=_HIGHEST
    )
    return S_BHKV, o_BHCV


def delta_rule_chunk(
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
    """Gated delta rule over chunks; same contract as ``delta_rule_reference``. ``chunk_size``
    (any positive C) is static under jit. A sequence shorter than C is one chunk of its own
    length rounded up to the sub-chunk: padding it to C would only add work."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    check_shapes(q, k, v, g, beta)
    q_BTHK, k_BTHK, v_BTHV = prepare_qkv(q, k, v, scale)
    B, T, HV, K = q_BTHK.shape
    chunk_size = min(chunk_size, -(-T // _SUB_CHUNK) * _SUB_CHUNK)
    S0_BHKV = initial_state_or_zeros(initial_state, (B, HV, K, v.shape[-1]), q_BTHK.dtype)
    # Zero padding is neutral: g = 0 keeps the state, beta = 0 and k = 0 add nothing to it.
    gates = (g.astype(q_BTHK.dtype), beta.astype(q_BTHK.dtype)[..., None])
    xs = tuple(to_chunks(x, chunk_size) for x in (q_BTHK, k_BTHK, v_BTHV, *gates))
    step = functools.partial(_chunk_step, sub_size=math.gcd(chunk_size, _SUB_CHUNK))
    S_BHKV, o_NBHCV = jax.lax.scan(step, S0_BHKV, xs)
    o_BTHV = from_chunks(o_NBHCV, T).astype(v.dtype)
    return o_BTHV, (S_BHKV if output_final_state else None)


kda_chunk = gate_form(delta_rule_chunk, per_channel=True)
gdn_chunk = gate_form(delta_rule_chunk, per_channel=False)
