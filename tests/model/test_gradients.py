"""Gradients of the model against central finite differences, in float64.

The loss is a fixed random projection of prefill's logits, so every parameter and every layer's
output reaches it. ``jax.test_util.check_grads`` compares reverse-mode directional derivatives
with central differences along random directions over *all* parameters at once. Run under
``jax.enable_x64`` with params and state cast to float64: the ops compute in at least float32
(ops/precision.py), so float64 operands stay float64 and the check is not drowned in float32
rounding. Two-block cuts of the four toy presets cover every layer kind — KDA, GDN, Lightning,
MLA (NoPE and RoPE), GQA (partial RoPE, q/k norms, output gate), SWA with sinks — and both MLP
kinds (SwiGLU and MoE, in ``tiny``), with both kinds of ops training runs: the ``chunk`` ops
(70 tokens cross a 64-token chunk boundary, so the gradient flows through a carried chunk
state) and, for the linear layers, the ``reference`` token scans.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from prfaas_jax.config import MlpKind, load_model_config
from prfaas_jax.model import init_params, init_state, prefill

SEQ_LEN = 70


def _float64(tree):
    return jax.tree.map(
        lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


# Two blocks of each preset, one of each of its layer kinds.
CUTS = {"tiny": (0, 3), "tiny-gdn": (0, 3), "tiny-lightning": (0, 7), "tiny-swa": (0, 1)}


# Training runs the chunked ops on accelerators and the token scans on a CPU (train/loop.py):
# both are checked wherever they differ, in the linear layers.
CASES = [(name, "chunk") for name in CUTS] + [
    (name, "reference") for name in ("tiny", "tiny-gdn", "tiny-lightning")
]


@pytest.mark.slow
@pytest.mark.parametrize("name, impl", CASES)
def test_gradients_match_finite_differences(name, impl):
    full = load_model_config(name)
    keep = CUTS[name]
    cfg = dataclasses.replace(
        full,
        layers=tuple(full.layers[i] for i in keep),
        # SwiGLU then MoE in `tiny`; SwiGLU elsewhere (one MoE check is enough, and it is slow).
        mlps=(full.mlps[0], full.mlps[-1]) if name == "tiny" else (MlpKind.DENSE,) * 2,
        mlp_dim=full.mlp_dim or 64,
    )
    assert len(set(cfg.layers)) == 2
    with jax.enable_x64(True):
        params = _float64(init_params(jax.random.PRNGKey(0), cfg))
        state = _float64(init_state(cfg, 1, SEQ_LEN))
        tokens = jax.random.randint(jax.random.PRNGKey(1), (1, SEQ_LEN), 0, cfg.vocab_size)
        projection = jax.random.normal(jax.random.PRNGKey(2), (1, SEQ_LEN, cfg.vocab_size))
        projection = projection.astype(jnp.float64)

        @jax.jit
        def loss(p):
            logits, _ = prefill(p, cfg, tokens, state, impl=impl)
            assert logits.dtype == jnp.float64
            return jnp.sum(logits * projection) / SEQ_LEN

        assert np.isfinite(float(loss(params)))
        # A small step: the random direction spans every parameter (its norm is in the hundreds)
        # and MoE routing is only piecewise smooth. In float64 the difference rounds to ~1e-9.
        check_grads(loss, (params,), order=1, modes=("rev",), eps=1e-7, atol=1e-5, rtol=1e-5)
