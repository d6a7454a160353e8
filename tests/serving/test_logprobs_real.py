"""Log-probabilities and seeded sampling through the OpenAI front door over a cluster of real JAX
engines (`tiny`, router and workers in this process, both routes), read by the `openai` SDK.

Oracles, computed here in one process: the model's full prefill logits (`prompt_logits`, one
`prefill` over the whole sequence, no padding, no cache) as a float64 log-softmax, for the
prompt's positions (``echo``) and for the generated ones; and `generate` (a prefill engine, then a
one-slot decode engine: what `prfaas generate` runs) with the same seed and knobs.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from conftest import preset
from serving_support import fake_config, generate, serve_in_process

from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.generate import generate as generate_alone
from prfaas_jax.engine.generate import prompt_logits
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.frontdoor.app import FrontDoor, FrontDoorServer

MAX_LEN, NEW = 128, 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg, params = preset("tiny")
    cfg = cfg.with_max_len(MAX_LEN)  # as a worker's engines take the cluster's limit
    path = tmp_path_factory.mktemp("lp-real") / "cluster.toml"
    sections = {"model": {"preset": "tiny", "engine": "jax"}, "engine": {"max_len": MAX_LEN}}
    config = load_cluster_config(fake_config(path, **sections))
    prefill = PrefillEngine(cfg, params, chunk_len=32, buckets=(32, MAX_LEN))
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, prefill),
        "pd-1": (Role.PD_DECODE, DecodeEngine(cfg, params, max_slots=2, max_len=MAX_LEN)),
    }
    with serve_in_process(config, engines) as cluster:
        door = FrontDoor(
            cluster.servers["router"].address,
            model="tiny",
            vocab_size=cfg.vocab_size,
            max_len=MAX_LEN,
        )
        with FrontDoorServer(door) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
            yield client, cluster.router, cfg, params


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


# PD, PrfaaS, and a prompt that fills the context: its one new token is scored, never read.
@pytest.mark.parametrize(("length", "new"), [(20, NEW), (90, NEW), (MAX_LEN, 1)])
def test_echo_logprobs_are_the_single_process_prefills(served, length, new):
    client, router, cfg, params = served
    prompt = np.random.default_rng(length).integers(0, cfg.vocab_size, length).tolist()
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=new, temperature=0, logprobs=5, echo=True
    )
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == length + new and lp.token_logprobs[0] is None
    tokens = generate(router, prompt, new).tokens  # the same greedy request, as ids
    reference = log_softmax64(prompt_logits(params, cfg, prompt + tokens[:-1]))
    assert tokens == reference[length - 1 :].argmax(axis=-1).tolist()
    chosen = reference[np.arange(length + new - 1), (prompt + tokens)[1:]]
    # The prompt's from the prefill, the new tokens' from prefill (the first) and decode.
    np.testing.assert_allclose(lp.token_logprobs[1:], chosen, atol=1e-4)
    for row, top in zip(reference, lp.top_logprobs[1:], strict=True):
        # Distinct bytes may share a string (U+FFFD): the likeliest value of each is kept.
        assert max(top.values()) == pytest.approx(row.max(), abs=1e-4)
        assert len(top) <= 5


def test_a_seeded_sampled_reply_is_one_process_generation(served):
    client, router, cfg, params = served
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    knobs = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}
    for length in (20, 90):
        prompt = np.random.default_rng(7 + length).integers(0, cfg.vocab_size, length).tolist()
        tokens = generate_alone(params, cfg, prompt, 12, sampling)[0]
        assert generate(router, prompt, 12, **knobs).tokens == tokens
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **knobs)
        assert reply.choices[0].text == ByteTokenizer().decode(tokens)
