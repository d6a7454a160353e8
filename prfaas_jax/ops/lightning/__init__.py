"""Lightning attention, a constant per-head decay and no delta rule: ``lightning_reference``
(token-by-token scan), ``lightning_chunk`` (chunked jnp) and ``lightning_pallas`` (kernel, tiled by
``StateBlockSizes``), one contract."""

from prfaas_jax.ops.lightning.chunk import lightning_chunk
from prfaas_jax.ops.lightning.pallas import lightning_pallas
from prfaas_jax.ops.lightning.reference import lightning_reference
from prfaas_jax.ops.pallas_launch import StateBlockSizes

__all__ = ["StateBlockSizes", "lightning_chunk", "lightning_pallas", "lightning_reference"]
