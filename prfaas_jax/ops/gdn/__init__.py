"""Gated DeltaNet: delta rule with a per-head log decay (reference and chunked)."""

from prfaas_jax.ops.gdn.chunk import gdn_chunk
from prfaas_jax.ops.gdn.reference import gdn_reference

__all__ = ["gdn_chunk", "gdn_reference"]
