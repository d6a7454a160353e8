"""Every Pallas kernel lowers to Triton for CUDA on a machine without a GPU.

Cross-lowering runs every Pallas->Triton rule on CPU-only machines, so a primitive Triton cannot
take fails here, in CI, and not first on a GPU (Triton's own compile to PTX still needs one).
Shapes are model-sized: K = V = 128, T = 200, MLA's 192 / 128 and 512 / 64 dims.
"""

import jax
import jax.numpy as jnp
import pytest

from prfaas_jax.ops.attention import MlaDecodeBlockSizes, flash_attention, mla_decode_pallas
from prfaas_jax.ops.delta_rule import gdn_pallas, kda_pallas
from prfaas_jax.ops.lightning import lightning_pallas


def _cuda_lowerings():
    f32, i32 = jnp.float32, jnp.int32

    def spec(*shape, dtype=f32):
        return jax.ShapeDtypeStruct(shape, dtype)

    B, T, H, K = 1, 200, 2, 128
    linear = (spec(B, T, H, K),) * 3
    state = {"output_final_state": True, "interpret": False}
    return {
        "kda": (
            lambda q, k, v, g, b, s: kda_pallas(q, k, v, g, b, initial_state=s, **state),
            (*linear, spec(B, T, H, K), spec(B, T, H), spec(B, H, K, K)),
        ),
        "gdn": (
            lambda q, k, v, g, b, s: gdn_pallas(q, k, v, g, b, initial_state=s, **state),
            (*linear, spec(B, T, H), spec(B, T, H), spec(B, H, K, K)),
        ),
        "lightning": (
            lambda q, k, v, s, n: lightning_pallas(
                q, k, v, decay=-jnp.ones(H), initial_state=s, valid_len=n, **state
            ),
            (*linear, spec(B, H, K, K), spec(B, dtype=i32)),
        ),
        "flash": (
            lambda q, k, v, qp, kp, sinks: flash_attention(
                q, k, v, q_pos=qp, kv_pos=kp, scale=0.1, window=64, sinks=sinks, interpret=False
            ),
            (
                spec(B, T, 4, 192),
                spec(B, T, 2, 192),
                spec(B, T, 2, 128),
                spec(B, T, dtype=i32),
                spec(B, T, dtype=i32),
                spec(4),
            ),
        ),
        "mla-decode": (
            lambda qn, qr, c, kr, wk, wv, qp, kp: mla_decode_pallas(
                qn,
                qr,
                c,
                kr,
                wk,
                wv,
                q_pos=qp,
                kv_pos=kp,
                scale=0.1,
                block_sizes=MlaDecodeBlockSizes(block_k=32, num_splits=2),
                interpret=False,
            ),
            (
                spec(4, 1, 8, 128),
                spec(4, 1, 8, 64),
                spec(4, 300, 512),
                spec(4, 300, 64),
                spec(512, 8, 128),
                spec(512, 8, 128),
                spec(4, 1, dtype=i32),
                spec(4, 300, dtype=i32),
            ),
        ),
    }


@pytest.mark.parametrize("name", ["kda", "gdn", "lightning", "flash", "mla-decode"])
def test_kernels_lower_to_triton_without_a_gpu(name):
    fn, args = _cuda_lowerings()[name]
    # Triton, as on GPUs where the kernels pass Triton's parameters (JAX defaults to Mosaic GPU).
    previous = jax.config.jax_pallas_use_mosaic_gpu
    jax.config.update("jax_pallas_use_mosaic_gpu", False)
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        jax.config.update("jax_pallas_use_mosaic_gpu", previous)
    assert "triton" in lowered.as_text()
