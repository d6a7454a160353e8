"""`prfaas generate`: deterministic output, JSON keys, sampling flags and user errors."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from conftest import jit_decode, jit_prefill, preset

from prfaas_jax.cli import main
from prfaas_jax.model import init_state


def _run(capsys, *argv):
    code = main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_greedy_tokens_match_the_model(capsys):
    code, out, _ = _run(capsys, "--prompt-ids", "5,17,42,99", "--max-new-tokens", "5", "--json")
    assert code == 0
    tokens = json.loads(out)["tokens"]
    assert len(tokens) == 5

    cfg, params = preset("tiny")  # the CLI's default model and seed
    prompt = jnp.asarray([[5, 17, 42, 99]], jnp.int32)
    logits, state = jit_prefill(params, cfg, prompt, init_state(cfg, 1, 9))
    expected = [int(jnp.argmax(logits[0, -1]))]
    for _ in range(4):
        logits, state = jit_decode(params, cfg, jnp.asarray(expected[-1:]), state)
        expected.append(int(jnp.argmax(logits[0])))
    assert tokens == expected


def test_sampling_is_seeded(capsys):
    args = ("--prompt", "hi", "--max-new-tokens", "6", "--temperature", "1.5", "--top-p", "0.9")
    first = json.loads(_run(capsys, *args, "--json")[1])["tokens"]
    again = json.loads(_run(capsys, *args, "--json")[1])["tokens"]
    other = json.loads(_run(capsys, *args, "--sample-seed", "3", "--json")[1])["tokens"]
    assert first == again
    assert first != other


def test_human_output_is_a_table(capsys):
    code, out, _ = _run(capsys, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert code == 0 and "new tokens" in out


def test_user_errors_are_one_line(capsys):
    for argv in (
        ("--model", "nope"),
        ("--prompt-ids", "1,300"),
        ("--max-new-tokens", "0"),
        ("--temperature", "-1"),
        ("--tiling", "tpu"),  # tiles Pallas kernels only: needs --impl pallas
    ):
        code, _, err = _run(capsys, *argv)
        assert code == 2, argv
        assert len(err.strip().splitlines()) == 1 and "error:" in err, (argv, err)
        assert "Traceback" not in err


def test_tiling_flag_traces_the_kernels_under_that_backends_rules(monkeypatch):
    """``--tiling tpu`` makes the kernels traced during generation pick Mosaic's blocks (the
    token equality itself, per tiling and preset, is tests/ops/test_pallas_kernels.py's)."""
    from prfaas_jax.cli import generation
    from prfaas_jax.ops.pallas_backend import Backend, target_backend

    class TracedError(Exception):
        pass

    def fake_generate(request):
        raise TracedError(request.impl, target_backend())

    monkeypatch.setattr(generation, "generate_from_preset", fake_generate)
    for tiling, backend in (("tpu", Backend.TPU), ("gpu", Backend.GPU)):
        with pytest.raises(TracedError) as traced:
            main(["generate", "--impl", "pallas", "--tiling", tiling, "--prompt-ids", "1,2"])
        assert traced.value.args == ("pallas", backend)
    assert target_backend() == Backend.GPU  # the CPU's own, restored on the way out
