"""Choosing an implementation of each op: ``Impl`` and the lookup from (op, impl) to a function.

Every op exists in several implementations with one signature (DESIGN.md §3.1): a token-by-token
``reference`` (``lax.scan``, fp32) and a ``chunk``ed ``jnp`` form that is the CPU default.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from prfaas_jax.ops.gdn import gdn_chunk, gdn_reference
from prfaas_jax.ops.kda import kda_chunk, kda_reference
from prfaas_jax.ops.lightning import lightning_chunk, lightning_reference


class Impl(enum.StrEnum):
    REFERENCE = "reference"
    CHUNK = "chunk"


_TABLE: dict[tuple[str, Impl], Callable] = {
    ("kda", Impl.REFERENCE): kda_reference,
    ("kda", Impl.CHUNK): kda_chunk,
    ("gdn", Impl.REFERENCE): gdn_reference,
    ("gdn", Impl.CHUNK): gdn_chunk,
    ("lightning", Impl.REFERENCE): lightning_reference,
    ("lightning", Impl.CHUNK): lightning_chunk,
}


def linear_op(name: str, impl: Impl) -> Callable:
    """The ``(q, k, v, …) -> (o, final_state)`` function of linear op ``name`` in ``impl``."""
    return _TABLE[(name, Impl(impl))]
