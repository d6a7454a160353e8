"""What `prfaas generate` runs: `GenerateRequest` → `generate_from_preset` → `GenerateResult`.

Weights come from a preset and a seed, or — ``--hf DIR`` / ``--checkpoint DIR`` — from a Hugging
Face or orbax checkpoint (model/weights.py); the prompt from ``--prompt-ids``, ``--prompt`` (text,
through the checkpoint's own tokenizer where its directory has a ``tokenizer.json``, else the
byte-level one: engine/tokenizer.py), a file of either (cli/prompt_input.py) or a default
text. The tokens come from engine/generate.py's `generate` (prefill engine, then a one-slot
decode engine); ``--dump-logits`` saves `prompt_logits`. `prompt_ids` and `sampling_params` also
serve `prfaas prefill` (cli/state_files.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from prfaas_jax.cli.prompt_input import prompt_digest
from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.generate import generate, prompt_logits
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.engine.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from prfaas_jax.errors import ConfigError, UserError
from prfaas_jax.model.sharding import make_mesh
from prfaas_jax.model.weights import load_model
from prfaas_jax.ops.dispatch import Impl
from prfaas_jax.tables import key_value

DEFAULT_PROMPT = "Prefill as a service"


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    model: str = "tiny"
    seed: int = 0
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    sample_seed: int = 0
    impl: str = "chunk"
    hf_dir: str | None = None  # weights from a Hugging Face checkpoint instead of model/seed
    checkpoint: str | None = None  # weights from an orbax checkpoint (prfaas convert-hf)
    dump_logits: str | None = None  # .npy file for the prompt's logits [T, vocab] float32
    mesh: str | None = None  # device mesh spec, e.g. "tensor=4,expert=2" (model/sharding.py)
    max_len: int | None = None  # in place of the model's max_len (--max-len)


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    model: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    prefill_seconds: float
    decode_seconds: float

    def to_json(self, *, include_prompt: bool = False) -> dict:
        """The result as JSON: the prompt by its length and `prompt_digest` (a 128K-token
        prompt would otherwise be most of the output), its ids too with ``include_prompt``."""
        payload = dataclasses.asdict(self)
        ids = payload.pop("prompt_ids")
        prompt = {"prompt_len": len(ids), "prompt_sha256": prompt_digest(ids)}
        if include_prompt:
            prompt["prompt_ids"] = ids
        return {"model": payload.pop("model"), **prompt, **payload}

    def to_table(self) -> str:
        rows = [
            ("model", self.model),
            ("prompt tokens", len(self.prompt_ids)),
            ("prompt sha256", prompt_digest(self.prompt_ids)[:16]),
            ("new tokens", ",".join(map(str, self.tokens))),
            ("prefill (s, incl. compile)", f"{self.prefill_seconds:.3f}"),
            ("decode (s, incl. compile)", f"{self.decode_seconds:.3f}"),
        ]
        if self.text is not None:
            rows.append(("text", repr(self.text)))
        return key_value(rows)


def text_tokenizer(request: GenerateRequest, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of the request's model: its checkpoint directory's, else byte-level."""
    return load_tokenizer(request.hf_dir or request.checkpoint or request.model, cfg.vocab_size)


def prompt_ids(request: GenerateRequest, cfg: ModelConfig) -> list[int]:
    """The request's prompt as token ids, each checked against ``cfg``'s vocabulary."""
    if request.prompt_text is not None:
        ids = text_tokenizer(request, cfg).encode(request.prompt_text)
    elif request.prompt_ids is not None:
        ids = list(request.prompt_ids)
    else:
        ids = ByteTokenizer().encode(DEFAULT_PROMPT)[: cfg.vocab_size]
    if not ids:
        raise UserError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"token id(s) {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    return ids


def with_max_len(cfg: ModelConfig, max_len: int | None) -> ModelConfig:
    """``cfg`` holding up to ``max_len`` tokens (unchanged for None), as a cluster's
    ``[engine] max_len`` does (`ModelConfig.with_max_len`: a fixed limit is never lifted)."""
    if max_len is None:
        return cfg
    if max_len < 1:
        raise UserError(f"--max-len must be at least 1, got {max_len}")
    try:
        return cfg.with_max_len(max_len)
    except ConfigError as err:
        raise UserError(f"--max-len: {err}") from None


def sampling_params(request: GenerateRequest) -> SamplingParams:
    return SamplingParams(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.sample_seed,
    )


def _dump_logits(path: str, logits: np.ndarray) -> None:
    try:
        np.save(path, logits)
    except OSError as err:
        raise UserError(f"cannot write logits to {path}: {err.strerror or err}") from None


def generate_from_preset(request: GenerateRequest) -> GenerateResult:
    """``prfaas generate``: weights from a preset + seed, an HF checkpoint or an orbax one."""
    cfg, params = load_model(
        request.model, seed=request.seed, hf_dir=request.hf_dir, checkpoint=request.checkpoint
    )
    cfg = with_max_len(cfg, request.max_len)
    sampling = sampling_params(request)
    prompt = prompt_ids(request, cfg)
    mesh = make_mesh(request.mesh) if request.mesh else None
    impl = Impl(request.impl)
    tokens, prefill_s, decode_s = generate(
        params, cfg, prompt, request.max_new_tokens, sampling, impl=impl, mesh=mesh
    )
    if request.dump_logits is not None:
        _dump_logits(request.dump_logits, prompt_logits(params, cfg, prompt, impl=impl))
    text = None
    if request.prompt_text is not None:
        text = text_tokenizer(request, cfg).decode(tokens)
    return GenerateResult(
        model=cfg.name,
        prompt_ids=prompt,
        tokens=tokens,
        text=text,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
    )
