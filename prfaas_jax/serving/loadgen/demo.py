"""`prfaas demo`, the main job: a toy PrfaaS-PD cluster serving a mixed workload, checked.

Exposes `run_demo`, `demo_workload`, `recall_task` and `reference_tokens`.

`run_demo` starts the cluster of `configs/clusters/toy.toml` (router and workers as separate
processes on loopback, serving/cluster/launcher.py), sends a mixed workload of short and long
prompts concurrently, and prints per request the route, the uncached length, the threshold t it
was routed with, TTFT, decode tokens/s and the state bytes shipped beside `state_nbytes`. While
the cluster starts, the same process generates every request once more without the serving
plane — the model's `prefill` over the exact prompt, then `decode_step` token by token, greedy —
and the demo checks:

    every output equals that single-process generation;
    state_bytes == state_nbytes(cfg, prompt_len);
    the route follows the rule: uncached length > t ⇔ PrfaaS;
    with a model trained on long-context retrieval (the default, `recall-tiny`), the recall
    accuracy through the cluster equals the single-process accuracy, per route.

Recall. When the served model is a checkpoint trained by `prfaas train --task retrieval` (its
`run.json` says so), every prompt is a retrieval question of that task, ending with an asked key
whose value is two tokens long: the first generated token (the value's first) is computed by the
prefill worker, the second — the answer — by the decode worker from the state it was shipped.
An answer is right only if the state that crossed the link holds the prompt's facts; the demo
reports the recall accuracy per route beside the single-process accuracy, and fails when they
differ (`[faults] blank_state_prob` ships well-formed states of zeros, and the answers
collapse). A model with random weights gets random prompts and no recall column.

It exits 0 when every check holds and 1 otherwise, and stops every process it started either
way. The reference compiles one prefill per distinct prompt length, so the workload draws its
lengths from a short list.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from prfaas_jax.config import ModelConfig, load_model_config
from prfaas_jax.errors import UserError
from prfaas_jax.serving.cluster_config import load_cluster_config, resolve_cluster_path
from prfaas_jax.serving.cluster_sections import EngineKind
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.security import router_channel
from prfaas_jax.tables import table
from prfaas_jax.toml_config import resolve
from prfaas_jax.train.tasks import Task, TaskSpec, recall_prompt

# Short prompts (≤ the toy's t = 64, the boundary included) and long ones (> t), interleaved
# so they overlap in flight; five distinct lengths keep the reference to five compiles. Recall
# prompts stay within the lengths the model was trained on (recall-tiny: retrieval over 96 tokens
# with 4 questions, so prompts of 25 to 85 tokens).
DEMO_LENGTHS = (24, 300, 64, 120, 48, 300, 24, 120, 64, 48)
RECALL_LENGTHS = (32, 84, 64, 72, 48, 84, 32, 72, 64, 48)
DEMO_NEW_TOKENS = 12


def recall_task(preset: str) -> TaskSpec | None:
    """The retrieval task a trained model preset was trained on (its ``run.json``), or None."""
    found = resolve("models", preset)
    run = found / "run.json"
    if not found.is_dir() or not run.is_file():
        return None
    try:
        spec = TaskSpec(**json.loads(run.read_text())["task"])
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{run}: cannot read the training task: {err}") from None
    return spec if spec.task is Task.RETRIEVAL else None


def demo_workload(
    vocab_size: int, seed: int = 0, task: TaskSpec | None = None
) -> tuple[list[list[int]], list[int | None]]:
    """The prompts and, for a recall task, each prompt's answer (else None)."""
    if task is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(0, vocab_size, size=n).tolist() for n in DEMO_LENGTHS], [None] * 10
    import jax

    key = jax.random.PRNGKey(seed)
    asked = [
        recall_prompt(jax.random.fold_in(key, i), task, n) for i, n in enumerate(RECALL_LENGTHS)
    ]
    return [prompt for prompt, _ in asked], [answer for _, answer in asked]


def reference_tokens(
    cfg: ModelConfig, params: Any, prompts: Sequence[Sequence[int]], num_tokens: int, capacity: int
) -> list[list[int]]:
    """Greedy generation straight through the model: `prefill` on the exact prompt (one compile
    per distinct length), then `decode_step`; caches of a fixed `capacity` share one decode."""
    import jax
    import jax.numpy as jnp

    from prfaas_jax.model import decode_step, init_state, prefill

    prefill_fn = jax.jit(prefill, static_argnames=("cfg", "impl"))
    decode_fn = jax.jit(decode_step, static_argnames=("cfg", "impl"))
    outputs = []
    for prompt in prompts:
        state = init_state(cfg, 1, capacity)
        logits, state = prefill_fn(params, cfg, jnp.asarray([prompt], jnp.int32), state)
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        tokens = [int(token[0])]
        for _ in range(num_tokens - 1):
            logits, state = decode_fn(params, cfg, token, state)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            tokens.append(int(token[0]))
        outputs.append(tokens)
    return outputs


