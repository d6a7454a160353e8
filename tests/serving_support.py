"""Helpers shared by the serving tests, in process (tests/serving) and over real processes
(tests/cluster): cluster configs written as TOML, a client for the router, in-process workers and
a whole in-process cluster (the router and its workers, each on a loopback server of its own),
the malformed requests every router must refuse, polling, and the router's metrics as a scraper
reads them.

Cluster tests run real processes on loopback (serving/cluster/launcher.py). The fake engines
(engine/fake.py) make outputs computable by hand and start in seconds; the real-model
tests use the JAX engines, whose workers share the session's persistent compilation cache
(tests/conftest.py), so only the first real-model cluster of a run compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence

import grpc
from prometheus_client.parser import text_string_to_metric_families

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.api import DecodeEngineLike, PrefillEngineLike
from prfaas_jax.engine.fake import FakePrefillEngine, FakePrefillResult, fake_tokens
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import ClusterConfig, serving_model_config
from prfaas_jax.serving.cluster_sections import SecuritySection
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.router.control import RouterControl
from prfaas_jax.serving.router.core import RouterCore, RouterService
from prfaas_jax.serving.transfer.data_path import DataListener, DataSender
from prfaas_jax.serving.transfer.faults import FaultInjector
from prfaas_jax.serving.transfer.increments import build_decode_kv_cache
from prfaas_jax.serving.transfer.state_chunks import add_decode_worker_servicer
from prfaas_jax.serving.transport.link import LinkShaper
from prfaas_jax.serving.transport.messages import router_max_request_bytes
from prfaas_jax.serving.transport.server import ServingServer, full_service_name
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.mixed import MixedDecodeService, MixedPrefillService
from prfaas_jax.serving.worker.prefill import PrefillService
from prfaas_jax.serving.worker.prefix import PrefixService, build_prefix_cache
from prfaas_jax.wire_precision import WIRE_NATIVE


def toml(sections: dict[str, dict]) -> str:
    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table, e.g. one of [wire]'s options
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    lines = []
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {value(v)}" for k, v in keys.items())
    return "\n".join(lines) + "\n"


# The engine section of the real-model cluster tests (tiny): one set of executables, compiled
# once per session into the cache their workers share.
# One prompt per prefill call (`prefill_batch_rows` 1): these clusters test faults, routing and
# states, not batching (tests/serving/test_batched_prefill_worker.py does), so their workers
# warm no batched calls at start.
REAL_ENGINE = {
    "max_len": 512,
    "chunk_len": 128,
    "buckets": [32, 128],
    "max_slots": 8,
    "prefill_batch_rows": 1,
}


@contextlib.contextmanager
def real_cluster(
    root: pathlib.Path, sections: dict[str, dict], prompts: dict[str, list[list[int]]], new: dict
) -> Iterator[tuple]:
    """A cluster of real processes on the JAX engines, started from ``sections`` with restarts
    on, and the greedy tokens of ``prompts`` (by kind, ``new[kind]`` each, the first included)
    computed straight from the model (`reference_tokens`): until closed, ``(cluster, ready,
    router stub, expected)``. The workers compile through the session's cache for child
    processes (tests/conftest.py); the references compile here, in the pytest process."""
    from prfaas_jax.model.seeded_weights import seeded_params
    from prfaas_jax.serving.cluster.launcher import ClusterProcesses
    from prfaas_jax.serving.loadgen.demo import reference_tokens

    path = root / "cluster.toml"
    path.write_text(toml(sections))
    model = sections["model"]
    cfg = load_model_config(model["preset"])
    max_len = sections["engine"]["max_len"]
    compile_cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    with ClusterProcesses(
        path, log_dir=root / "logs", compile_cache=compile_cache, restart_workers=True
    ) as cluster:
        ready = cluster.start()
        params = seeded_params(cfg, model.get("seed", 0))
        expected = {
            kind: reference_tokens(cfg, params, batch, new[kind], max_len)
            for kind, batch in prompts.items()
        }
        with grpc.insecure_channel(ready["router"]) as channel:
            yield cluster, ready, pb_grpc.RouterStub(channel), expected


@contextlib.contextmanager
def prfaas_serve(
    root: pathlib.Path, *args: str, cache_home: pathlib.Path | None = None
) -> Iterator[pathlib.Path]:
    """`prfaas serve ARGS` as a user runs it, its logs in ``root/logs``: yields its ready file
    once it exists; on the way out SIGTERM, which must stop it with status 0. ``cache_home``
    is the session's compile cache (tests/conftest.py `child_cache_home`)."""
    ready_file = root / "ready.json"
    command = [sys.executable, "-m", "prfaas_jax.cli", "serve", *args]
    command += ["--ready-file", str(ready_file), "--log-dir", str(root / "logs")]
    env = dict(os.environ, **({"XDG_CACHE_HOME": str(cache_home)} if cache_home else {}))
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 600
        while not ready_file.exists():
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no ready file after 600 s"
            time.sleep(0.2)
        yield ready_file
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


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


