"""The serving decode worker over the paged decode engine (`[engine] allocator = "paged"`): a
cluster of real JAX engines (`tiny`, router and workers in this process) whose decode engine the
worker's `EngineFactory` built from the config, with a pool too small for every request at once.

Oracle: greedy generation by the model alone in one process (conftest's `greedy_generation`: one
padded `prefill` with the reference ops, then `decode_step`s; no engine, codec or pages).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from conftest import greedy_generation
from serving_support import fake_config, generate, serve_in_process

from prfaas_jax.engine.paged_decode import PagedDecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.weights import load_model
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config, serving_model_config
from prfaas_jax.serving.worker.engines import EngineFactory

MAX_LEN, NEW, PAGES = 64, 4, 10
LENGTHS = (5, 30, 50)


def test_paged_decode_worker_tokens_are_single_process_generation(tmp_path):
    sections = {
        "model": {"preset": "tiny", "engine": "jax"},
        "engine": {"max_len": MAX_LEN, "allocator": "paged", "block_size": 4, "num_pages": PAGES},
    }
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml", **sections))
    factory = EngineFactory(config)
    decode = factory.decode_engine()
    assert isinstance(decode, PagedDecodeEngine) and decode.pool.num_pages == PAGES
    # A row for each request the pool holds at its shortest: 3 KDA pages + 1 MLA page.
    assert factory.decode_rows == decode.max_slots == PAGES // 4
    # 20 tokens a page: 3 linear pages and 1–3 MLA pages a request, so the 10 pages never hold
    # every request at once and some wait for pages.
    assert sum(decode.pages_needed(n, NEW - 1) for n in LENGTHS) > PAGES
    cfg = serving_model_config(config)
    _, params = load_model("tiny", seed=0)
    prefill = PrefillEngine(cfg, params, chunk_len=32, buckets=(MAX_LEN,))
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, prefill),
        "pd-1": (Role.PD_DECODE, decode),
    }
    prompts = [np.random.default_rng(n).integers(0, cfg.vocab_size, n).tolist() for n in LENGTHS]
    with serve_in_process(config, engines) as cluster, ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: generate(cluster.router, p, NEW), prompts))
    assert [reply.tokens for reply in replies] == greedy_generation(
        params, cfg, prompts, NEW - 1, MAX_LEN
    )
    assert (decode.pool.used_pages, decode.pool.reserved) == (0, 0)