@dataclasses.dataclass
class DemoResult:
    request_id: str
    prompt_len: int
    tokens: list[int]
    report: pb.RequestReport
    ttft_s: float  # at the client
    decode_tokens_per_s: float
    expected_tokens: list[int] | None = None
    expected_state_bytes: int = 0
    answer: int | None = None  # the recall answer, the second generated token (recall prompts)

    @property
    def route_ok(self) -> bool:
        offloaded = self.report.uncached_len > self.report.threshold
        return (self.report.route == "prfaas") == offloaded

    @property
    def output_ok(self) -> bool:
        return self.tokens == self.expected_tokens

    @property
    def bytes_ok(self) -> bool:
        return self.report.state_bytes == self.expected_state_bytes

    @property
    def recalled(self) -> bool | None:
        """The cluster's answer is right (None without a recall answer)."""
        return None if self.answer is None else self.tokens[1:2] == [self.answer]

    @property
    def recalled_alone(self) -> bool | None:
        """The single-process generation's answer is right."""
        if self.answer is None or self.expected_tokens is None:
            return None
        return self.expected_tokens[1:2] == [self.answer]

    def to_json(self) -> dict:
        r = self.report
        return {
            "request_id": self.request_id,
            "route": r.route,
            "prompt_len": r.prompt_len,
            "cached_len": r.cached_len,
            "uncached_len": r.uncached_len,
            "threshold": r.threshold,
            "ttft_s": r.ttft_s,
            "client_ttft_s": self.ttft_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "state_bytes": r.state_bytes,
            "state_nbytes": self.expected_state_bytes,
            "prefill_instance": r.prefill_instance,
            "decode_instance": r.decode_instance,
            "tokens": self.tokens,
            "output_matches": self.output_ok,
            "route_follows_rule": self.route_ok,
            "answer": self.answer,
            "recalled": self.recalled,
            "recalled_single_process": self.recalled_alone,
        }


def send(stub: pb_grpc.RouterStub, request_id: str, prompt: list[int], n: int) -> DemoResult:
    start = time.perf_counter()
    tokens: list[int] = []
    first = None
    report = None
    for message in stub.Generate(
        pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, max_new_tokens=n)
    ):
        if message.token_ids and first is None:
            first = time.perf_counter()
        tokens.extend(message.token_ids)
        if message.finished:
            report = message.report
    end = time.perf_counter()
    if report is None or first is None:
        raise RuntimeError(f"{request_id}: the stream ended without a report")
    # 1 / TPOT, TPOT = (E2E − TTFT) / (n − 1) as in vLLM's benchmarks.
    rate = (len(tokens) - 1) / (end - first) if end > first else float("inf")
    return DemoResult(request_id, len(prompt), tokens, report, first - start, rate)


def _table(results: list[DemoResult]) -> str:
    recall = any(r.answer is not None for r in results)
    headers = ("request", "route", "prompt", "uncached", "t", "TTFT ms", "decode tok/s")
    headers += ("state B", "state_nbytes", "output") + (("recall",) if recall else ())
    rows = [
        (
            r.request_id,
            r.report.route,
            r.prompt_len,
            r.report.uncached_len,
            f"{r.report.threshold:.0f}",
            f"{r.report.ttft_s * 1e3:.0f}",
            f"{r.decode_tokens_per_s:.0f}",
            r.report.state_bytes,
            r.expected_state_bytes,
            "match" if r.output_ok else "MISMATCH",
            *((("right" if r.recalled else "wrong"),) if recall else ()),
        )
        for r in results
    ]
    return table(rows, headers, align="r" * len(headers))


