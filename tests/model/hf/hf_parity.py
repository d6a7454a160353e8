"""The Hugging Face parity tests, written once for every family: ``FamilyParity``.

A family's ``test_<family>_parity.py`` subclasses ``FamilyParity`` and gives only what is its own:
its cases (``make_tiny`` knobs, prompt length, which transformers decoding is the oracle), how the
CLI test passes the weights, and the assertions on the imported config. Every case compares, in
float32 on CPU,

* our prefill logits over the prompt with transformers' no-cache forward (max-abs ≤ tolerance),
* our greedy continuation (prefill, then ``decode_step``) with transformers' cached greedy
  ``generate`` (or, where a case says so, greedy decoding by no-cache forwards): identical tokens
  for ``NEW_TOKENS`` steps,

through the library import (every case, ``DEFAULT`` first); the fixture default also through
``prfaas convert-hf`` and the orbax checkpoint it writes, and through ``prfaas generate``
in-process (``--hf DIR``, or the converted checkpoint as ``--checkpoint OUT`` / ``--model OUT``).

Our side runs through ``conftest``'s jitted ``prefill`` / ``decode_step`` with one state capacity
per prompt length, so every load path of the same checkpoint (library import, orbax checkpoint)
reuses one compiled pair. Each checkpoint, its transformers reference and its conversion are made
once per session and shared by the tests that use them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_decode, jit_prefill
from hf_fixtures import (
    default_prompt,
    greedy_margins,
    hf_greedy_with_logits,
    hf_greedy_without_cache,
    hf_prefill_logits,
    make_tiny,
)

from prfaas_jax.cli import main
from prfaas_jax.config import ModelConfig
from prfaas_jax.model import init_state
from prfaas_jax.model.checkpoint import load_checkpoint
from prfaas_jax.model.hf import load_hf

NEW_TOKENS = 24
LOGIT_TOL = 1e-3  # max-abs on logits of std ≈ 6.5 (lm_head × 4 in the fixtures), float32


@dataclasses.dataclass(frozen=True)
class Case:
    """One tiny checkpoint of a family and how transformers runs it as the oracle (``case``)."""

    name: str  # the test id
    knobs: Mapping[str, Any]  # make_tiny's overrides of the family's fixture defaults
    prompt_len: int
    # False: the reference decodes greedily by one no-cache forward per token, for configurations
    # whose cached generation disagrees with transformers' own forward pass.
    hf_cache: bool


def case(
    name: str, *knob_groups: Mapping[str, Any], prompt_len: int = 20, hf_cache: bool = True
) -> Case:
    """A ``Case`` whose knobs come in groups, one line each: seed and layer pattern, attention,
    linear attention, MoE."""
    knobs: dict[str, Any] = {}
    for group in knob_groups:
        assert not knobs.keys() & group.keys(), (
            f"case {name!r} sets {knobs.keys() & group.keys()} twice"
        )
        knobs.update(group)
    return Case(name, knobs, prompt_len, hf_cache)


DEFAULT = case("default")  # a family's fixture defaults, which every test of the family runs


@dataclasses.dataclass(frozen=True)
class Reference:
    path: Path
    prompt: list[int]
    logits: np.ndarray  # [T, V]: transformers' forward over the prompt, no cache
    tokens: list[int]  # transformers' greedy continuation (cached unless the case says not)
    margin: float  # smallest top-1 − top-2 logit gap along that continuation


def reference(path: Path, case: Case, *, vocab_size: int = 160) -> Reference:
    """Run transformers on ``path`` as ``case`` says."""
    prompt = default_prompt(case.prompt_len, vocab_size=vocab_size, seed=1)
    greedy = hf_greedy_with_logits if case.hf_cache else hf_greedy_without_cache
    tokens, step_logits = greedy(path, prompt, NEW_TOKENS)
    return Reference(
        path=path,
        prompt=prompt,
        logits=hf_prefill_logits(path, prompt),
        tokens=tokens,
        margin=float(greedy_margins(step_logits).min()),
    )


def run_ours(params: dict, cfg: ModelConfig, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
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
_CONVERTED: dict[str, Path] = {}


class FamilyParity:
    """The parity tests of one family; ``test_<family>_parity.py`` subclasses it as a ``Test…``
    class."""

    pytestmark: ClassVar[list] = [pytest.mark.slow]  # transformers on CPU, and our compiles
    family: ClassVar[str]  # make_tiny's family name (transformers' model_type)
    cases: ClassVar[tuple[Case, ...]]  # beyond DEFAULT
    # How ``prfaas generate`` gets the weights: "--hf" the HF directory, "--checkpoint" or
    # "--model" the orbax checkpoint that ``convert-hf`` wrote.
    cli_weights: ClassVar[Literal["--hf", "--checkpoint", "--model"]] = "--hf"

    def check_config(self, cfg: ModelConfig, case: Case) -> None:
        """The family's own assertions on the config imported for ``case``."""
        raise NotImplementedError

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "case" in metafunc.fixturenames:
            cases = (DEFAULT, *self.cases)
            metafunc.parametrize("case", cases, ids=[c.name for c in cases])
        if "cli_weights" in metafunc.fixturenames:
            metafunc.parametrize("cli_weights", [self.cli_weights])

    def reference(self, case: Case, tmp_path_factory) -> Reference:
        """Case ``case``'s checkpoint and transformers' run on it, made once per session."""
        key = (self.family, case.name)
        if key not in _REFERENCES:
            directory = tmp_path_factory.mktemp(f"{self.family}-{case.name}")
            path = make_tiny(self.family, directory, **case.knobs)
            _REFERENCES[key] = reference(path, case)
        return _REFERENCES[key]

    def converted(self, capsys, tmp_path_factory) -> Path:
        """``prfaas convert-hf`` of the ``DEFAULT`` checkpoint, run once per session."""
        if self.family not in _CONVERTED:
            out = tmp_path_factory.mktemp(f"{self.family}-converted") / "ckpt"
            convert(capsys, self.reference(DEFAULT, tmp_path_factory), out)
            _CONVERTED[self.family] = out
        return _CONVERTED[self.family]

    def test_import_matches_transformers(self, case, tmp_path_factory):
        ref = self.reference(case, tmp_path_factory)
        cfg, params = load_hf(ref.path)
        assert_matches(*run_ours(params, cfg, ref.prompt), ref)
        self.check_config(cfg, case)

    def test_convert_hf_checkpoint_matches_transformers(self, capsys, tmp_path_factory):
        # The checkpoint equals the import and reproduces transformers through the library (the
        # compiled functions are the import's).
        ref = self.reference(DEFAULT, tmp_path_factory)
        cfg, params = load_checkpoint(self.converted(capsys, tmp_path_factory))
        cfg_hf, params_hf = load_hf(ref.path)
        assert cfg == cfg_hf
        assert_same_params(params, params_hf)
        assert_matches(*run_ours(params, cfg, ref.prompt), ref)

    def test_cli_generate_matches_transformers(
        self, cli_weights, capsys, tmp_path, tmp_path_factory
    ):
        ref = self.reference(DEFAULT, tmp_path_factory)
        hf = cli_weights == "--hf"
        weights = ref.path if hf else self.converted(capsys, tmp_path_factory)
        cli_generate(capsys, tmp_path, ref, cli_weights, str(weights))
