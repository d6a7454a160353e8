"""`shipped_accuracy` (train/recall_probe.py): a trained retrieval checkpoint's held-out accuracy
with each example's context state sent through the codec. Oracles: `loop.evaluate` on the same
examples (native: the same logits in two calls), and a state of zeros (the context never
arrived), which must lose the answers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from prfaas_jax.model.weights import load_model
from prfaas_jax.serving.loadgen.demo import recall_task
from prfaas_jax.train.loop import TrainConfig, eval_set, evaluate
from prfaas_jax.train.recall_probe import RecallResult, shipped_accuracy, shipped_recall
from prfaas_jax.wire_precision import WirePrecision


@pytest.fixture(scope="module")
def held_out():
    cfg, params = load_model("recall-tiny")
    spec = recall_task("recall-tiny")
    config = TrainConfig(eval_examples=24)
    return cfg, params, spec, config, eval_set(spec, config)


def test_native_is_the_plain_evaluation(held_out):
    cfg, params, _, _, batch = held_out
    native = shipped_accuracy(params, cfg, batch, WirePrecision())
    assert native == evaluate(params, cfg, batch) > 0.9


def test_int8_keeps_the_answers_and_a_lost_context_does_not(held_out, monkeypatch):
    cfg, params, _, _, batch = held_out
    exact = evaluate(params, cfg, batch)
    assert shipped_accuracy(params, cfg, batch, WirePrecision.parse("int8")) >= exact - 0.05
    # The control: every shipped state replaced by zeros, as if no context had been prefilled.
    from prfaas_jax.train import recall_probe

    real = recall_probe.codec.decode
    monkeypatch.setattr(
        recall_probe.codec,
        "decode",
        lambda *a, **k: jax.tree.map(
            lambda x: x if x.dtype == jnp.int32 else jnp.zeros_like(x), real(*a, **k)
        ),
    )
    assert shipped_accuracy(params, cfg, batch, WirePrecision()) < exact - 0.3


def test_shipped_recall_evaluates_each_length(held_out):
    cfg, params, spec, config, _ = held_out
    trained = RecallResult({96: 1.0}, 0.0, 400, 1.0, params=params)
    result = shipped_recall(cfg, spec, config, trained, [64, 96], WirePrecision.parse("bf16"))
    assert set(result.accuracy) == {64, 96} and min(result.accuracy.values()) > 0.8
    longer = dataclasses.replace(spec, seq_len=64)
    assert result.accuracy[64] == pytest.approx(
        shipped_accuracy(params, cfg, eval_set(longer, config), WirePrecision.parse("bf16"))
    )
    with pytest.raises(ValueError, match="no parameters"):
        shipped_recall(
            cfg, spec, config, dataclasses.replace(trained, params=None), [96], WirePrecision()
        )
