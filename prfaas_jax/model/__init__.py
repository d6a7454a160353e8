"""The hybrid model: parameters, the prefill/decode forward passes and their typed state.

The names load on first use (PEP 562): importing `prfaas_jax.model.state` alone does not import
Flax, so processes that only move states (the fake-engine workers) never pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {
    "decode_step": "hybrid",
    "init_params": "hybrid",
    "prefill": "hybrid",
    "prefill_layers": "hybrid",
    "DeltaState": "state",
    "KvState": "state",
    "LightningState": "state",
    "MlaState": "state",
    "ModelState": "state",
    "WindowKvState": "state",
    "init_state": "state",
    "state_nbytes": "state",
}
__all__ = [
    "DeltaState",
    "KvState",
    "LightningState",
    "MlaState",
    "ModelState",
    "WindowKvState",
    "decode_step",
    "init_params",
    "init_state",
    "prefill",
    "prefill_layers",
    "state_nbytes",
]

if TYPE_CHECKING:
    from prfaas_jax.model.hybrid import decode_step, init_params, prefill, prefill_layers
    from prfaas_jax.model.state import (
        DeltaState,
        KvState,
        LightningState,
        MlaState,
        ModelState,
        WindowKvState,
        init_state,
        state_nbytes,
    )


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
