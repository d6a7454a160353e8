"""Shared parts of the Hugging Face parity tests: the transformers reference run, our run, the
comparison, and the CLI round trips (``generate --hf``, ``convert-hf`` + ``--checkpoint``).

Every case compares, in float32 on CPU,

* our prefill logits over the prompt with transformers' no-cache forward (max-abs ≤ tolerance),
* our greedy continuation (prefill, then ``decode_step``) with transformers' cached greedy
  ``generate``: identical tokens for ``NEW_TOKENS`` steps.

Our side runs through ``conftest``'s jitted ``prefill`` / ``decode_step`` with one state capacity
per prompt length, so every load path of the same checkpoint (library import, orbax checkpoint)
reuses one compiled pair.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from conftest import jit_decode, jit_prefill
from hf_fixtures import (
    default_prompt,
    greedy_margins,
    hf_greedy_with_logits,
    hf_prefill_logits,
    make_tiny,
)

from prfaas_jax.cli import main
from prfaas_jax.model import init_state
from prfaas_jax.model.checkpoint import load_checkpoint
from prfaas_jax.model.hf import load_hf

NEW_TOKENS = 24
LOGIT_TOL = 1e-3  # max-abs on logits of std ≈ 6.5 (lm_head × 4 in the fixtures), float32


@dataclasses.dataclass(frozen=True)
class Reference:
    path: Path
    prompt: list[int]
    logits: np.ndarray  # [T, V]: transformers' forward over the prompt, no cache
    tokens: list[int]  # transformers' greedy continuation with its cache
    margin: float  # smallest top-1 − top-2 logit gap along that continuation


def _greedy_without_cache(path: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy decoding by one full no-cache forward per token (for broken HF cache paths)."""
    tokens, step_logits = [], []
    for _ in range(NEW_TOKENS):
        last = hf_prefill_logits(path, prompt + tokens)[-1]
        step_logits.append(last)
        tokens.append(int(np.argmax(last)))
    return tokens, np.stack(step_logits)


def reference(
    path: Path, *, prompt_len: int = 20, vocab_size: int = 160, hf_cache: bool = True
) -> Reference:
    """Run transformers on ``path``. ``hf_cache=False`` decodes without transformers' cache, for
    configurations whose cached generation disagrees with transformers' own forward pass."""
    prompt = default_prompt(prompt_len, vocab_size=vocab_size, seed=1)
    if hf_cache:
        tokens, step_logits = hf_greedy_with_logits(path, prompt, NEW_TOKENS)
    else:
        tokens, step_logits = _greedy_without_cache(path, prompt)
    return Reference(
        path=path,
        prompt=prompt,
        logits=hf_prefill_logits(path, prompt),
        tokens=tokens,
        margin=float(greedy_margins(step_logits).min()),
    )


def run_ours(params: dict, cfg, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
    """Prefill logits ``[T, V]`` and the greedy continuation of ``NEW_TOKENS`` tokens."""
    state = init_state(cfg, 1, len(prompt) + NEW_TOKENS)
    logits, state = jit_prefill(params, cfg, jnp.asarray([prompt], jnp.int32), state)
    tokens = [int(jnp.argmax(logits[0, -1]))]
    for _ in range(NEW_TOKENS - 1):
        step, state = jit_decode(params, cfg, jnp.asarray(tokens[-1:], jnp.int32), state)
        tokens.append(int(jnp.argmax(step[0])))
    return np.asarray(logits[0]), tokens


def assert_matches(
    logits: np.ndarray, tokens: list[int], ref: Reference, tol: float = LOGIT_TOL
) -> None:
    assert logits.shape == ref.logits.shape
    err = float(np.max(np.abs(logits - ref.logits)))
    assert err <= tol, f"prefill logits differ from transformers by {err:.2e} (> {tol:.0e})"
    # The reference's own greedy margins must clear our error, or token equality means nothing.
    assert ref.margin > 2 * err, f"greedy margin {ref.margin:.2e} too close to the error {err:.2e}"
    assert tokens == ref.tokens, f"greedy tokens differ:\nours {tokens}\nhf   {ref.tokens}"


def assert_same_params(a: dict, b: dict) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def cli_json(capsys, *argv: str) -> dict:
    """Run ``prfaas ARGV --json`` in-process; its parsed output (exit code must be 0)."""
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def cli_generate(capsys, tmp_path: Path, ref: Reference, *weights: str) -> None:
    """``prfaas generate WEIGHTS… --dump-logits`` reproduces transformers."""
    dump = tmp_path / "logits.npy"
    result = cli_json(
        capsys,
        "generate",
        *weights,
        "--prompt-ids",
        ",".join(map(str, ref.prompt)),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--dump-logits",
        str(dump),
    )
    assert_matches(np.load(dump), result["tokens"], ref)


def convert(capsys, ref: Reference, out: Path) -> dict:
    """``prfaas convert-hf`` of the reference checkpoint into ``out``; the command's summary."""
    summary = cli_json(capsys, "convert-hf", str(ref.path), str(out))
    assert Path(summary["checkpoint"]) == out.resolve()
    assert (out / "config.toml").is_file() and (out / "params").is_dir()
    return summary


_REFERENCES: dict[tuple[str, str], Reference] = {}


def case_reference(family: str, name: str, cases: dict, tmp_path_factory) -> Reference:
    """Build case ``name`` of ``family`` once per session and run transformers on it."""
    key = (family, name)
    if key not in _REFERENCES:
        overrides = dict(cases[name])
        prompt_len = overrides.pop("prompt_len", 20)
        hf_cache = overrides.pop("hf_cache", True)
        path = make_tiny(family, tmp_path_factory.mktemp(f"{family}-{name}"), **overrides)
        _REFERENCES[key] = reference(path, prompt_len=prompt_len, hf_cache=hf_cache)
    return _REFERENCES[key]


def check_import(ref: Reference):
    """``load_hf`` + our forward reproduce transformers; returns the imported config."""
    cfg, params = load_hf(ref.path)
    assert_matches(*run_ours(params, cfg, ref.prompt), ref)
    return cfg


def check_convert(capsys, tmp_path: Path, ref: Reference) -> Path:
    """``prfaas convert-hf`` writes a checkpoint equal to the import, which reproduces transformers
    (through the library; the compiled functions are the import's). Returns the checkpoint."""
    out = tmp_path / "ckpt"
    convert(capsys, ref, out)
    cfg, params = load_checkpoint(out)
    cfg_hf, params_hf = load_hf(ref.path)
    assert cfg == cfg_hf
    assert_same_params(params, params_hf)
    assert_matches(*run_ours(params, cfg, ref.prompt), ref)
    return out
