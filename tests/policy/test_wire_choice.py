"""Adaptive wire precision (policy/wire_choice.py): the option within the recall budget, the
hysteresis between the two utilisation levels, and the utilisation measured from the egress
counter — each against cases worked by hand."""

from __future__ import annotations

import pytest

from prfaas_jax.policy.threshold_controller import LinkObservation
from prfaas_jax.policy.wire_choice import (
    AdaptiveWire,
    AdaptiveWireConfig,
    WireOption,
    narrowest_within,
    narrowing,
)

BF16 = WireOption("bf16", byte_ratio=0.96, recall_loss=0.0)
INT8 = WireOption("int8", byte_ratio=0.49, recall_loss=0.001)
FP8 = WireOption("fp8_e4m3", byte_ratio=0.49, recall_loss=0.03)


def test_the_narrowest_option_within_the_budget():
    options = (BF16, FP8, INT8)
    assert narrowest_within(options, 0.01) is INT8  # fp8 is as narrow but loses 3 points
    assert narrowest_within(options, 0.05) is INT8  # equal bytes: the smaller loss
    assert narrowest_within(options, 0.0) is BF16
    assert narrowest_within((FP8,), 0.01) is None
    with pytest.raises(ValueError, match="byte_ratio"):
        WireOption("int8", byte_ratio=1.5, recall_loss=0.0)
    with pytest.raises(ValueError, match="expected one of native, bf16"):
        WireOption("int4", byte_ratio=0.3, recall_loss=0.0)  # no encoding the codec knows


def test_narrowing_has_hysteresis_between_the_levels():
    narrowed, seen = False, []
    for u in (0.5, 0.9, 0.7, 0.6, 0.7, 0.85, 0.61):
        narrowed = narrowing(u, narrowed, high=0.85, low=0.6)
        seen.append(narrowed)
    assert seen == [False, True, True, False, False, True, True]


def test_utilisation_from_the_egress_counter_over_the_window():
    wire = AdaptiveWire(AdaptiveWireConfig(options=(BF16, INT8), window_s=2.0))
    steps = [(0.0, 0), (1.0, 900), (2.0, 1400), (3.0, 1900)]
    seen = []
    for now, sent in steps:
        wire.observe(LinkObservation(now, sent, capacity_bytes_per_s=1000.0, prfaas_queue_depth=0))
        seen.append((round(wire.utilization, 6), wire.choose()))
    # 900 B in 1 s of 1000 B/s: 0.9 ≥ 0.85, int8; 1400 B in 2 s: 0.7, still int8; at 3 s the
    # sample at 0 s has left the 2 s window: 1000 B in 2 s, 0.5 ≤ 0.6, native again.
    assert seen == [(0.0, None), (0.9, INT8), (0.7, INT8), (0.5, None)]
