"""Helpers shared by the serving tests, in process (tests/serving) and over real processes
(tests/cluster): cluster configs written as TOML, a client for the router, in-process workers,
the malformed requests every router must refuse, and polling.

Cluster tests run real processes on loopback (serving/cluster/launcher.py). The fake engines
(engine/fake.py) make outputs computable by hand and start in seconds; the real-model
tests use the JAX engines, whose workers share the session's persistent compilation cache
(tests/conftest.py), so only the first real-model cluster of a run compiles.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable

from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.server import ServingServer, full_service_name


def toml(sections: dict[str, dict]) -> str:
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {value(v)}" for k, v in keys.items())
    return "\n".join(lines) + "\n"


def fake_config(path: pathlib.Path, **overrides: dict) -> pathlib.Path:
    """A fake-engine cluster config: 1 PrfaaS + 1 PD prefill + 1 PD decode, t = 64, controller
    off unless `overrides` say otherwise (section → keys, merged)."""
    sections: dict[str, dict] = {
        "model": {"preset": "tiny", "engine": "fake"},
        "engine": {"max_len": 512, "max_slots": 4, "compile_cache": False},
        "fake": {"decode_step_s": 0.01},
        "instances": {"prfaas_prefill": 1, "pd_prefill": 1, "pd_decode": 1},
        "router": {"threshold": 64, "prfaas_max_queue": 64, "control_period_s": 0.25},
        "controller": {"enabled": False},
    }
    for name, keys in overrides.items():
        sections.setdefault(name, {}).update(keys)
    path.write_text(toml(sections))
    return path


@dataclasses.dataclass
class Reply:
    tokens: list[int]
    report: pb.RequestReport
    messages: int


def generate(stub: pb_grpc.RouterStub, prompt: list[int], n: int, **fields) -> Reply:
    tokens, report, messages = [], None, 0
    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=n, **fields)
    for message in stub.Generate(request, timeout=120):
        tokens.extend(message.token_ids)
        messages += 1
        if message.finished:
            report = message.report
    assert report is not None, "the stream ended without a final report"
    return Reply(tokens, report, messages)


def serve_workers(prefill=None, decode=None, **options) -> ServingServer:
    """An in-process server (loopback, any port) of a `PrefillService` and/or a `DecodeService`;
    `options` go to `ServingServer`."""
    registrations = []
    if prefill is not None:
        add = pb_grpc.add_PrefillWorkerServicer_to_server
        registrations.append((add, prefill, full_service_name("PrefillWorker")))
    if decode is not None:
        add = pb_grpc.add_DecodeWorkerServicer_to_server
        registrations.append((add, decode, full_service_name("DecodeWorker")))
    return ServingServer(registrations, **options)


# Malformed `GenerateRequest`s (for max_len 512, vocabulary 256) and a word of each refusal: the
# router answers every one with INVALID_ARGUMENT.
MALFORMED_REQUESTS = [
    ({"prompt_token_ids": [], "max_new_tokens": 4}, "empty"),
    ({"prompt_token_ids": [1, 256], "max_new_tokens": 4}, "outside the vocabulary"),
    ({"prompt_token_ids": [1] * 510, "max_new_tokens": 4}, "max_len 512"),
    ({"prompt_token_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt_token_ids": [1], "max_new_tokens": -7}, "max_new_tokens"),
    ({"prompt_token_ids": [1], "max_new_tokens": 2**31 - 1}, "max_len 512"),
    ({"prompt_token_ids": [1], "max_new_tokens": 2, "temperature": -1}, "temperature"),
    ({"prompt_token_ids": [1], "max_new_tokens": 2, "temperature": math.nan}, "temperature"),
    ({"prompt_token_ids": [1], "max_new_tokens": 2, "top_p": 1.5}, "top_p"),
    ({"prompt_token_ids": [1], "max_new_tokens": 2, "request_id": "a\nb"}, "request_id"),
]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll `predicate` every 10 ms until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
