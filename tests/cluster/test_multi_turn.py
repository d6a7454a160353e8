"""A multi-turn conversation through `prfaas serve` (real processes, the real `tiny`
KDA + MLA model) reuses nearly all of each previous turn, and the prefill tokens the workers
actually compute fall by ≥ 70 % against the same conversation with the cache disabled. From its
second turn each PrfaaS state crosses the link as an increment: the decode worker holds the
previous prompt's KV blocks, so the state's bytes are state_nbytes(L) less those positions'
MLA rows (hand-computed from the config) — and the replies are still those of the uncached run.

Each turn's prompt is the previous prompt + the previous reply + new tokens. The conversation
runs twice, `[prefix_cache] enabled = true` and `false`; the computed tokens are the prefill
workers' own count (`WorkerStats.prefix_cache.computed_tokens`), and the replies of both runs
must be identical (the cache changes no output). `python -m pytest -s` prints the table that
docs/serving.md quotes.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from serving_support import generate, toml

from prfaas_jax.config import load_model_config
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

FIRST, ADDED, REPLY, TURNS = 120, 24, 8, 6


def serve_config(path, enabled: bool):
    path.write_text(
        toml(
            {
                "model": {"preset": "tiny"},
                "engine": {"max_len": 512, "chunk_len": 128, "buckets": [32, 128]},
                "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1},
                # A fixed t and cache rule: both runs route alike, every turn to PrfaaS.
                "router": {"threshold": 64, "cache_rule": "scarce"},
                "controller": {"enabled": False},
                "prefix_cache": {"enabled": enabled, "block_size": 16, "checkpoint_every": 4},
            }
        )
    )
    return path


def converse(tmp_path, enabled: bool, cache_home) -> tuple[list[dict], int]:
    """Run the conversation on a fresh `prfaas serve`; per-turn records and computed tokens.

    The workers compile through the session's cache (tests/conftest.py): the second run loads
    what the first one compiled."""
    root = tmp_path / ("cached" if enabled else "uncached")
    root.mkdir()
    ready_file = root / "ready.json"
    command = [sys.executable, "-m", "prfaas_jax.cli", "serve"]
    command += ["--config", str(serve_config(root / "cluster.toml", enabled))]
    command += ["--ready-file", str(ready_file), "--log-dir", str(root / "logs")]
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 600
        while not ready_file.exists():
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no ready file after 600 s"
            time.sleep(0.2)
        ready = json.loads(ready_file.read_text())
        rng = np.random.default_rng(8)
        prompt, turns = rng.integers(0, 256, FIRST).tolist(), []
        with grpc.insecure_channel(ready["router"]) as channel:
            router = pb_grpc.RouterStub(channel)
            for _ in range(TURNS):
                reply = generate(router, prompt, REPLY)
                r = reply.report
                turns.append(
                    {
                        "prompt_len": r.prompt_len,
                        "cached_len": r.cached_len,
                        "route": r.route,
                        "instance": r.prefill_instance,
                        "ttft_s": r.ttft_s,
                        "reply": reply.tokens,
                        "state_bytes": r.state_bytes,
                        "decode_cached_len": r.decode_cached_len,
                        "saved_bytes": r.saved_bytes,
                    }
                )
                prompt = prompt + reply.tokens + rng.integers(0, 256, ADDED).tolist()
        computed = 0
        for worker in ready["workers"].values():
            with grpc.insecure_channel(worker["address"]) as channel:
                stats = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest())
                computed += stats.prefix_cache.computed_tokens
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return turns, computed


@pytest.mark.slow
def test_multi_turn_conversation_reuses_each_previous_turn(tmp_path, child_cache_home):
    cached_turns, cached_computed = converse(tmp_path, enabled=True, cache_home=child_cache_home)
    plain_turns, plain_computed = converse(tmp_path, enabled=False, cache_home=child_cache_home)

    print(
        f"\n{'turn':>4} {'prompt':>6} {'cached':>6} {'of prev':>7} {'route':>6} "
        f"{'TTFT ms (cache on / off)':>25} {'state bytes shipped (on / off)':>31}"
    )
    for i, (on, off) in enumerate(zip(cached_turns, plain_turns, strict=True)):
        previous = cached_turns[i - 1]["prompt_len"] if i else 0
        share = f"{on['cached_len'] / previous:.0%}" if previous else "-"
        print(
            f"{i + 1:>4} {on['prompt_len']:>6} {on['cached_len']:>6} {share:>7} "
            f"{on['route']:>6} {on['ttft_s'] * 1e3:>12.0f} / {off['ttft_s'] * 1e3:<11.0f}"
            f"{on['state_bytes']:>16} / {off['state_bytes']}"
        )
    prompt_tokens = sum(t["prompt_len"] for t in cached_turns)
    reduction = 1 - cached_computed / plain_computed
    print(
        f"prefill tokens computed: cache on {cached_computed}, off {plain_computed} "
        f"(of {prompt_tokens} prompt tokens): {reduction:.1%} fewer"
    )

    assert [t["reply"] for t in cached_turns] == [t["reply"] for t in plain_turns]
    assert plain_computed == prompt_tokens and all(t["cached_len"] == 0 for t in plain_turns)
    for previous, turn in itertools.pairwise(cached_turns):
        assert turn["cached_len"] >= 0.8 * previous["prompt_len"], turn
    assert cached_computed == prompt_tokens - sum(t["cached_len"] for t in cached_turns)
    assert reduction >= 0.70
    # Increments: from turn 2 the decode worker holds the previous prompt's 16-token blocks.
    cfg = load_model_config("tiny")
    row = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * {"float32": 4, "bfloat16": 2}[
        cfg.dtype
    ]
    previous = 0
    for on, off in zip(cached_turns, plain_turns, strict=True):
        held = previous // 16 * 16
        assert on["route"] == off["route"] == "prfaas"
        assert (on["decode_cached_len"], off["decode_cached_len"]) == (held, 0)
        assert off["state_bytes"] == state_nbytes(cfg, on["prompt_len"])
        assert (
            on["state_bytes"]
            == off["state_bytes"] - held * row
            == off["state_bytes"] - (on["saved_bytes"])
        )
        previous = on["prompt_len"]
