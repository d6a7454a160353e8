"""A multi-turn conversation through `prfaas serve` (real processes, the real `tiny` KDA + MLA
model), held with `prfaas chat` as a user would: each turn reuses nearly all of the previous
one, so the prefill tokens the workers actually compute fall by ≥ 70 % against the prompt
tokens. From its second turn each PrfaaS state crosses the link as an increment: the decode
worker holds the previous prompt's KV blocks, so the state's bytes are state_nbytes(L) less
those positions' MLA rows (hand-computed from the config). Every reply is the model's greedy
continuation of its turn's prompt (one teacher-forced reference pass here, in this process).

Each turn's prompt is the previous prompt + the previous reply + new tokens (`chat --ids` keeps
the context). The computed tokens are the prefill workers' own count
(`WorkerStats.prefix_cache.computed_tokens`). `python -m pytest -s` prints the table that
docs/serving.md quotes.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import grpc
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_prefill, preset
from serving_support import prfaas_serve, toml

from prfaas_jax.model import init_state
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.state_bytes import state_nbytes

FIRST, ADDED, REPLY, TURNS = 120, 24, 8, 6
TIE_LOGIT = 1e-4  # the engines' chunked kernels and the oracle round differently


def serve_config(path):
    path.write_text(
        toml(
            {
                "model": {"preset": "tiny"},
                "engine": {"max_len": 512, "chunk_len": 128, "buckets": [32, 128]},
                "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1},
                # A fixed t and cache rule: every turn goes to PrfaaS.
                "router": {"threshold": 64, "cache_rule": "scarce"},
                "controller": {"enabled": False},
                "prefix_cache": {"enabled": True, "block_size": 16, "checkpoint_every": 4},
            }
        )
    )
    return path


def converse(root, cache_home) -> tuple[list[dict], int]:
    """The conversation through `prfaas chat --ids --json` against a fresh `prfaas serve`: the
    per-turn reports and the tokens the prefill workers computed."""
    config = serve_config(root / "cluster.toml")
    with prfaas_serve(root, "--config", str(config), cache_home=cache_home) as ready_file:
        rng = np.random.default_rng(8)
        messages = [rng.integers(0, 256, FIRST).tolist()]
        messages += [rng.integers(0, 256, ADDED).tolist() for _ in range(TURNS - 1)]
        chat_command = [sys.executable, "-m", "prfaas_jax.cli", "chat"]
        chat_command += ["--ready-file", str(ready_file), "--ids", "--json"]
        chat = subprocess.run(
            [*chat_command, "--max-new-tokens", str(REPLY)],
            input="".join(",".join(map(str, m)) + "\n" for m in messages),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert chat.returncode == 0, chat.stderr[-3000:]
        turns = [json.loads(line) for line in chat.stdout.splitlines()]
        ready = json.loads(ready_file.read_text())
        computed = 0
        for worker in ready["workers"].values():
            with grpc.insecure_channel(worker["address"]) as channel:
                stats = pb_grpc.WorkerControlStub(channel).GetStats(pb.GetStatsRequest())
                computed += stats.prefix_cache.computed_tokens
    prompt = messages[0]
    for turn, added in zip(turns, [*messages[1:], []], strict=True):
        turn["prompt"] = prompt
        prompt = prompt + turn["tokens"] + added
    return turns, computed


def assert_greedy(turns: list[dict]) -> None:
    """Each reply is the greedy continuation of its prompt: the last turn's context holds every
    earlier prompt and reply, so one causal prefill of it is the oracle for all of them."""
    cfg, params = preset("tiny")
    context = turns[-1]["prompt"] + turns[-1]["tokens"]
    state = init_state(cfg, 1, len(context))
    logits, _ = jit_prefill(params, cfg, jnp.asarray([context], jnp.int32), state)
    logits = np.asarray(logits[0])
    for turn in turns:
        for i, token in enumerate(turn["tokens"]):
            step = logits[len(turn["prompt"]) - 1 + i]
            assert step[token] >= step.max() - TIE_LOGIT, (turn["turn"], i, token)


@pytest.mark.slow
def test_multi_turn_conversation_reuses_each_previous_turn(tmp_path, child_cache_home):
    turns, computed = converse(tmp_path, child_cache_home)
    cfg, _ = preset("tiny")

    print(
        f"\n{'turn':>4} {'prompt':>6} {'cached':>6} {'of prev':>7} {'route':>6} {'TTFT ms':>8} "
        f"{'state bytes shipped':>20} {'full state':>11}"
    )
    for i, turn in enumerate(turns):
        previous = turns[i - 1]["prompt_len"] if i else 0
        share = f"{turn['cached_len'] / previous:.0%}" if previous else "-"
        print(
            f"{i + 1:>4} {turn['prompt_len']:>6} {turn['cached_len']:>6} {share:>7} "
            f"{turn['route']:>6} {turn['ttft_s'] * 1e3:>8.0f} {turn['state_bytes']:>20} "
            f"{state_nbytes(cfg, turn['prompt_len']):>11}"
        )
    prompt_tokens = sum(t["prompt_len"] for t in turns)
    reduction = 1 - computed / prompt_tokens
    print(
        f"prefill tokens computed: {computed} of {prompt_tokens} prompt tokens: "
        f"{reduction:.1%} fewer"
    )

    assert [t["turn"] for t in turns] == list(range(1, TURNS + 1))
    assert [t["prompt_len"] for t in turns] == [len(t["prompt"]) for t in turns]
    assert all(len(t["tokens"]) == REPLY for t in turns)
    assert_greedy(turns)
    for previous, turn in itertools.pairwise(turns):
        assert turn["cached_len"] >= 0.8 * previous["prompt_len"], turn
    assert computed == prompt_tokens - sum(t["cached_len"] for t in turns)
    assert reduction >= 0.70
    # Increments: from turn 2 the decode worker holds the previous prompt's 16-token blocks.
    row = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * {"float32": 4, "bfloat16": 2}[
        cfg.dtype
    ]
    previous = 0
    for turn in turns:
        held = previous // 16 * 16
        assert turn["route"] == "prfaas"
        assert turn["state_bytes"] == state_nbytes(cfg, turn["prompt_len"]) - held * row
        assert turn["saved_bytes"] == held * row
        previous = turn["prompt_len"]
