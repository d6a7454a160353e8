"""The hybrid model: parameters, the prefill/decode forward passes and their typed state."""

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
