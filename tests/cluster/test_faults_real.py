"""Worker faults on the real model (`tiny` KDA + MLA, JAX engines, real processes, states
streamed layer by layer: `layer_groups = 4`): the PrfaaS prefill worker SIGKILLed while its
states are on the inter-cluster link, then the decode worker SIGKILLed while it streams. Every
request completes with exactly the tokens of single-process greedy generation (the model's
`prefill` + `decode_step`, computed here): the router re-prefills the lost prefills locally and
resumes the lost streams from prompt + the tokens already sent. Beside the greedy requests, one
of each route samples (temperature 0.8, top-p 0.9, a fixed seed) and must equal what `prfaas
generate` makes in one process with the same seed and knobs (engine/generate.py): a retried
prefill draws token 0 again from the same key, a resumed stream continues the key schedule."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import grpc
import numpy as np
import pytest
from serving_support import REAL_ENGINE, generate, real_cluster

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

SECTIONS = {
    "model": {"preset": "tiny", "seed": 0},
    "engine": {**REAL_ENGINE, "layer_groups": 4},
    "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1},
    # 50 KB/s: the 57.6 KB state of a 300-token prompt is on the link for over a second.
    "link": {"bandwidth_mbps": 0.4, "latency_ms": 2.0},
    "router": {"threshold": 64, "control_period_s": 0.25, "retry_wait_s": 300.0},
    "controller": {"enabled": False},
    "prefix_cache": {"enabled": True},
}
LONG, SHORT, NEW_LONG, NEW_SHORT = 300, 40, 8, 400
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=2**40 + 11)
KNOBS = {"temperature": SAMPLED.temperature, "top_p": SAMPLED.top_p, "seed": SAMPLED.seed}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = load_model_config("tiny")
    rng = np.random.default_rng(11)
    prompts = {
        "long": [rng.integers(0, cfg.vocab_size, LONG).tolist() for _ in range(2)],
        "short": [rng.integers(0, cfg.vocab_size, SHORT).tolist() for _ in range(3)],
    }
    # Held out from the greedy ones: the sampled request of each route.
    sampled = {kind: rng.integers(0, cfg.vocab_size, n).tolist() for kind, n in LENGTHS.items()}
    root = tmp_path_factory.mktemp("faults-real")
    new = {"long": NEW_LONG, "short": NEW_SHORT}
    with real_cluster(root, SECTIONS, prompts, new) as (cluster, ready, stub, expected):
        expected["sampled"] = {
            kind: one_process_tokens(SECTIONS, p, new[kind], SAMPLED) for kind, p in sampled.items()
        }
        prompts["sampled"] = sampled
        yield cluster, ready, stub, prompts, expected


LENGTHS = {"long": LONG, "short": SHORT}


def one_process_tokens(
    sections: dict, prompt: list[int], n: int, sampling: SamplingParams
) -> list[int]:
    """What `prfaas generate` makes of `prompt` in this process: the cluster's model and
    weights, its prefill and decode engines, the same sampling settings."""
    from prfaas_jax.engine.generate import generate as generate_one
    from prfaas_jax.model.seeded_weights import seeded_params

    cfg = load_model_config(sections["model"]["preset"])
    params = seeded_params(cfg, sections["model"]["seed"])
    return generate_one(params, cfg, prompt, n, sampling)[0]


def kill(cluster: ClusterProcesses, name: str) -> None:
    pid = cluster.worker_pid(name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_prfaas_worker_killed_mid_transfer(setup):
    cluster, ready, stub, prompts, expected = setup
    worker = grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"])
    control = pb_grpc.WorkerControlStub(worker)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(generate, stub, p, NEW_LONG) for p in prompts["long"]]
        sampled = pool.submit(generate, stub, prompts["sampled"]["long"], NEW_LONG, **KNOBS)
        deadline = time.monotonic() + 120
        while control.GetStats(pb.GetStatsRequest(), timeout=5).egress_bytes == 0:
            assert time.monotonic() < deadline, "no state went on the link"
            time.sleep(0.02)
        kill(cluster, "prfaas-0")  # a state is on the link now
        replies = [f.result(timeout=300) for f in futures]
        sampled_reply = sampled.result(timeout=300)
    worker.close()
    assert [r.tokens for r in replies] == expected["long"]
    assert any(r.report.attempts > 1 for r in replies)
    assert sampled_reply.tokens == expected["sampled"]["long"]


@pytest.mark.slow
def test_decode_worker_killed_mid_stream(setup):
    cluster, _, stub, prompts, expected = setup
    # The greedy prompts, then the sampled one.
    requests = [(p, {}) for p in prompts["short"]] + [(prompts["sampled"]["short"], KNOBS)]
    received: list[list[int]] = [[] for _ in requests]
    reports: list[pb.RequestReport | None] = [None] * len(received)

    def read(i: int) -> None:
        prompt, knobs = requests[i]
        request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=NEW_SHORT, **knobs)
        for message in stub.Generate(request, timeout=300):
            received[i].extend(message.token_ids)
            if message.finished:
                reports[i] = message.report

    with concurrent.futures.ThreadPoolExecutor(len(received)) as pool:
        futures = [pool.submit(read, i) for i in range(len(received))]
        # Killed as soon as every stream has its first token: the last to start has hundreds of
        # tokens to go, so at least one stream is cut. (Waiting for all three to be live at once
        # is a race: on a loaded machine the first can finish before the third starts.)
        deadline = time.monotonic() + 120
        while not all(received):
            assert time.monotonic() < deadline, "the streams did not start"
            for future in futures:
                if future.done():
                    future.result()  # a stream that failed before its first token
            time.sleep(0.005)
        kill(cluster, "pd-1")
        for future in futures:
            future.result(timeout=300)
    assert received[:-1] == expected["short"]
    assert received[-1] == expected["sampled"]["short"]
    assert all(r is not None for r in reports)
    assert any(r.resumed_from > 0 for r in reports if r is not None)
