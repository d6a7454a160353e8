"""Prompts past a preset's own limit through the cluster, in process over fake engines
(serving_support.serve_in_process: the router and its workers built from the config as
`prfaas serve` builds them).

- One limit. `[engine] max_len` = 32,784 lifts `tiny`'s 4096 for every process: the model the
  router, a worker's engines and the front door serve holds it, the router's stats (what
  `prfaas bench` and `prfaas openai` read) report it, and a 20,000-token prompt goes through the
  router, the front door and `prfaas bench` alike, while one past it is refused by each.
- Both routes. Prompts of 8K, 16K and 32K tokens, once with t = 1024 (PrfaaS, over a shaped
  link) and once with t = max_len (PD): the tokens the fake model makes by hand
  (`fake_tokens`), the state bytes the byte formula gives (`state_nbytes`), one attempt each,
  and on PrfaaS every byte of the state on the link.
- Past the limit. A prompt whose budget does not fit is refused by the router at once
  (INVALID_ARGUMENT), before any attempt: no engine sees it.
- The JAX engines (slow): a worker's `EngineFactory` for `tiny` with `[engine] max_len` = 4608
  prefills 4300- and 4150-token prompts, past the preset's 4096, on PrfaaS and on PD; the tokens
  equal `prfaas generate --max-len 4608` (`generate_from_preset`), the single-process oracle.

The 2-turn conversation at these lengths (prefix cache and increments, which need the decode
worker's KV cache of a worker process) is in tests/cluster/test_long_prompts.py; a worker that
refuses a prompt the router accepted, in tests/serving/test_router_gives_up.py.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Sequence

import grpc
import numpy as np
import pytest
from serving_support import fake_config, generate, serve_in_process

from prfaas_jax.cli.generation import GenerateRequest, generate_from_preset
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, FakePrefillResult
from prfaas_jax.engine.fake import fake_tokens as expected
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config, serving_model_config
from prfaas_jax.serving.frontdoor.app import cluster_front_door
from prfaas_jax.serving.loadgen.bench import BenchOptions, InputDist, run_bench
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.transport.link import LinkProfile, LinkShaper
from prfaas_jax.serving.worker.engines import EngineFactory
from prfaas_jax.state_bytes import state_nbytes

NEW = 16
LIMIT = 32768 + NEW  # a 32K prompt and its 16 tokens: 32768 + 16 − 1 positions
LENGTHS = (8192, 16384, 32768)
PRESET_LIMIT = load_model_config("tiny").max_len
LINK_BYTES_PER_S = 50e6


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


class CountingPrefill(FakePrefillEngine):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.lengths: list[int] = []

    def prefill(self, tokens: Sequence[int], **options: object) -> FakePrefillResult:
        self.lengths.append(len(tokens))
        return super().prefill(tokens, **options)


def cluster_config(tmp_path, threshold: float):
    path = fake_config(
        tmp_path / "cluster.toml",
        engine={"max_len": LIMIT},
        router={"threshold": threshold},
    )
    return load_cluster_config(path)


def instances(cfg):
    return {
        "prfaas-0": (Role.PRFAAS_PREFILL, CountingPrefill(cfg)),
        "pd-0": (Role.PD_PREFILL, CountingPrefill(cfg)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(cfg, max_slots=4, max_len=LIMIT)),
    }


def completion(base_url: str, model: str, ids: list[int], max_tokens: int) -> tuple[int, dict]:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{base_url}/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_every_process_reads_the_one_limit(tmp_path):
    config = cluster_config(tmp_path, threshold=1024)
    cfg = serving_model_config(config)
    assert PRESET_LIMIT == 4096 < LIMIT == config.engine.max_len == cfg.max_len
    # A worker's engines: built from the same model, never cut to the preset's limit.
    factory = EngineFactory(config)
    assert factory.cfg == cfg
    assert factory.decode_engine().max_len == LIMIT
    long = prompt(20000, 1)
    assert len(factory.prefill_engine().prefill(long, max_len=LIMIT).state.layers) == 4
    with serve_in_process(config, instances(cfg)) as cluster:
        assert cluster.core.cfg.max_len == LIMIT
        assert cluster.stats().max_len == LIMIT  # what `prfaas bench` and `prfaas openai` read
        reply = generate(cluster.router, long, 4)
        assert reply.tokens == expected(long, 4, cfg.vocab_size)
        assert reply.report.route == "prfaas"

        router = cluster.servers["router"].address
        with cluster_front_door(config, router) as door:
            status, body = completion(door.base_url, config.model.preset, long, 4)
            assert status == 200, body
            assert body["usage"] == {
                "prompt_tokens": 20000,
                "completion_tokens": 4,
                "total_tokens": 20004,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            status, body = completion(door.base_url, config.model.preset, [1] * LIMIT, 2)
            assert status == 400 and f"the context of {LIMIT} tokens" in body["error"]["message"]

        # `prfaas bench` sizes its prompts from the router's stats: 20,000 tokens go through,
        # and a length past the limit is cut to what fits, never sent to be refused.
        for length, sent in ((20000, 20000), (10 * LIMIT, LIMIT - NEW + 1)):
            options = BenchOptions(
                router=router,
                num_prompts=1,
                input_dist=InputDist.FIXED,
                input_len=length,
                output_len=NEW,
            )
            records, _ = run_bench(options)
            assert [(r.prompt_len, r.error, r.output_tokens) for r in records] == [
                (sent, None, NEW)
            ]


@pytest.mark.parametrize(
    ("threshold", "route"), [(1024, "prfaas"), (LIMIT, "pd")], ids=["prfaas", "pd"]
)
def test_long_prompts_through_both_routes(tmp_path, threshold, route):
    config = cluster_config(tmp_path, threshold)
    cfg = serving_model_config(config)
    engines = instances(cfg)
    shaper = LinkShaper(LinkProfile(bandwidth_bytes_per_s=LINK_BYTES_PER_S, latency_s=0.005))
    with serve_in_process(config, engines, shapers={"prfaas-0": shaper}) as cluster:
        for i, length in enumerate(LENGTHS):
            ids = prompt(length, i)
            sent = shaper.sent_bytes
            reply = generate(cluster.router, ids, NEW)
            report = reply.report
            assert reply.tokens == expected(ids, NEW, cfg.vocab_size)
            assert (report.route, report.attempts, report.prompt_len) == (route, 1, length)
            assert report.state_bytes == state_nbytes(cfg, length)
            on_link = shaper.sent_bytes - sent
            if route == "prfaas":
                # The whole state crossed the shaped link, with its frames' headers.
                assert report.state_bytes < on_link < report.state_bytes * 1.01
            else:
                assert on_link == 0
    prefilled = "prfaas-0" if route == "prfaas" else "pd-0"
    assert engines[prefilled][1].lengths == list(LENGTHS)


def test_a_prompt_past_the_limit_is_refused_before_any_attempt(tmp_path):
    config = cluster_config(tmp_path, threshold=1024)
    cfg = serving_model_config(config)
    engines = instances(cfg)
    with serve_in_process(config, engines) as cluster:
        for length, budget in ((LIMIT, 2), (LIMIT - NEW + 2, NEW), (LIMIT + 1, 1)):
            request = pb.GenerateRequest(prompt_token_ids=[1] * length, max_new_tokens=budget)
            with pytest.raises(grpc.RpcError) as err:
                list(cluster.router.Generate(request, timeout=30))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"exceed the cluster's max_len {LIMIT}" in err.value.details()
        # The longest request that fits goes through.
        ids = prompt(LIMIT - NEW + 1, 3)
        assert generate(cluster.router, ids, NEW).tokens == expected(ids, NEW, cfg.vocab_size)
        stats = cluster.stats()
    assert [engine.lengths for role, engine in engines.values() if role.is_prefill] == [
        [LIMIT - NEW + 1],
        [],
    ]
    assert (stats.retries, stats.requests_failed) == (0, 0)


@pytest.mark.slow
def test_the_jax_engines_serve_past_the_presets_limit(tmp_path):
    """What the limit cut before: each worker's `PrefillEngine` held the preset's 4096 tokens
    whatever `[engine] max_len` said, and every attempt failed."""
    limit, threshold, new = 4608, 4200, 6
    path = fake_config(
        tmp_path / "cluster.toml",
        model={"engine": "jax"},
        # One row per prefill call: these prompts are too long to share one, so no batched
        # shapes are warmed up.
        engine={
            "max_len": limit,
            "chunk_len": 512,
            "buckets": [32, 512],
            "max_slots": 2,
            "prefill_batch_rows": 1,
        },
        router={"threshold": threshold},
    )
    config = load_cluster_config(path)
    factory = EngineFactory(config)
    prefill, decode = factory.prefill_engine(), factory.decode_engine()  # built and warmed
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, prefill),
        "pd-1": (Role.PD_DECODE, decode),
    }
    with serve_in_process(config, engines) as cluster:
        for length, route in ((4300, "prfaas"), (4150, "pd")):
            assert length > PRESET_LIMIT and (length > threshold) == (route == "prfaas")
            ids = prompt(length, length)
            reply = generate(cluster.router, ids, new)
            alone = generate_from_preset(
                GenerateRequest(model="tiny", prompt_ids=ids, max_new_tokens=new, max_len=limit)
            )
            assert reply.tokens == alone.tokens
            assert (reply.report.route, reply.report.attempts) == (route, 1)
            assert reply.report.state_bytes == state_nbytes(factory.cfg, length)
