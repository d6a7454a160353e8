"""Prompts from files and stdin (cli/prompt_input.py): every layout of ids, `.npy` arrays,
text, and one-line errors for files that are missing, empty or not what the flag says."""

from __future__ import annotations

import hashlib
import io
import json
import struct

import numpy as np
import pytest

from prfaas_jax.cli import main
from prfaas_jax.cli.prompt_input import (
    prompt_digest,
    read_prompt_ids,
    read_prompt_text,
)
from prfaas_jax.errors import UserError
from prfaas_jax.toml_config import resolve


@pytest.mark.parametrize(
    "text", ["5,17,42", "5 17 42", "5\n17\n42\n", " 5, 17,\n\t42 ,", "5,17,42\n\n"]
)
def test_ids_in_any_layout(tmp_path, text):
    path = tmp_path / "ids.txt"
    path.write_text(text)
    assert read_prompt_ids(str(path)) == [5, 17, 42]


def test_ids_beyond_what_a_command_line_takes(tmp_path):
    """200,000 ids are ~1 MB as a comma list: past Linux's 128 KiB limit on one argument."""
    ids = np.random.default_rng(0).integers(0, 50_000, 200_000)
    text = ",".join(map(str, ids))
    assert len(text) > 128 * 1024
    path = tmp_path / "long.txt"
    path.write_text(text)
    assert read_prompt_ids(str(path)) == ids.tolist()


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_ids_from_npy(tmp_path, dtype):
    path = tmp_path / "ids.npy"
    np.save(path, np.array([3, 1, 4, 1, 5], dtype))
    assert read_prompt_ids(str(path)) == [3, 1, 4, 1, 5]


def test_ids_and_text_from_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"7 8\n9\n")))
    assert read_prompt_ids("-") == [7, 8, 9]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("héllo\n".encode())))
    assert read_prompt_text("-") == "héllo\n"  # kept exactly, newline included


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        (None, ".txt", "cannot read prompt file"),  # missing
        (b"", ".txt", "holds no token ids"),
        (b" ,\n", ".txt", "holds no token ids"),
        (b"5,17,abc", ".txt", "'abc' is not a token id"),
        (b"1.5 2", ".txt", "'1.5' is not a token id"),
        ("héllo".encode(), ".txt", "use --prompt-file for text"),
        (b"not an array", ".npy", "not a numpy .npy array"),
    ],
)
def test_bad_id_files_are_one_line_errors(tmp_path, content, suffix, message):
    path = tmp_path / f"prompt{suffix}"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=message) as err:
        read_prompt_ids(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.array([[1, 2], [3, 4]], np.int32), r"1-D integer array.*shape \(2, 2\)"),
        (np.array([1.0, 2.0]), "1-D integer array.*float64"),
        (np.array([1, "a"], object), "not a numpy .npy array"),  # would need pickle
    ],
)
def test_npy_files_must_hold_a_1d_integer_array(tmp_path, array, message):
    path = tmp_path / "bad.npy"
    np.save(path, array, allow_pickle=True)
    with pytest.raises(UserError, match=message):
        read_prompt_ids(str(path))


