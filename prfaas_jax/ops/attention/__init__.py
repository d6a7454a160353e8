"""Softmax attention: masked grouped-query attention over a positioned key buffer (GQA, sliding
windows, sinks) and MLA decode in the absorbed form over the latent cache.

- ``reference.py``: the ``jnp`` forms, ``attention`` (with its blocked online-softmax path
  ``blocked_attention`` for long prefills) and ``mla_decode_absorbed`` (with
  ``mla_decode_absorbed_heads``, its form on head-major weights).
- ``flash_pallas.py``: ``flash_attention``, the prefill kernel (``attention``'s contract), tiled
  by ``FlashBlockSizes``.
- ``mla_decode_pallas.py``: ``mla_decode_pallas``, the absorbed MLA decode kernel
  (``mla_decode_absorbed``'s contract), tiled by ``MlaDecodeBlockSizes``.
- ``paged.py``: ``paged_attention`` and ``paged_mla_decode``, decode over a paged KV cache (pages
  gathered by table, then the forms above); ``paged_pallas.py``: their kernel,
  ``paged_attention_pallas`` and ``paged_mla_decode_pallas``, reading the pages in place.
- ``online_softmax.py``: the online-softmax step the kernels share.
"""

from prfaas_jax.ops.attention.flash_pallas import FlashBlockSizes, flash_attention
from prfaas_jax.ops.attention.mla_decode_pallas import MlaDecodeBlockSizes, mla_decode_pallas
from prfaas_jax.ops.attention.paged import paged_attention, paged_mla_decode
from prfaas_jax.ops.attention.paged_pallas import paged_attention_pallas, paged_mla_decode_pallas
from prfaas_jax.ops.attention.reference import (
    attention,
    blocked_attention,
    mla_decode_absorbed,
    mla_decode_absorbed_heads,
)

__all__ = [
    "FlashBlockSizes",
    "MlaDecodeBlockSizes",
    "attention",
    "blocked_attention",
    "flash_attention",
    "mla_decode_absorbed",
    "mla_decode_absorbed_heads",
    "mla_decode_pallas",
    "paged_attention",
    "paged_attention_pallas",
    "paged_mla_decode",
    "paged_mla_decode_pallas",
]