class Stream:
    """A router `Generate` call read on its own thread: tokens as they come, then its report or
    error and when it ended. `expected` is the fake engines' output for it (the preset of
    `fake_config`)."""

    def __init__(self, stub: pb_grpc.RouterStub, tokens: list[int], n: int, wait_s: float) -> None:
        self.prompt, self.n, self.wait_s = tokens, n, wait_s
        self.tokens: list[int] = []
        self.report: pb.RequestReport | None = None
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        request = pb.GenerateRequest(prompt_token_ids=tokens, max_new_tokens=n)
        self._call = stub.Generate(request, timeout=wait_s)
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                self.tokens.extend(message.token_ids)
                if message.finished:
                    self.report = message.report
        except grpc.RpcError as err:
            self.error = err
        self.ended_at = time.monotonic()

    def join(self) -> None:
        self._thread.join(self.wait_s)
        assert not self._thread.is_alive(), "the stream neither finished nor failed"

    @property
    def expected(self) -> list[int]:
        return fake_tokens(self.prompt, self.n, load_model_config("tiny").vocab_size)


def child(cluster, name: str) -> subprocess.Popen:
    """The process of `name` in a `ClusterProcesses` (the router, or a worker's first)."""
    return next(c.popen for c in cluster.children if c.name == name)


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


def serve_workers(
    prefill=None, decode=None, control=None, prefixes=None, **options
) -> ServingServer:
    """An in-process server (loopback, any port) of a `PrefillService` and/or a `DecodeService`
    (and a `WorkerControl` servicer and a `PrefixService`, if given); `options` go to
    `ServingServer`."""
    registrations = []
    if prefixes is not None:
        add = pb_grpc.add_PrefixCacheServicer_to_server
        registrations.append((add, prefixes, full_service_name("PrefixCache")))
    if control is not None:
        add = pb_grpc.add_WorkerControlServicer_to_server
        registrations.append((add, control, full_service_name("WorkerControl")))
    if prefill is not None:
        add = pb_grpc.add_PrefillWorkerServicer_to_server
        registrations.append((add, prefill, full_service_name("PrefillWorker")))
    if decode is not None:  # registered as a worker process registers it
        registrations.append(
            (add_decode_worker_servicer, decode, full_service_name("DecodeWorker"))
        )
    return ServingServer(registrations, **options)


@dataclasses.dataclass
class InProcessCluster:
    """A router and its workers in this process (`serve_in_process`); services by instance."""

    config: ClusterConfig
    core: RouterCore
    router: pb_grpc.RouterStub
    prefill: dict[str, PrefillService]
    decode: dict[str, DecodeService]
    servers: dict[str, ServingServer]  # every instance's, and the router's as "router"
    prefixes: dict[str, PrefixService] = dataclasses.field(default_factory=dict)

    def stats(self) -> pb.RouterStats:
        return self.router.GetStats(pb.GetStatsRequest(), timeout=10)


