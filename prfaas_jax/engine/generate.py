"""Single-request generation on one process: `generate` and `prompt_logits`.

`generate` runs the prompt through a `PrefillEngine` and the rest through a one-slot
`DecodeEngine` (`decode_alone`); it returns every generated token, the first one (from prefill)
included, and the seconds each half took. Both engines take one bucketed capacity, so the
decode engine takes the prefill state without a copy. `prompt_logits` gives the prompt's full
prefill logits ``[T, vocab]`` float32 from one call, to compare against another implementation.
The commands built on them (`prfaas generate`, `prefill`, `decode`) are in cli/.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.config import ModelConfig
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.errors import UserError
from prfaas_jax.model import init_state, prefill
from prfaas_jax.ops.dispatch import Impl


def decode_alone(engine: DecodeEngine, slot: int) -> list[int]:
    """Step a one-request engine until ``slot`` finishes; its tokens."""
    tokens = []
    while not engine.is_finished(slot):
        tokens.extend(token for _, token in engine.step())
    engine.free(slot)
    return tokens


def generate(
    params: dict,
    cfg: ModelConfig,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingParams,
    *,
    impl: Impl = Impl.CHUNK,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[list[int], float, float]:
    """Generate ``max_new_tokens``; returns ``(tokens, prefill_seconds, decode_seconds)``.

    With ``mesh`` both engines run sharded on it (model/sharding.py); the tokens are the same.
    """
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_len:
        raise UserError(
            f"prompt ({len(prompt_ids)}) + new tokens ({max_new_tokens}) exceed the model's "
            f"max_len {cfg.max_len}"
        )
    start = time.perf_counter()
    prefill_engine = PrefillEngine(cfg, params, impl=impl, mesh=mesh)
    # One bucketed capacity for both engines: the decode engine takes the state without a copy,
    # and requests whose total falls in the same bucket share every compiled program.
    max_len = prefill_engine.bucket(total)
    prefilled = prefill_engine.prefill(prompt_ids, sampling=sampling, max_len=max_len)
    prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    tokens = [prefilled.first_token]
    if max_new_tokens > 1:
        engine = DecodeEngine(cfg, params, max_slots=1, max_len=max_len, impl=impl, mesh=mesh)
        slot = engine.insert(
            prefilled.state, prefilled.first_token, sampling, max_new_tokens=max_new_tokens - 1
        )
        tokens += decode_alone(engine, slot)
    return tokens, prefill_seconds, time.perf_counter() - start


_prompt_prefill = jax.jit(prefill, static_argnames=("cfg", "impl"))


def prompt_logits(
    params: dict, cfg: ModelConfig, prompt_ids: list[int], *, impl: Impl = Impl.CHUNK
) -> np.ndarray:
    """Logits ``[T, vocab]`` float32 of one prefill over the whole prompt (``--dump-logits``)."""
    state = init_state(cfg, 1, len(prompt_ids))
    logits, _ = _prompt_prefill(params, cfg, jnp.asarray([prompt_ids], jnp.int32), state, impl=impl)
    return np.asarray(logits[0], np.float32)
