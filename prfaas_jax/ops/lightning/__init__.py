"""Lightning attention: constant per-head decay, no delta rule (reference and chunked)."""

from prfaas_jax.ops.lightning.chunk import lightning_chunk
from prfaas_jax.ops.lightning.reference import lightning_reference

__all__ = ["lightning_chunk", "lightning_reference"]