def fake_instances(cfg, *, max_slots: int = 4, max_len: int = 512) -> dict:
    """The instances of `fake_config`'s cluster on fake engines, for `serve_in_process`."""
    from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine

    return {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(cfg)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(cfg)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(cfg, max_slots=max_slots, max_len=max_len)),
    }


@contextlib.contextmanager
def serve_in_process(
    config: ClusterConfig,
    engines: dict[str, tuple[Role, PrefillEngineLike | DecodeEngineLike]],
    *,
    shapers: dict[str, LinkShaper] | None = None,
    faults: dict[str, FaultInjector] | None = None,
    controls: dict[str, pb_grpc.WorkerControlServicer] | None = None,
    state_timeout_s: float = 30.0,
    push_timeout_s: float = 30.0,
    prefix_caches: bool = False,
    decode_kv_caches: bool = False,
) -> Iterator[InProcessCluster]:
    """Each instance of `engines` (name → role and engine) as a `PrefillService` or
    `DecodeService` (with `[instances] pd_mode = "mixed"`, a decode instance's engine is its
    mixer, served by a `MixedDecodeService` and a `MixedPrefillService`) on a loopback server
    of its own, and the router's `Router` service over
    them, built from `config` as a `prfaas serve` router would be; until closed. `shapers` and
    `faults` (by prefill instance) are its link and its fault injector, `controls` (by instance)
    a `WorkerControl` servicer to serve beside it (without one, the router's liveness probe gets
    UNIMPLEMENTED, which never takes an instance out of routing). With `prefix_caches`, each
    prefill instance has the prefix cache `[prefix_cache]` describes and serves it, as a worker
    process does; with `decode_kv_caches`, each decode instance keeps the KV it receives, so
    PrfaaS pushes ship increments (serving/transfer/increments.py). The router's control loop is
    not started: it only renders `GetStats`."""
    cfg = serving_model_config(config)
    shapers, faults, controls = shapers or {}, faults or {}, controls or {}
    prefill: dict[str, PrefillService] = {}
    decode: dict[str, DecodeService] = {}
    servers: dict[str, ServingServer] = {}
    prefixes: dict[str, PrefixService] = {}
    listeners: dict[str, DataListener | None] = {}
    # Decode-aware: a decode node serves its own prefix pool too, and keeps what it receives in it.
    decode_pools = config.router.decode_aware
    for name, (role, engine) in engines.items():
        if prefix_caches and (role.is_prefill or decode_pools):
            prefixes[name] = PrefixService(
                cfg=cfg,
                cache=build_prefix_cache(cfg, config, name),
                max_len=config.engine.max_len,
                frame_bytes=config.engine.frame_bytes,
                shaper=shapers.get(name),
            )
        if role.is_prefill:
            prefill[name] = PrefillService(
                engine=lambda engine=engine: engine,
                cfg=cfg,
                max_len=config.engine.max_len,
                frame_bytes=config.engine.frame_bytes,
                shaper=shapers.get(name),
                admit=lambda context: None,
                push_timeout_s=push_timeout_s,
                faults=faults.get(name),
                prefixes=prefixes.get(name),
                # As a worker process does: `[link] precision` on the pushes that cross the link.
                precision=config.link.wire_precision
                if role is Role.PRFAAS_PREFILL
                else WIRE_NATIVE,
                data_path=config.link.data_path,
                streams=config.link.streams,
                batch_rows=config.engine.prefill_batch_rows,
                batch_tokens=config.engine.prefill_batch_tokens,
            )
        else:
            # As a worker process does: a data port beside the decode service. A mixed
            # instance's engine is its mixer, and its prefill calls go to its decode service.
            listeners[name] = DataListener() if config.link.data_path else None
            service, mixed = DecodeService, {"engine": lambda engine=engine: engine}
            if config.instances.mixed:
                service, mixed = MixedDecodeService, {"mixer": lambda engine=engine: engine}
            decode[name] = service(
                **mixed,
                cfg=cfg,
                max_len=config.engine.max_len,
                admit=lambda context: None,
                state_timeout_s=state_timeout_s,
                data_path=listeners[name],
                # Its own pool when decode-aware (served above), else one of its own if asked.
                kv_cache=build_decode_kv_cache(
                    cfg, config, prefixes[name].cache if name in prefixes else None
                )
                if decode_kv_caches or name in prefixes
                else None,
            )
        prefill_calls = prefill.get(name)
        if config.instances.mixed and name in decode:
            prefill_calls = MixedPrefillService(
                decode[name], max_len=config.engine.max_len, admit=lambda context: None
            )
        servers[name] = serve_workers(
            prefill_calls, decode.get(name), controls.get(name), prefixes.get(name)
        )
    core = RouterCore(
        config, cfg, {name: (servers[name].address, role) for name, (role, _) in engines.items()}
    )
    registration = (
        pb_grpc.add_RouterServicer_to_server,
        RouterService(core, RouterControl(core).router_stats),
        full_service_name("Router"),
    )
    max_request = router_max_request_bytes(config.engine.max_len)
    servers["router"] = ServingServer([registration], max_receive_bytes=max_request)
    channel = grpc.insecure_channel(servers["router"].address)
    try:
        yield InProcessCluster(
            config, core, pb_grpc.RouterStub(channel), prefill, decode, servers, prefixes
        )
    finally:
        channel.close()
        core.close()
        servers["router"].stop(grace_s=0.5)
        for service in decode.values():
            service.stop()
        for name, server in servers.items():
            if name != "router":
                server.stop(grace_s=0.5)
        for listener in listeners.values():
            if listener is not None:
                listener.close()


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


