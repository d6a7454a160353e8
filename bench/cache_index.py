"""The cluster-wide cache index against asking every instance, as the number of instances grows.

A router that asks each prefill instance's cache for a prompt's cached length pays one lookup per
instance per request (today: a ``PrefixCache.Lookup`` RPC each); the index
(policy/cache_index.py), kept from the caches' events, answers for all of them at once. This
times both sides in one process, without RPCs — the fan-out side is only the instances' own
``match`` calls, so it is the fan-out's floor — for ``N`` instances of the ``tiny`` preset's
cache layout (fake arrays: neither side reads values):

- every instance holds ``--conversations`` multi-turn conversations of its own, each opening with
  one system prompt shared cluster-wide (so every cache holds that prefix);
- the requests are the next turn of a random conversation (a long hit on one instance, the
  shared prefix on all) and fresh prompts (the shared prefix only).

Both sides must return the same lengths for every request (checked). Prints a table, then JSON:
µs per request for each side, their ratio, the index's entries (block and checkpoint keys and
(key, instance) pairs), and the events it took to build.

    python bench/cache_index.py [--instances 4,16,64,256,512] [--conversations 4]
                                [--requests 400] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import numpy as np

from prfaas_jax.cli.flags import parse_int_list
from prfaas_jax.config import load_model_config
from prfaas_jax.engine.codec.layout import canonical_tensors
from prfaas_jax.engine.prefix_cache import PrefixCache
from prfaas_jax.policy.cache_index import CacheIndex
from prfaas_jax.tables import table

CFG = load_model_config("tiny")
BLOCK, SYSTEM, TURN = 16, 256, 96


def _insert(cache: PrefixCache, tokens: list[int]) -> None:
    for length in cache.checkpoint_lengths(len(tokens)):
        arrays = [
            (spec, np.zeros((*spec.shape, spec.itemsize), np.uint8))
            for spec in canonical_tensors(CFG, length)
        ]
        cache._insert(tokens[:length], length, arrays)


def run(instances: int, conversations: int, requests: int, rng: random.Random) -> dict:
    system = [rng.randrange(CFG.vocab_size) for _ in range(SYSTEM)]
    caches = {
        f"p{i}": PrefixCache(CFG, capacity_bytes=1 << 40, block_size=BLOCK, checkpoint_every=4)
        for i in range(instances)
    }
    index = CacheIndex(BLOCK)
    for name, cache in caches.items():
        index.reset(name, *cache.snapshot())
    history = []
    for cache in caches.values():
        for _ in range(conversations):
            turns = system[:]
            for _ in range(rng.randrange(1, 4)):
                turns += [rng.randrange(CFG.vocab_size) for _ in range(TURN)]
                _insert(cache, turns)
            history.append(turns)
    events = 0
    for name, cache in caches.items():
        for seq, event in cache.events_since(0):
            index.apply(name, seq, event)
            events += 1
    prompts = []
    for _ in range(requests):
        base = rng.choice(history) if rng.random() < 0.7 else system[:]
        prompts.append(base + [rng.randrange(CFG.vocab_size) for _ in range(TURN)])

    def fan_out(prompt):
        hits = {name: cache.match(prompt, record=False) for name, cache in caches.items()}
        return {name: 0 if hit is None else hit.length for name, hit in hits.items()}

    start = time.perf_counter()
    by_index = [index.cached_lengths(p) for p in prompts]
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    by_fan_out = [fan_out(p) for p in prompts]
    fan_out_s = time.perf_counter() - start
    if by_index != by_fan_out:
        raise SystemExit(f"{instances} instances: the index and the caches disagree")
    stats = index.stats()
    return {
        "instances": instances,
        "index_us": 1e6 * index_s / requests,
        "fan_out_us": 1e6 * fan_out_s / requests,
        "ratio": fan_out_s / index_s,
        "block_keys": stats.block_keys,
        "block_entries": stats.block_entries,
        "checkpoint_entries": stats.checkpoint_entries,
        "events": events,
        "mean_best_hit": float(np.mean([max(r.values()) for r in by_index])),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=parse_int_list, default=[4, 16, 64, 256, 512])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    counts = args.instances
    if not counts or min(counts) < 1 or args.conversations < 1 or args.requests < 1:
        parser.error("--instances, --conversations and --requests must be ≥ 1")
    rows = [run(n, args.conversations, args.requests, random.Random(n)) for n in counts]
    if not args.json:
        header = ["instances", "index µs/req", "fan-out µs/req", "fan-out / index", "blocks"]
        header += ["(block, instance)", "(checkpoint, instance)", "events", "mean best hit"]
        body = [
            [
                r["instances"],
                f"{r['index_us']:.0f}",
                f"{r['fan_out_us']:.0f}",
                f"{r['ratio']:.1f}×",
                r["block_keys"],
                r["block_entries"],
                r["checkpoint_entries"],
                r["events"],
                f"{r['mean_best_hit']:.0f}",
            ]
            for r in rows
        ]
        print(table(body, header, align="r" * len(header)))
    json.dump({"rows": rows}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