def run_demo(
    config: str = "toy",
    *,
    as_json: bool = False,
    log_dir: str | None = None,
    on_served: Callable[[int, int], None] | None = None,
    netns: bool = False,
) -> int:
    """Run the demo on a cluster config (a name under configs/clusters/ or a path).

    ``on_served(served, total)`` is called when the workload starts and as each request ends.
    ``netns``: the clusters in network namespaces (`ClusterProcesses`); the demo then also
    checks that the kernel counted the shipped states on the inter-cluster veth.
    """
    from prfaas_jax.model.state import state_nbytes
    from prfaas_jax.serving.cluster.launcher import ClusterProcesses

    started = time.perf_counter()
    cluster_config = load_cluster_config(resolve_cluster_path(config))
    if cluster_config.model.engine is not EngineKind.JAX:
        raise UserError(
            f'{cluster_config.path}: the demo checks real model outputs: it needs engine = "jax"'
        )
    if (lossy := cluster_config.lossy_wire) is not None:
        raise UserError(
            f"{cluster_config.path}: the demo checks outputs equal single-process generation, "
            f"which {lossy} does not promise (`prfaas wirecheck` measures what it costs)"
        )
    cfg = load_model_config(cluster_config.model.preset)
    task = recall_task(cluster_config.model.preset)
    prompts, answers = demo_workload(cfg.vocab_size, cluster_config.model.seed, task)
    expected: dict[str, list[list[int]]] = {}

    def compute_reference() -> None:
        from prfaas_jax.engine.compile_cache import (
            default_compile_cache_dir,
            enable_compile_cache,
            enable_weights_cache,
        )
        from prfaas_jax.model.weights import load_model

        if cluster_config.engine.compile_cache:
            enable_compile_cache(default_compile_cache_dir())
            enable_weights_cache()
        _, params = load_model(cluster_config.model.preset, seed=cluster_config.model.seed)
        expected["tokens"] = reference_tokens(
            cfg, params, prompts, DEMO_NEW_TOKENS, cluster_config.engine.max_len
        )

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:5.1f} s] {message}", file=sys.stderr, flush=True)

    reference = threading.Thread(target=compute_reference, name="reference", daemon=True)
    reference.start()
    where = "network namespaces, a tbf-shaped veth" if netns else "loopback"
    log(f"starting the cluster of {cluster_config.path} (router + workers, {where})")
    link_bytes: int | None = None
    with ClusterProcesses(cluster_config.path, log_dir=log_dir, netns=netns) as cluster:
        ready = cluster.start()
        log(f"cluster ready: router {ready['router']}, {len(ready['workers'])} workers")
        if netns and ready["netns"]["mutual_tls"]:
            log("every port across the namespaces: mutual TLS, with certificates made for this run")
        topology = cluster.topology
        link_before = topology.link_tx_bytes() if topology is not None else 0
        # The reference compiles while the workers start; let it finish before the workload,
        # so its compiles do not compete with the requests being timed.
        reference.join()
        log("single-process reference ready; sending the workload")
        # As any client would: TLS and the bearer token when the config's [security] sets them.
        with router_channel(ready["router"], cluster_config.security) as channel:
            stub = pb_grpc.RouterStub(channel)
            # One untimed request per route first, as benchmarks warm up: first-use costs
            # (connections, allocator growth) are not what the table should show. Its prompt
            # shares no prefix with the workload, so the prefix cache does not skew the table.
            warm_up = demo_workload(cfg.vocab_size, cluster_config.model.seed + 1)[0][1]
            warm = [
                send(stub, f"warm-up-{i}", warm_up[:n], 2) for i, n in enumerate((8, len(warm_up)))
            ]
            served, lock = itertools.count(1), threading.Lock()

            def ended(_: concurrent.futures.Future) -> None:
                if on_served is not None:
                    with lock:
                        on_served(next(served), len(prompts))

            if on_served is not None:
                on_served(0, len(prompts))
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                futures = []
                for i, prompt in enumerate(prompts):
                    futures.append(pool.submit(send, stub, f"req-{i:02d}", prompt, DEMO_NEW_TOKENS))
                    futures[-1].add_done_callback(ended)
                    time.sleep(0.02)  # staggered arrivals, all in flight together
                results = [f.result() for f in futures]
            # The router polls the link counters once per control period.
            time.sleep(2 * cluster_config.router.control_period_s)
            stats = stub.GetStats(pb.GetStatsRequest())
            if topology is not None:
                link_bytes = topology.link_tx_bytes() - link_before
        log(f"{len(results)} requests served")
    for result, tokens, answer in zip(results, expected["tokens"], answers, strict=True):
        result.expected_tokens, result.answer = tokens, answer
        result.expected_state_bytes = state_nbytes(cfg, result.prompt_len)
    ok = all(
        r.output_ok and r.bytes_ok and r.route_ok and r.recalled == r.recalled_alone
        for r in results
    )
    # Transfers over mutual TLS (--netns makes certificates) each add their handshakes.
    tls = netns and ready["netns"]["mutual_tls"]
    tls_transfers = sum(r.report.route == "prfaas" for r in [*warm, *results]) if tls else 0
    link_ok = link_bytes is None or link_matches(link_bytes, stats.egress_bytes, tls_transfers)
    summary = _summary(results, stats, time.perf_counter() - started, ok and link_ok)
    summary["link_kernel_bytes"] = link_bytes
    summary["link_tls_transfers"] = tls_transfers
    if as_json:
        payload = {"requests": [r.to_json() for r in results], "summary": summary}
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(_table(results))
        print()
        print(_format_summary(summary))
    return 0 if ok and link_ok else 1


