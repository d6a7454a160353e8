"""The router's cost of finding a prompt's cached prefixes, with the cache index and by asking
every instance, as the cluster grows: one run, over real gRPC.

A second process hosts ``N`` prefill instances' prefix caches, each served as a worker serves it
(`PrefixService` on a loopback gRPC server of its own: ``Lookup``, ``Events``). Every cache holds
``--conversations`` multi-turn conversations of its own that open with one system prompt shared
cluster-wide (fake arrays of the ``tiny`` preset's layout: neither side reads values). This
process is the router: two `RouterCore`s over the same instances, one with ``[router]
cache_index = true`` (it follows every instance's events: serving/router/cache_feed.py) and one
with ``false`` (a ``Lookup`` RPC to every instance per request). Each answers the same requests
— the next turn of a random conversation, or a fresh prompt on the system prompt — through
``RouterCore._lookup``, the call a request makes before routing, one request at a time.

Both must return the same lengths for every request (checked). Per request: the router's wall
time (mean, p50, p99) and its process CPU time (this process: the router's threads and its gRPC
client; the instances' own work is in the other process), and for the index its entries,
events and the memory it took to build (tracemalloc, Python objects).

    python bench/router_lookup.py [--instances 4,16,32,64] [--conversations 4]
                                  [--requests 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from prfaas_jax.cli.flags import parse_int_list
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.codec.layout import canonical_tensors
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.tables import table

CFG = load_model_config("tiny")
BLOCK, SYSTEM, TURN = 16, 256, 96


def _host(conn) -> None:
    """The instances: one cache per list of prompts received, each served by a `PrefixService`
    on a loopback server of its own; their addresses are sent back."""
    from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
    from prfaas_jax.serving.transport.server import ServingServer, full_service_name
    from prfaas_jax.serving.worker.prefix import PrefixService

    servers = []
    for prompts in conn.recv():
        cache = PrefixCache(CFG, capacity_bytes=1 << 40, block_size=BLOCK, checkpoint_every=4)
        for prompt in prompts:  # what a prefill leaves: a state at every checkpoint length
            for length in cache.checkpoint_lengths(len(prompt)):
                arrays = [
                    (spec, np.zeros((*spec.shape, spec.itemsize), np.uint8))
                    for spec in canonical_tensors(CFG, length)
                ]
                cache._insert(prompt[:length], length, arrays)
        service = PrefixService(
            cfg=CFG, cache=cache, max_len=4096, frame_bytes=1 << 20, shaper=None
        )
        add = pb_grpc.add_PrefixCacheServicer_to_server
        servers.append(ServingServer([(add, service, full_service_name("PrefixCache"))]))
    conn.send([server.address for server in servers])
    conn.recv()  # until the router is done
    for server in servers:
        server.stop(grace_s=0.1)


def _config(directory: Path, cache_index: bool):
    path = directory / f"cluster-{cache_index}.toml"
    path.write_text(
        '[model]\npreset = "tiny"\nengine = "fake"\n'
        f"[prefix_cache]\nenabled = true\nblock_size = {BLOCK}\ncheckpoint_every = 4\n"
        f"[router]\ncache_index = {str(cache_index).lower()}\n"
    )
    return load_cluster_config(path)


def _time(core, prompts: list[list[int]]) -> tuple[list[dict], list[float], float]:
    answers, walls = [], []
    cpu = time.process_time()
    for prompt in prompts:
        start = time.perf_counter()
        answers.append(core._lookup(prompt))
        walls.append(time.perf_counter() - start)
    return answers, walls, time.process_time() - cpu


def run(instances: int, conversations: int, requests: int, rng: random.Random) -> dict:
    from prfaas_jax.serving.router.core import RouterCore

    system = [rng.randrange(CFG.vocab_size) for _ in range(SYSTEM)]
    histories = []
    for _ in range(instances):
        prompts, history = [], []
        for _ in range(conversations):
            turns = system[:]
            for _ in range(rng.randrange(1, 4)):
                turns = turns + [rng.randrange(CFG.vocab_size) for _ in range(TURN)]
                prompts.append(turns)
            history.append(turns)
        histories.append(prompts)
    requests_ = []
    for _ in range(requests):
        base = rng.choice(rng.choice(histories)) if rng.random() < 0.7 else system
        requests_.append(base + [rng.randrange(CFG.vocab_size) for _ in range(TURN)])

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    host = context.Process(target=_host, args=(theirs,), daemon=True)
    host.start()
    try:
        ours.send(histories)
        addresses = ours.recv()
        workers = {f"p{i}": (a, Role.PD_PREFILL) for i, a in enumerate(addresses)}
        with tempfile.TemporaryDirectory() as directory:
            fan_out = RouterCore(_config(Path(directory), False), CFG, workers)
            tracemalloc.start()
            built = time.perf_counter()
            indexed = RouterCore(_config(Path(directory), True), CFG, workers)
            feed = indexed.cache_feed
            while feed.stats().current < instances:
                if time.perf_counter() - built > 120:
                    raise SystemExit(f"{instances} instances: the index did not catch up")
                time.sleep(0.01)
            build_s = time.perf_counter() - built
            memory, _ = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            _time(indexed, requests_[:20])  # warm both: channels, first calls
            _time(fan_out, requests_[:20])
            by_index, index_walls, index_cpu = _time(indexed, requests_)
            by_fan_out, fan_walls, fan_cpu = _time(fan_out, requests_)
            stats = feed.stats()
            indexed.close()
            fan_out.close()
    finally:
        ours.send("done")
        host.join(timeout=30)
    if by_index != by_fan_out:
        raise SystemExit(f"{instances} instances: the index and the instances disagree")
    if stats.asked:
        raise SystemExit(f"{instances} instances: the index asked {stats.asked} times")

    def us(values: list[float], q: float | None = None) -> float:
        if q is None:
            return 1e6 * statistics.fmean(values)
        return 1e6 * float(np.quantile(values, q))

    return {
        "instances": instances,
        "index_us": us(index_walls),
        "index_p50_us": us(index_walls, 0.5),
        "index_p99_us": us(index_walls, 0.99),
        "index_cpu_us": 1e6 * index_cpu / requests,
        "fan_out_us": us(fan_walls),
        "fan_out_p50_us": us(fan_walls, 0.5),
        "fan_out_p99_us": us(fan_walls, 0.99),
        "fan_out_cpu_us": 1e6 * fan_cpu / requests,
        "ratio": statistics.fmean(fan_walls) / statistics.fmean(index_walls),
        "block_entries": stats.block_entries,
        "checkpoint_entries": stats.checkpoint_entries,
        "cached_prompts": sum(len(p) for p in histories),
        "index_memory_bytes": memory,
        "index_build_s": build_s,
        "mean_best_hit": float(np.mean([max(r.values()) for r in by_index])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=parse_int_list, default=[4, 16, 32, 64])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    counts = args.instances
    if not counts or min(counts) < 1 or args.conversations < 1 or args.requests < 21:
        parser.error("--instances and --conversations must be ≥ 1, --requests ≥ 21")
    rows = [run(n, args.conversations, args.requests, random.Random(n)) for n in counts]
    if not args.json:
        header = ["instances", "index µs/req", "p99", "CPU µs/req", "fan-out µs/req", "p99"]
        header += ["CPU µs/req", "fan-out / index", "(key, instance)", "index memory"]
        body = [
            [
                r["instances"],
                f"{r['index_us']:.0f}",
                f"{r['index_p99_us']:.0f}",
                f"{r['index_cpu_us']:.0f}",
                f"{r['fan_out_us']:.0f}",
                f"{r['fan_out_p99_us']:.0f}",
                f"{r['fan_out_cpu_us']:.0f}",
                f"{r['ratio']:.1f}×",
                r["block_entries"] + r["checkpoint_entries"],
                f"{r['index_memory_bytes'] / 2**20:.1f} MiB",
            ]
            for r in rows
        ]
        print(table(body, header, align="r" * len(header)))
    json.dump({"rows": rows}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
