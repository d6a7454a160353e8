"""`prfaas wirecheck` (engine/wirecheck.py) held against independent numbers: the exact state's
bytes by formula, the relative error of bfloat16 rounding done on the bits in NumPy, and the
trained retrieval checkpoint's recall computed by single-process generation with the engines."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prfaas_jax.cli import main
from prfaas_jax.engine.codec.layout import canonical_arrays
from prfaas_jax.engine.generate import generate
from prfaas_jax.engine.sampling_params import GREEDY
from prfaas_jax.engine.wirecheck import wire_check
from prfaas_jax.model import init_state, prefill
from prfaas_jax.model.weights import load_model
from prfaas_jax.serving.loadgen.demo import recall_task
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.train.tasks import recall_prompt
from prfaas_jax.wire_precision import WirePrecision

SETTINGS = [WirePrecision.parse(s) for s in ("native", "bf16", "int8")]
LENGTH = 60


@pytest.fixture(scope="module")
def checked():
    cfg, params = load_model("recall-tiny")
    task = recall_task("recall-tiny")
    key = jax.random.PRNGKey(3)
    asked = [recall_prompt(jax.random.fold_in(key, i), task, LENGTH) for i in range(6)]
    prompts, answers = [p for p, _ in asked], [a for _, a in asked]
    rows = wire_check(cfg, params, prompts, SETTINGS, new_tokens=4, answers=answers)
    return cfg, params, prompts, answers, rows


def bf16_error(x: np.ndarray) -> tuple[float, float]:
    """(Σ (bf16(x) − x)², Σ x²), bfloat16 rounding to nearest even on the bit pattern."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    y = rounded.view(np.float32).astype(np.float64)
    return float(np.sum((y - x) ** 2)), float(np.sum(np.asarray(x, np.float64) ** 2))


def test_native_is_the_exact_state(checked):
    cfg, _, _, _, rows = checked
    native = rows[0]
    assert native.payload_bytes == state_nbytes(cfg, LENGTH) and native.ratio == 1.0
    assert (native.agreement, native.mean_kl, native.state_error) == (1.0, 0.0, 0.0)


def test_the_state_error_is_bfloat16_rounding(checked):
    cfg, params, prompts, _, rows = checked
    errors = []
    for prompt in prompts:
        state = init_state(cfg, 1, LENGTH + 4)
        _, state = prefill(params, cfg, jnp.asarray([prompt], jnp.int32), state)
        parts = [bf16_error(np.asarray(x)) for _, x in canonical_arrays(state, cfg, 0)[1]]
        errors.append(np.sqrt(sum(d for d, _ in parts) / sum(n for _, n in parts)))
    assert rows[1].state_error == pytest.approx(np.mean(errors), rel=1e-6)
    assert rows[1].payload_bytes == state_nbytes(cfg, LENGTH) // 2  # every tensor is float32
    assert rows[1].mean_kl > 0 and rows[1].state_error < rows[2].state_error < 0.02


def test_native_recall_is_the_models_own(checked):
    cfg, params, prompts, answers, rows = checked
    alone = [
        generate(params, cfg, p, 2, GREEDY)[0][1] == a
        for p, a in zip(prompts, answers, strict=True)
    ]
    assert rows[0].recall == np.mean(alone) > 0.5


def test_the_command_prints_json_and_refuses_bad_input(capsys):
    argv = ["wirecheck", "--model", "recall-tiny", "--prompts", "2", "--new-tokens", "3"]
    both = ["--model", "tiny,recall-tiny", "--settings", "native", "state=int8,kv=bf16", "--json"]
    assert main([*argv, *both]) == 0
    tiny, recall = json.loads(capsys.readouterr().out)["models"]
    assert (tiny["model"], tiny["recall_task"]) == ("tiny", False)
    assert (recall["model"], recall["recall_task"]) == ("recall-tiny", True)
    for out in (tiny, recall):
        assert [r["setting"] for r in out["rows"]] == ["native", "state=int8,kv=bf16"]
    assert tiny["rows"][0]["recall"] is None and recall["rows"][0]["recall"] is not None
    for bad in (["--settings", "int4"], ["--new-tokens", "1"], ["--prompt-len", "500"]):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("prfaas wirecheck: error:")
