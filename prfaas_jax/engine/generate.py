"""Single-request generation on a preset with seeded random weights (``prfaas generate``).

Prefill the prompt in one call, then decode one token per step; both steps are jitted once per
(config, prompt length). Returns every generated token, the first one (from prefill) included.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.engine.sampling import SamplingParams, sample
from prfaas_jax.engine.tokenizer import ByteTokenizer, check_byte_vocab
from prfaas_jax.errors import UserError
from prfaas_jax.model import decode_step, init_params, init_state, prefill
from prfaas_jax.ops.dispatch import Impl


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


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    model: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str | None
    prefill_seconds: float
    decode_seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def to_table(self) -> str:
        rows = [
            ("model", self.model),
            ("prompt tokens", str(len(self.prompt_ids))),
            ("new tokens", ",".join(map(str, self.tokens))),
            ("prefill (s, incl. compile)", f"{self.prefill_seconds:.3f}"),
            ("decode (s, incl. compile)", f"{self.decode_seconds:.3f}"),
        ]
        if self.text is not None:
            rows.append(("text", repr(self.text)))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _prompt_ids(request: GenerateRequest, cfg: ModelConfig) -> list[int]:
    if request.prompt_text is not None:
        check_byte_vocab(cfg.vocab_size)
        ids = ByteTokenizer().encode(request.prompt_text)
    elif request.prompt_ids is not None:
        ids = list(request.prompt_ids)
    else:
        ids = ByteTokenizer().encode("Prefill as a service")[: cfg.vocab_size]
    if not ids:
        raise UserError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"token id(s) {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    return ids


def generate(
    params: dict,
    cfg: ModelConfig,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    *,
    impl: Impl = Impl.CHUNK,
) -> tuple[list[int], float, float]:
    """Generate ``max_new_tokens``; returns ``(tokens, prefill_seconds, decode_seconds)``."""
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_len:
        raise UserError(
            f"prompt ({len(prompt_ids)}) + new tokens ({max_new_tokens}) exceed the model's "
            f"max_len {cfg.max_len}"
        )
    prefill_fn = jax.jit(prefill, static_argnames=("cfg", "impl"))
    decode_fn = jax.jit(decode_step, static_argnames=("cfg", "impl"))
    knobs = (
        jnp.array([sampling.temperature], jnp.float32),
        jnp.array([sampling.top_k], jnp.int32),
        jnp.array([sampling.top_p], jnp.float32),
    )
    key = jax.random.PRNGKey(sampling.seed)
    start = time.perf_counter()
    state = init_state(cfg, 1, total)
    logits, state = prefill_fn(params, cfg, jnp.asarray([prompt_ids], jnp.int32), state, impl=impl)
    key, sub = jax.random.split(key)
    token = sample(logits[:, -1], sub[None], *knobs)
    tokens = [int(token[0])]
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        logits, state = decode_fn(params, cfg, token, state)
        key, sub = jax.random.split(key)
        token = sample(logits, sub[None], *knobs)
        tokens.append(int(token[0]))
    return tokens, prefill_seconds, time.perf_counter() - start


def generate_from_preset(request: GenerateRequest) -> GenerateResult:
    cfg = load_model_config(request.model)
    sampling = SamplingParams(
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        seed=request.sample_seed,
    )
    prompt = _prompt_ids(request, cfg)
    params = init_params(jax.random.PRNGKey(request.seed), cfg)
    tokens, prefill_s, decode_s = generate(
        params, cfg, prompt, request.max_new_tokens, sampling, impl=Impl(request.impl)
    )
    text = ByteTokenizer().decode(tokens) if request.prompt_text is not None else None
    return GenerateResult(
        model=cfg.name,
        prompt_ids=prompt,
        tokens=tokens,
        text=text,
        prefill_seconds=prefill_s,
        decode_seconds=decode_s,
    )
