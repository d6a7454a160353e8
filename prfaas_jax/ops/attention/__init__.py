"""Softmax attention: masked grouped-query attention over a positioned key buffer, and MLA decode
in the absorbed form over the latent cache."""

from prfaas_jax.ops.attention.gqa import attention
from prfaas_jax.ops.attention.mla import mla_decode_absorbed

__all__ = ["attention", "mla_decode_absorbed"]
