"""`[link] precision`: a PrfaaS worker pushes the state it sends to decode in narrower encodings,
a PD prefill worker's push stays exact (router and real JAX engines of `tiny` in this process).

Oracles: the byte formula at each setting (`state_nbytes(cfg, L, precision)`), and generation in
this process through the codec with the same setting — prefill, encode, decode, then decode
steps on an engine of its own — or, for the exact route, with none.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import preset
from serving_support import fake_config, generate, serve_in_process

from prfaas_jax.engine import codec
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import GREEDY
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision

MAX_LEN, NEW = 128, 6
SETTING = "state=int8,latent=fp8_e4m3,conv=bf16"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg, params = preset("tiny")
    path = tmp_path_factory.mktemp("wire") / "cluster.toml"
    sections = {
        "model": {"preset": "tiny", "engine": "jax"},
        "engine": {"max_len": MAX_LEN},
        "link": {"precision": SETTING},
    }
    config = load_cluster_config(fake_config(path, **sections))
    prefill = PrefillEngine(cfg, params, chunk_len=16, buckets=(MAX_LEN,))
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, prefill),
        "pd-1": (Role.PD_DECODE, DecodeEngine(cfg, params, max_slots=2, max_len=MAX_LEN)),
    }
    alone = DecodeEngine(cfg, params, max_slots=1, max_len=MAX_LEN)
    with serve_in_process(config, engines) as cluster:
        yield cluster, cfg, prefill, alone


def through_the_codec(cfg, prefill, alone, prompt, setting) -> list[int]:
    result = prefill.prefill(prompt)
    frames = list(codec.encode(result.state, cfg, precision=setting))
    state = codec.decode(frames, cfg, max_len=MAX_LEN)
    slot = alone.insert(state, result.first_token, GREEDY, max_new_tokens=NEW - 1)
    tokens = [result.first_token]
    while not alone.is_finished(slot):
        tokens += [token for s, token in alone.step() if s == slot]
    alone.free(slot)
    return tokens


@pytest.mark.parametrize(
    ("length", "route", "setting"),
    [(90, "prfaas", WirePrecision.parse(SETTING)), (20, "pd", WIRE_NATIVE)],
)
def test_the_link_carries_the_configured_precision(served, length, route, setting):
    cluster, cfg, prefill, alone = served
    prompt = np.random.default_rng(length).integers(1, cfg.vocab_size, length).tolist()
    reply = generate(cluster.router, prompt, NEW)
    assert reply.report.route == route
    assert reply.report.state_bytes == state_nbytes(cfg, length, setting)
    assert reply.tokens == through_the_codec(cfg, prefill, alone, prompt, setting)
    if route == "prfaas":  # a quarter of the exact state, or less, crossed the link
        assert reply.report.state_bytes < 0.6 * state_nbytes(cfg, length)


def test_a_bad_precision_is_a_one_line_config_error(tmp_path):
    path = fake_config(tmp_path / "cluster.toml", link={"precision": "state=int4"})
    with pytest.raises(Exception, match=r"link\.precision: wire precision state='int4'"):
        load_cluster_config(path)