# What the wire adds to the frames: Ethernet + IPv4 + TCP (with timestamps) headers are 66 bytes
# per segment of at most 1,448 payload bytes (4.6 %), and gRPC adds its HTTP/2 frame headers.
LINK_TOLERANCE = 0.08
# Per transfer over mutual TLS: its data connection's handshake (~2 KB from the sender, and the
# segments acknowledging the receiver's), record framing, the gRPC channels' first handshakes.
TLS_BYTES_PER_TRANSFER = 8192


def link_matches(kernel_bytes: int, shipped_bytes: int, tls_transfers: int = 0) -> bool:
    """The veth carried the shipped states: every shipped byte crossed it, and little else did
    (`LINK_TOLERANCE` more, the headers, and `TLS_BYTES_PER_TRANSFER` per TLS transfer)."""
    most = (1 + LINK_TOLERANCE) * shipped_bytes + TLS_BYTES_PER_TRANSFER * tls_transfers
    return 0 < shipped_bytes <= kernel_bytes <= most


def _summary(results: list[DemoResult], stats: pb.RouterStats, wall_s: float, ok: bool) -> dict:
    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    by_route = {
        route: [r for r in results if r.report.route == route] for route in ("prfaas", "pd")
    }

    def accuracy(group: list[DemoResult], alone: bool) -> float | None:
        marks = [r.recalled_alone if alone else r.recalled for r in group]
        return None if not group or marks[0] is None else sum(marks) / len(marks)

    recall = {
        route: {"cluster": accuracy(group, False), "single_process": accuracy(group, True)}
        for route, group in by_route.items()
    }
    return {
        "requests": len(results),
        "prfaas": len(by_route["prfaas"]),
        "pd": len(by_route["pd"]),
        "outputs_match": sum(r.output_ok for r in results),
        "state_bytes_match": sum(r.bytes_ok for r in results),
        "routes_follow_rule": sum(r.route_ok for r in results),
        "recall_accuracy": recall if results and results[0].answer is not None else None,
        "mean_ttft_s": {k: mean([r.report.ttft_s for r in v]) for k, v in by_route.items()},
        # Prefill end → first token: the part of the TTFT the transfer added after compute.
        "mean_exposed_transfer_s": {
            k: mean([r.report.exposed_transfer_s for r in v]) for k, v in by_route.items()
        },
        "egress_bytes": stats.egress_bytes,
        "threshold_final": stats.threshold,
        "wall_s": wall_s,
        "ok": ok,
    }


def _recall_lines(recall: dict | None) -> list[str]:
    if recall is None:
        return []

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    return [
        f"recall accuracy through the cluster / single process: PrfaaS "
        f"{pct(recall['prfaas']['cluster'])} / {pct(recall['prfaas']['single_process'])}, "
        f"PD {pct(recall['pd']['cluster'])} / {pct(recall['pd']['single_process'])}"
    ]


def _link_lines(s: dict) -> list[str]:
    kernel = s.get("link_kernel_bytes")
    if kernel is None:
        return []
    shipped, tls = s["egress_bytes"], s["link_tls_transfers"]
    off = 100 * (kernel - shipped) / shipped if shipped else float("nan")
    handshakes = f" + {TLS_BYTES_PER_TRANSFER // 1024} KiB × {tls} TLS transfers" if tls else ""
    return [
        f"bytes the kernel sent on the inter-cluster veth: {kernel} ({off:+.1f} % of the "
        f"egress, headers included; within 0 to +{100 * LINK_TOLERANCE:.0f} %{handshakes}: "
        f"{'yes' if link_matches(kernel, shipped, tls) else 'NO'})"
    ]


def _format_summary(s: dict) -> str:
    n = s["requests"]
    ttft, exposed = s["mean_ttft_s"], s["mean_exposed_transfer_s"]
    lines = [
        f"requests: {n} ({s['prfaas']} offloaded to PrfaaS, {s['pd']} kept in PD)",
        f"outputs equal single-process greedy generation: {s['outputs_match']}/{n}",
        f"state bytes equal state_nbytes(prompt_len): {s['state_bytes_match']}/{n}",
        f"routes follow the rule (uncached > t ⇔ PrfaaS): {s['routes_follow_rule']}/{n}",
        *_recall_lines(s["recall_accuracy"]),
        f"mean TTFT: PrfaaS {ttft['prfaas'] * 1e3:.0f} ms, PD {ttft['pd'] * 1e3:.0f} ms",
        f"mean exposed transfer (prefill end → first token): PrfaaS "
        f"{exposed['prfaas'] * 1e3:.0f} ms, PD {exposed['pd'] * 1e3:.0f} ms",
        f"inter-cluster egress: {s['egress_bytes']} bytes; final t = {s['threshold_final']:.0f}",
        *_link_lines(s),
        f"wall time: {s['wall_s']:.1f} s (cluster start and compiles included)",
        "demo: OK" if s["ok"] else "demo: FAILED",
    ]
    return "\n".join(lines)
