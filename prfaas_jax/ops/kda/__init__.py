"""Kimi Delta Attention: delta rule with a per-channel log decay (reference and chunked)."""

from prfaas_jax.ops.kda.chunk import kda_chunk
from prfaas_jax.ops.kda.reference import kda_reference

__all__ = ["kda_chunk", "kda_reference"]