def assert_data_port_refuses(host: str, port: int, client: SecuritySection | None) -> None:
    """A data port wanting mutual TLS drops ``client``'s connection (no certificate from its
    CA) before any push can claim it: refused in the handshake, or closed by the worker."""
    try:
        conn = DataSender.connect(host, port, client, timeout_s=5)
    except OSError:  # refused in the handshake
        return
    conn._conn.settimeout(5)
    # The worker closed it: an end of stream, a reset, or a TLS alert.
    with contextlib.suppress(ConnectionResetError, ssl.SSLError):
        assert conn._conn.recv(1) == b""
    conn.close()


class GatedPrefill(FakePrefillEngine):
    """The fake prefill engine of `tiny`, holding each prefill at `gate` while it is closed
    (`entered` is set once one waits there); `calls` lists each call's prompts."""

    wait_s = 20.0  # only bounds a test that never opens the gate

    def __init__(self) -> None:
        super().__init__(load_model_config("tiny"))
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls: list[list[list[int]]] = []

    def prefill(self, tokens: Sequence[int], **options: object) -> FakePrefillResult:
        self.calls.append([list(tokens)])
        self.entered.set()
        assert self.gate.wait(self.wait_s), "the test never opened the gate"
        return super().prefill(tokens, **options)

    def prefill_batch(self, prompts, **options) -> list[FakePrefillResult]:
        self.calls.append([list(p) for p in prompts])
        return super().prefill_batch(prompts, **options)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll `predicate` every 10 ms until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_metrics(address: str, path: str = "/metrics") -> tuple[str, str]:
    """`GET http://address/path` on a metrics endpoint: its Content-Type and text."""
    with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


def parse_metrics(text: str) -> tuple[dict[str, str], Samples]:
    """The exposition parsed by prometheus_client's parser: each family's exposed name → its
    type, and each sample's (name, labels) → value."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        # The parser names a counter family without its `_total`, as OpenMetrics does.
        types[family.name + ("_total" if family.type == "counter" else "")] = family.type
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"{key} twice"
            samples[key] = sample.value
    return types, samples


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The value of the series `name{labels}` (KeyError: no such series)."""
    return samples[(name, frozenset(labels.items()))]