def test_text_files(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("Prefill as a service\n")
    assert read_prompt_text(str(path)) == "Prefill as a service\n"
    path.write_bytes(b"")
    with pytest.raises(UserError, match="is empty"):
        read_prompt_text(str(path))
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(UserError, match="not UTF-8 text"):
        read_prompt_text(str(path))
    with pytest.raises(UserError, match="cannot read prompt file"):
        read_prompt_text(str(tmp_path / "missing.txt"))


def test_digest_is_sha256_of_little_endian_int32():
    expected = hashlib.sha256(struct.pack("<3i", 5, 17, 42)).hexdigest()
    assert prompt_digest([5, 17, 42]) == expected
    assert prompt_digest([5, 17, 42]) != prompt_digest([5, 17, 43])


def _generate(capsys, *argv):
    code = main(["generate", "--max-new-tokens", "3", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _without_timings(out: str) -> dict:
    payload = json.loads(out)
    del payload["prefill_seconds"], payload["decode_seconds"]
    return payload


def test_generate_reads_a_prompt_file_and_reports_it_by_digest(tmp_path, capsys):
    """A prompt from a .npy file and from a text file of ids gives the tokens --prompt-ids
    gives, and the JSON names the prompt by its length and digest instead of echoing it."""
    ids = np.random.default_rng(1).integers(0, 256, 300).astype(np.int32)
    np.save(tmp_path / "p.npy", ids)
    (tmp_path / "p.txt").write_text("\n".join(map(str, ids)))
    runs = []
    for argv in (
        ("--prompt-ids-file", str(tmp_path / "p.npy")),
        ("--prompt-ids-file", str(tmp_path / "p.txt")),
        ("--prompt-ids", ",".join(map(str, ids))),
    ):
        code, out, err = _generate(capsys, *argv, "--json")
        assert code == 0, err
        runs.append(_without_timings(out))
    assert runs[0] == runs[1] == runs[2]
    assert "prompt_ids" not in runs[0] and len(out) < 1000
    assert runs[0]["prompt_len"] == 300
    assert runs[0]["prompt_sha256"] == prompt_digest(ids.tolist())
    code, out, _ = _generate(capsys, "--prompt-ids", "7,8,9", "--json", "--include-prompt")
    assert code == 0 and json.loads(out)["prompt_ids"] == [7, 8, 9]


def test_max_len_replaces_the_models_limit(tmp_path, capsys):
    """--max-len lets a prompt past the model's max_len run (a 24-token model here), and holds
    a run to less: the limit is the flag's, in both directions."""
    text = resolve("models", "tiny").read_text()
    assert text.count("\nmax_len = 4096\n") == 1
    short = tmp_path / "short.toml"
    short.write_text(text.replace("\nmax_len = 4096\n", "\nmax_len = 24\n"))
    prompt = ("--model", str(short), "--prompt-ids", ",".join(["5"] * 30))
    code, _, err = _generate(capsys, *prompt)
    assert code == 2 and "max_len 24" in err
    code, out, err = _generate(capsys, *prompt, "--max-len", "40", "--json")
    assert code == 0, err
    assert len(json.loads(out)["tokens"]) == 3
    code, _, err = _generate(capsys, "--prompt-ids", ",".join(["5"] * 30), "--max-len", "20")
    assert code == 2 and "max_len 20" in err
    # A limit the weights were trained to (max_len_fixed, as an imported checkpoint has) holds.
    fixed = tmp_path / "fixed.toml"
    fixed.write_text(text.replace("\nmax_len = 4096\n", "\nmax_len = 24\nmax_len_fixed = true\n"))
    prompt = ("--model", str(fixed), "--prompt-ids", ",".join(["5"] * 30))
    code, _, err = _generate(capsys, *prompt, "--max-len", "40")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--max-len: 40 tokens exceed tiny's max_len 24, the positional range" in err
    code, out, err = _generate(capsys, *prompt[:2], "--prompt-ids", "5,5", "--max-len", "20")
    assert code == 0, err


def test_generate_reads_text_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hi")))
    code, out, _ = _generate(capsys, "--prompt-file", "-", "--json")
    again = _generate(capsys, "--prompt", "hi", "--json")[1]
    assert code == 0 and _without_timings(out) == _without_timings(again)


@pytest.mark.parametrize(
    "argv",
    [
        ("--prompt-ids-file", "/nonexistent/p.txt"),
        ("--prompt-file", "/nonexistent/p.txt"),
        ("--prompt-ids", "1,2", "--include-prompt"),  # needs --json
        ("--prompt-ids", "1,2", "--max-len", "0"),
    ],
)
def test_prompt_mistakes_are_one_line(capsys, argv):
    code, _, err = _generate(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "error:" in err, err


def test_one_prompt_at_most(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--prompt-ids", "1,2", "--prompt-file", "p.txt"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
