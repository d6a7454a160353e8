"""Hot-prefix replication (`[router] replicate_prefixes`, policy/routing.py) in process: two PD
prefill instances (pd-0, pd-2) with prefix caches and fake engines that take 4 ms per computed
token (a sleep: the machine's load barely moves it), one decode instance, t above every prompt.

A 400-token system prompt is prefilled once (on pd-0), then 32 requests that extend it by 20
tokens arrive at once. By own cache alone, pd-0 does 21 tokens of work per request against
pd-2's 421, so pd-0 takes every request until its queue outweighs recomputing the system prompt:
it serves nearly all of them, one after another. Replicating, pd-2 counts as holding the
prefix (it fetches it from pd-0 with its first request and keeps it), so the requests spread by
load. Checked, from one run of each: pd-0's share and its deepest queue drop to about half, the
P90 TTFT drops, every output is the fake engine's exact answer at the first attempt, and pd-2
reused the system prompt instead of recomputing it.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
from serving_support import fake_config, generate, serve_in_process

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
SYSTEM = [(11 * i + 5) % VOCAB for i in range(400)]
REQUESTS = 32


def serve(tmp_path, replicate: bool) -> dict:
    path = fake_config(
        tmp_path / f"cluster-{replicate}.toml",
        instances={"prfaas_prefill": 0, "pd_prefill": 2, "pd_decode": 1},
        prefix_cache={"enabled": True, "capacity_mib": 16.0, "block_size": 8},
        router={"threshold": 1000, "replicate_prefixes": replicate},
        engine={"max_len": 512, "max_slots": REQUESTS},
    )
    engines = {
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(CFG, seconds_per_token=0.004)),
        "pd-2": (Role.PD_PREFILL, FakePrefillEngine(CFG, seconds_per_token=0.004)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=REQUESTS, max_len=512)),
    }
    with serve_in_process(load_cluster_config(path), engines, prefix_caches=True) as cluster:
        assert generate(cluster.router, SYSTEM, 2).report.prefill_instance == "pd-0"
        hot = cluster.core.workers["pd-0"]
        deepest, stop = [0], threading.Event()

        def watch() -> None:  # the router's own count of pd-0's outstanding prefills
            while not stop.wait(0.002):
                deepest[0] = max(deepest[0], hot.outstanding_prefills)

        watcher = threading.Thread(target=watch)
        watcher.start()
        prompts = [SYSTEM + [(7 * r + i) % VOCAB for i in range(20)] for r in range(REQUESTS)]
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            replies = list(pool.map(lambda p: generate(cluster.router, p, 4), prompts))
        stop.set()
        watcher.join()
        pd2 = cluster.prefixes["pd-2"].reuse.stats
    for prompt, reply in zip(prompts, replies, strict=True):
        assert reply.tokens == fake_tokens(prompt, 4, VOCAB)
        assert reply.report.attempts == 1
    on_hot = sum(r.report.prefill_instance == "pd-0" for r in replies)
    ttft = [r.report.ttft_s for r in replies]
    return {
        "on_hot": on_hot,
        "deepest": deepest[0],
        "p90_ttft_s": float(np.quantile(ttft, 0.9)),
        "pd2_prompts": pd2.prompts,
        "pd2_reused": pd2.reused_tokens,
        # Where each instance's prefills found the system prompt (RequestReport.cache_tier).
        "tiers": {
            name: {r.report.cache_tier for r in replies if r.report.prefill_instance == name}
            for name in ("pd-0", "pd-2")
        },
    }


def test_a_hot_prefix_spreads_and_its_queue_and_p90_ttft_drop(tmp_path):
    alone, replicated = serve(tmp_path, replicate=False), serve(tmp_path, replicate=True)
    print("\nreplicate_prefixes  requests on pd-0  deepest pd-0 queue  P90 TTFT")
    for name, run in (("false", alone), ("true", replicated)):
        print(f"{name:>18}  {run['on_hot']:>16}  {run['deepest']:>18}  {run['p90_ttft_s']:.3f} s")
    # By own cache: pd-0 takes a request while its queue (21 tokens each) stays under pd-2's
    # 421-token recompute: about 20 in a row, and more as its queue drains.
    assert alone["on_hot"] >= 24 and alone["deepest"] >= 20
    # Replicating: spread by load, each side about half.
    assert replicated["on_hot"] <= 20 and replicated["deepest"] <= 20
    # pd-2 took the system prompt from pd-0 instead of computing it: 400 reused per prompt.
    assert replicated["pd2_prompts"] >= REQUESTS - 20
    assert replicated["pd2_reused"] == 400 * replicated["pd2_prompts"]
    # Fetched from pd-0 at first, then from pd-2's own copy of the import; pd-0 its own.
    assert pb.CACHE_TIER_PEER in replicated["tiers"]["pd-2"]
    assert replicated["tiers"]["pd-2"] <= {pb.CACHE_TIER_PEER, pb.CACHE_TIER_HOST}
    assert replicated["tiers"]["pd-0"] == {pb.CACHE_TIER_HOST}
    # Half the queue ahead of most requests: the P90 TTFT drops (by how much depends on the
    # machine's load, which adds to both runs; printed above).
    assert replicated["p90_ttft_s"] < alone["p90_ttft_s"]
