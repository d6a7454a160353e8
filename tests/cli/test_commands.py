"""The `prfaas` command as a whole: help for every command, instant start, one-line user
errors in each command group, and a progress display that stays quiet off a terminal."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from serving_support import fake_config

from prfaas_jax.cli import build_parser, main
from prfaas_jax.cli.progress import progress

COMMANDS = build_parser()._subparsers._group_actions[0].choices


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert {"demo", "generate", "plan", "simulate", "kv", "bench", "soak"} <= set(COMMANDS)


@pytest.mark.parametrize(
    "argv", [[name, "--help"] for name in COMMANDS] + [["state", "inspect", "--help"]]
)
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: prfaas" in capsys.readouterr().out


def test_soak_help_says_what_it_checks(capsys):
    with pytest.raises(SystemExit):
        main(["soak", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in ("lost", "duplicated", "wrong", "configs/clusters/faults.toml", "Exit status 1"):
        assert words in out
    for flag in ("--duration", "--rate", "--kill-every", "--seed", "--deadline", "--json"):
        assert flag in out


def test_help_loads_neither_jax_nor_grpc():
    code = (
        "import sys; from prfaas_jax.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('jax', 'grpc', 'numpy', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["prefill", "--chunk-len", "0", "--out", "x.prfs"], "--chunk-len must be at least 1"),
        (["plan", "--config", "unused.toml", "--bandwidth", "0"], "--bandwidth must be"),
        (["kv", "--compare", "tiny"], "--compare needs at least two models"),
        (["kv", "--paper", "--lengths", "1K"], "drop --lengths"),
        (["bench", "--router", "127.0.0.1:1", "--num-prompts", "0"], "--num-prompts"),
        (["bench", "--router", "127.0.0.1:1", "--endpoint", "openai"], "needs the front door"),
        (["bench", "--router", "h:1", "--endpoint", "grpc", "--openai", "u"], "drop --openai"),
        (["certs", "--out", "unused", "--days", "0"], "--days must be"),
        (["soak", "--duration", "0"], "must be positive"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"prfaas {argv[0]}: error:"), err
    assert message in err[0]


def test_progress_is_quiet_off_a_terminal(capsys):
    for quiet in (False, True):
        with progress("work", total=3, quiet=quiet) as shown:
            shown.update(advance=1, description="more work")
            shown.update(completed=3, total=3)
    assert capsys.readouterr() == ("", "")


def test_progress_on_a_terminal_draws_on_stderr_only(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress("work", total=2, unit="steps") as shown:
        print("result")
        shown.update(advance=1, description="half done")
        shown.update(completed=2)
    out, err = capsys.readouterr()
    assert out == "result\n"
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err)  # without the terminal's control codes
    assert "half done" in drawn and "2/2 steps" in drawn


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"model": {"engine": "fake"}}, 'it needs engine = "jax"'),
        ({"link": {"precision": "int8"}}, 'which [link] precision = "int8" does not promise'),
        (
            {"wire": {"options": [{"precision": "int8", "byte_ratio": 0.3, "recall_loss": 0.0}]}},
            "which [wire] (narrowed states) does not promise",
        ),
    ],
)
def test_the_demo_refuses_a_config_whose_outputs_it_cannot_check(
    tmp_path, capsys, sections, message
):
    config = fake_config(tmp_path / "cluster.toml", **{"model": {"engine": "jax"}, **sections})
    assert main(["demo", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_bench_endpoint_openai_takes_the_ready_files_front_door(tmp_path):
    """`--endpoint openai` (the spelling of vllm-style docs) and `--openai URL` name one path."""
    from prfaas_jax.cli import build_parser
    from prfaas_jax.cli.bench_command import _openai_url

    ready = tmp_path / "ready.json"
    ready.write_text('{"router": "127.0.0.1:1", "openai": "http://127.0.0.1:9/v1"}')
    parse = build_parser().parse_args
    assert _openai_url(parse(["bench", "--ready-file", str(ready), "--endpoint", "openai"])) == (
        "http://127.0.0.1:9/v1"
    )
    given = ["bench", "--ready-file", str(ready), "--base-url", "http://h:8/v1"]
    assert _openai_url(parse(given)) == "http://h:8/v1"
    assert _openai_url(parse(["bench", "--ready-file", str(ready)])) is None  # gRPC
