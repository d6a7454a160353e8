"""The exposed transfer of a co-design point: `layer_groups(layout, length, prefill_s,
precision)` and `modelled_exposed_s(...)` at full size, `measured_exposed_s(...)` from a toy's
timed layers.

The layer-wise emission model (policy/layer_emission.py) fed one group per layer: a layer's
compute is the prefill time T_prefill(l) split by the layer's share of the counted FLOPs
(`prefill_cost.prefill_flops_by_part`: its mixer and its MLP; the LM head last, with no state),
its bytes are its state at l in the point's wire precision (`state_bytes.layer_nbytes`). So two
layouts with the same layers in another order have the same bytes and the same prefill time,
and expose different transfers. A toy's layers are timed instead (engine/emission_timing.py),
on a link of its Φ_kv, S_kv / T_prefill (Eq. 1): the rate that keeps up with the state on
average, where only the order of the bytes decides what is left at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

from prfaas_jax.config import ModelConfig
from prfaas_jax.planning.prefill_cost import prefill_flops_by_part
from prfaas_jax.policy.layer_emission import Group, exposed_transfer_s
from prfaas_jax.state_bytes import layer_nbytes, state_nbytes
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision


def layer_groups(
    layout: ModelConfig, length: int, prefill_s: float, precision: WirePrecision = WIRE_NATIVE
) -> list[Group]:
    """One `Group` per layer in order, then the LM head's compute (no bytes)."""
    flops = prefill_flops_by_part(layout, length)
    per_s = prefill_s / flops.total
    groups = [
        Group((mixer + mlp) * per_s, layer_nbytes(layout, kind, length, precision))
        for kind, mixer, mlp in zip(layout.layers, flops.mixers, flops.mlps, strict=True)
    ]
    return [*groups, Group(flops.head * per_s, 0)]


def modelled_exposed_s(
    layout: ModelConfig,
    length: int,
    prefill_s: float,
    gbps: float,
    precision: WirePrecision = WIRE_NATIVE,
) -> float:
    """Seconds of transfer left when the prefill of ``length`` tokens ends, layer-wise."""
    return exposed_transfer_s(layer_groups(layout, length, prefill_s, precision), gbps)


def measured_exposed_s(
    layout: ModelConfig,
    length: int,
    layer_s: Sequence[float],
    precision: WirePrecision = WIRE_NATIVE,
) -> float:
    """Seconds of transfer left after a layer-wise prefill whose layers took ``layer_s``, on a
    link of Φ_kv = S_kv(length) / sum(layer_s)."""
    prefill_s = sum(layer_s)
    gbps = 8 * state_nbytes(layout, length, precision) / prefill_s / 1e9
    groups = [
        Group(seconds, layer_nbytes(layout, kind, length, precision))
        for kind, seconds in zip(layout.layers, layer_s, strict=True)
    ]
    return exposed_transfer_s(groups, gbps)
