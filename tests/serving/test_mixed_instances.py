"""A PD cluster of mixed instances (`[instances] pd_mode = "mixed"`): each PD instance prefills
the short prompts routed to it in its own decode steps and decodes them without a state push,
while PrfaaS states still come by push. Router and workers in this process.

Oracles: the fake engines' hand-computable tokens (`fake_tokens`), and each prompt alone through
the disaggregated engines in this process (`PrefillEngine.prefill`, then a `DecodeEngine` slot of
its own), whose tokens tests/engine/test_engines.py holds to the model's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import preset
from serving_support import fake_config, generate, serve_in_process

from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.fake_mixed import FakeMixedStep
from prfaas_jax.engine.generate import decode_alone
from prfaas_jax.engine.mixed_step import MixedStep
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.errors import ConfigError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config, serving_model_config

MIXED = {"prfaas_prefill": 1, "pd_prefill": 0, "pd_decode": 2, "pd_mode": "mixed"}


def _serve_all(cluster, prompts: list[list[int]], new: int) -> list:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(cluster.router, p, new), prompts))


def test_mixed_instances_prefill_local_prompts_and_take_prfaas_pushes(tmp_path):
    config = load_cluster_config(fake_config(tmp_path / "c.toml", instances=MIXED))
    cfg = serving_model_config(config)
    engines = {"prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(cfg))}
    for name in ("pd-0", "pd-1"):
        decode = FakeDecodeEngine(cfg, max_slots=4, max_len=512, step_s=0.002)
        engines[name] = (Role.PD_DECODE, FakeMixedStep(FakePrefillEngine(cfg), decode))
    rng = np.random.default_rng(5)
    lengths = [5, 20, 40, 63, 100, 200, 7, 150]  # t = 64: the short ones stay in the PD cluster
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    with serve_in_process(config, engines) as cluster:
        replies = _serve_all(cluster, prompts, 6)
        local = sum(service.local_prefills for service in cluster.decode.values())
    for prompt, reply in zip(prompts, replies, strict=True):
        assert reply.tokens == fake_tokens(prompt, 6, cfg.vocab_size)
        report = reply.report
        if len(prompt) <= 64:  # prefilled where it decodes, nothing pushed
            assert report.route == "pd" and report.prefill_instance == report.decode_instance
            assert report.state_bytes == 0
        else:  # pushed from the PrfaaS instance to a mixed one, as to any decode instance
            assert report.route == "prfaas" and report.prefill_instance == "prfaas-0"
            assert report.decode_instance.startswith("pd-") and report.state_bytes > 0
    assert local == sum(n <= 64 for n in lengths)


def test_mixed_mode_config_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="pd_prefill"):
        load_cluster_config(fake_config(tmp_path / "a.toml", instances={**MIXED, "pd_prefill": 1}))
    with pytest.raises(ConfigError, match="pd_mode"):
        paged = fake_config(tmp_path / "b.toml", instances=MIXED, engine={"allocator": "paged"})
        load_cluster_config(paged)
    plain = load_cluster_config(fake_config(tmp_path / "c.toml"))
    assert not plain.instances.mixed  # disaggregated by default


def test_mixed_instance_tokens_are_single_process_generation(tmp_path):
    max_len, new = 64, 5
    sections = {
        "model": {"preset": "tiny", "engine": "jax"},
        "engine": {"max_len": max_len, "max_slots": 2, "chunk_len": 16},
        "instances": {**MIXED, "pd_decode": 1},
        "router": {"threshold": 24},
    }
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml", **sections))
    cfg = serving_model_config(config)
    _, params = preset("tiny")  # the session's seed-0 weights: the config's seed 0
    prefill = PrefillEngine(cfg, params, chunk_len=16, buckets=(16, max_len))
    # One block size (16) keeps the compiles few; the blocks a time budget picks are
    # tests/engine/test_chunk_budget.py's, their tokens tests/engine/test_mixed_step.py's.
    mixer = MixedStep(
        prefill, DecodeEngine(cfg, params, max_slots=2, max_len=max_len), min_tokens=16
    )
    mixer.warm()  # as a worker does before it serves
    engines = {"prfaas-0": (Role.PRFAAS_PREFILL, prefill), "pd-0": (Role.PD_DECODE, mixer)}
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (6, 23, 40, 17)]
    with serve_in_process(config, engines, state_timeout_s=120) as cluster:
        replies = _serve_all(cluster, prompts, new)
        assert cluster.decode["pd-0"].local_prefills == 3
    assert [r.report.route for r in replies] == ["pd", "pd", "prfaas", "pd"]
    alone = DecodeEngine(cfg, params, max_slots=2, max_len=max_len)  # one slot used
    for prompt, reply in zip(prompts, replies, strict=True):
        first = prefill.prefill(prompt, max_len=max_len)
        slot = alone.insert(first.state, first.first_token, max_new_tokens=new - 1)
        assert reply.tokens == [first.first_token, *decode_alone(alone, slot)]
