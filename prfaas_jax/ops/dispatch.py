"""Choosing an implementation of each op: ``Impl``, ``linear_op``, ``attention_op``,
``mla_decode_op`` and the decode ops over pages, ``paged_attention_op`` and ``paged_mla_op``.

Every op exists in several implementations with one signature (docs/design.md §3.1): a
token-by-token ``reference`` (``lax.scan``, fp32), a ``chunk``ed ``jnp`` form that is the CPU
default, and a ``pallas`` kernel (interpreted on CPU, compiled on accelerators, with its default
block sizes). Softmax attention has one ``jnp`` form shared by ``reference`` and ``chunk``, and
a flash kernel (prefill), an absorbed-MLA decode kernel and the paged decode kernels under
``pallas``.
"""

from __future__ import annotations

from collections.abc import Callable

from prfaas_jax.config import Impl
from prfaas_jax.ops.attention import (
    attention,
    flash_attention,
    mla_decode_absorbed,
    mla_decode_pallas,
    paged_attention,
    paged_attention_pallas,
    paged_mla_decode,
    paged_mla_decode_pallas,
)
from prfaas_jax.ops.delta_rule import (
    gdn_chunk,
    gdn_pallas,
    gdn_reference,
    kda_chunk,
    kda_pallas,
    kda_reference,
)
from prfaas_jax.ops.lightning import lightning_chunk, lightning_pallas, lightning_reference

_TABLE: dict[tuple[str, Impl], Callable] = {
    ("kda", Impl.REFERENCE): kda_reference,
    ("kda", Impl.CHUNK): kda_chunk,
    ("kda", Impl.PALLAS): kda_pallas,
    ("gdn", Impl.REFERENCE): gdn_reference,
    ("gdn", Impl.CHUNK): gdn_chunk,
    ("gdn", Impl.PALLAS): gdn_pallas,
    ("lightning", Impl.REFERENCE): lightning_reference,
    ("lightning", Impl.CHUNK): lightning_chunk,
    ("lightning", Impl.PALLAS): lightning_pallas,
}


def linear_op(name: str, impl: Impl) -> Callable:
    """The ``(q, k, v, …) -> (o, final_state)`` function of linear op ``name`` in ``impl``."""
    return _TABLE[(name, Impl(impl))]


def attention_op(impl: Impl) -> Callable:
    """Positioned masked GQA (``attention``'s signature): the flash kernel under ``pallas``."""
    return flash_attention if Impl(impl) is Impl.PALLAS else attention


def mla_decode_op(impl: Impl) -> Callable:
    """Absorbed MLA over the latent cache (``mla_decode_absorbed``'s signature)."""
    return mla_decode_pallas if Impl(impl) is Impl.PALLAS else mla_decode_absorbed


def paged_attention_op(impl: Impl) -> Callable:
    """Decode GQA / SWA over pages (``paged_attention``'s signature): the kernel under
    ``pallas``."""
    return paged_attention_pallas if Impl(impl) is Impl.PALLAS else paged_attention


def paged_mla_op(impl: Impl) -> Callable:
    """Absorbed MLA decode over latent pages (``paged_mla_decode``'s signature)."""
    return paged_mla_decode_pallas if Impl(impl) is Impl.PALLAS else paged_mla_decode
