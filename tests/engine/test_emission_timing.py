"""A layer-wise prefill timed layer by layer (engine/emission_timing.py), and the exposed
transfer made of the timings (planning/codesign_emission.py) against a hand count."""

from __future__ import annotations

import dataclasses

import pytest

from prfaas_jax.config import LayerKind, MlpKind, load_model_config
from prfaas_jax.engine.emission_timing import layer_seconds
from prfaas_jax.model.seeded_weights import seeded_params
from prfaas_jax.planning.codesign_emission import measured_exposed_s
from prfaas_jax.state_bytes import layer_nbytes, state_nbytes


def test_each_layer_of_a_layer_wise_prefill_is_timed():
    cfg = dataclasses.replace(
        load_model_config("tiny"),
        layers=(LayerKind.KDA, LayerKind.MLA),
        mlps=(MlpKind.DENSE, MlpKind.DENSE),
    )
    seconds = layer_seconds(cfg, seeded_params(cfg, 0), 16, repeats=1)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


def test_the_toy_link_is_its_phi_kv_and_the_last_layer_is_exposed():
    cfg = dataclasses.replace(
        load_model_config("tiny"),
        layers=(LayerKind.KDA, LayerKind.MLA),
        mlps=(MlpKind.DENSE, MlpKind.DENSE),
    )
    kda, mla = (layer_nbytes(cfg, kind, 64) for kind in cfg.layers)
    assert kda + mla == state_nbytes(cfg, 64)
    # Two layers of 1 s each on a link of S / 2 s: the KDA state leaves in kda / S · 2 s (< 1 s,
    # before the MLA layer is done), the MLA cache takes mla / S · 2 s after the prefill.
    exposed = measured_exposed_s(cfg, 64, [1.0, 1.0])
    assert exposed == pytest.approx(2.0 * mla / (kda + mla))
