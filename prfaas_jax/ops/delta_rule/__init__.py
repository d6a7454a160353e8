"""The gated delta rule: ``delta_rule_*`` takes log decays g [B,T,HV,K] or [B,T,HV,1]; KDA (Kimi
Delta Attention) is the rule with one decay per key channel (``kda_*``: g [B,T,HV,K]), GDN (Gated
DeltaNet) with one per value head (``gdn_*``: g [B,T,HV]). Each in three implementations with one
contract: ``reference.py`` (token-by-token scan), ``chunk.py`` (chunked jnp), ``pallas.py``
(kernel, tiled by ``StateBlockSizes``)."""

from prfaas_jax.ops.delta_rule.chunk import delta_rule_chunk, gdn_chunk, kda_chunk
from prfaas_jax.ops.delta_rule.pallas import delta_rule_pallas, gdn_pallas, kda_pallas
from prfaas_jax.ops.delta_rule.reference import delta_rule_reference, gdn_reference, kda_reference
from prfaas_jax.ops.pallas_launch import StateBlockSizes

__all__ = [
    "StateBlockSizes",
    "delta_rule_chunk",
    "delta_rule_pallas",
    "delta_rule_reference",
    "gdn_chunk",
    "gdn_pallas",
    "gdn_reference",
    "kda_chunk",
    "kda_pallas",
    "kda_reference",
]
