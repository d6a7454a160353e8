"""`prfaas train` as a user runs it: a JSON summary with the promised keys, a checkpoint that
`prfaas generate` loads, a resume that refuses other flags, and one-line errors.

A two-block cut of ``tiny`` written as a model TOML keeps the compile short.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from prfaas_jax.cli import main
from prfaas_jax.config import LayerKind, MlpKind, load_model_config
from prfaas_jax.model.checkpoint import config_to_toml

FLAGS = [
    "--steps", "6", "--batch-size", "8", "--seq-len", "32", "--num-pairs", "4",
    "--eval-every", "3", "--eval-examples", "16", "--checkpoint-every", "3",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_toml(tmp_path_factory):
    cut = dataclasses.replace(
        load_model_config("tiny"),
        name="tiny-cut",
        layers=(LayerKind.KDA, LayerKind.MLA),
        mlps=(MlpKind.DENSE, MlpKind.DENSE),
    )
    path = tmp_path_factory.mktemp("model") / "tiny-cut.toml"
    path.write_text(config_to_toml(cut))
    return path


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_train_writes_a_checkpoint_that_generate_loads(model_toml, tmp_path, capsys):
    out_dir = tmp_path / "run"
    argv = ["train", "--model", str(model_toml), *FLAGS, "--out", str(out_dir), "--json"]
    code, out, _ = _run(argv, capsys)
    assert code == 0
    summary = json.loads(out)
    for key in ("eval_accuracy", "steps", "tokens_per_s", "seconds"):
        assert key in summary
    assert summary["steps"] == 6 and 0.0 <= summary["eval_accuracy"] <= 1.0
    assert [e["step"] for e in summary["evals"]] == [3, 6]
    assert summary["tokens_per_s"] > 0 and summary["seconds"] > 0
    assert (out_dir / "config.toml").is_file() and (out_dir / "params").is_dir()
    assert json.loads((out_dir / "run.json").read_text())["results"]["steps"] == 6

    def generate(model: str) -> list[int]:
        code, out, _ = _run(
            ["generate", "--model", model, "--prompt-ids", "5,17,42", "--json"], capsys
        )
        assert code == 0
        return json.loads(out)["tokens"]

    # The trained weights, not the seeded ones the same layout starts from.
    assert generate(str(out_dir)) != generate(str(model_toml))

    # The same command again finds the finished run; other flags are refused in one line.
    code, out, _ = _run(argv, capsys)
    assert code == 0 and json.loads(out)["resumed_from"] == 6
    code, _, err = _run([*argv[:-1], "--lr", "1e-3"], capsys)
    assert code == 2 and "another train configuration" in err and err.count("\n") == 1
    assert "(lr: 0.003 there, 0.001 here)" in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--impl", "pallas"], "training runs the chunk or reference ops"),
        (["--num-pairs", "0"], "--num-pairs"),
        (["--steps", "0"], "--steps"),
        (["--task", "retrieval", "--seq-len", "16"], "--seq-len ≥"),
        (["--init-from", "/nonexistent/run"], "not a model checkpoint"),
    ],
)
def test_mistakes_are_one_line(model_toml, extra, message, capsys):
    code, _, err = _run(["train", "--model", str(model_toml), *FLAGS, *extra], capsys)
    assert code == 2 and message in err and err.count("\n") == 1
