"""The router's cache index (`[router] cache_index`, serving/router/cache_feed.py) against the
fan-out lookup it replaces, in process: fake engines that check every state byte, a real
prefix cache per prefill instance (prfaas-0; pd-0 and pd-2), one decode instance (pd-1).

* No eviction racing: two workloads — interleaved multi-turn conversations, and a skewed one
  (most requests share one long system prompt) — run once with the index and once asking
  every instance. Before each request the index is let catch up with every cache, so the
  precondition holds by construction. Every request's cached lengths (every instance's, not
  only the chosen one's) equal a fan-out lookup made at the same moment, every answer came from
  the index (none asked), and the two runs route every request the same way with the same
  cached length.
* Evictions racing: caches too small to hold the conversations, requests in parallel, no
  waiting; every output is still the fake engine's exact answer at the first attempt.
* An index that went wrong (eviction events withheld from it) routes to a prefix that is gone:
  the prefill recomputes, the output is right, the router counts the overestimate and a fresh
  snapshot puts the index right.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator

from serving_support import fake_config, generate, serve_in_process, wait_for

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.policy.routing import Role
from prfaas_jax.prefix_events import BlockEvicted, CheckpointEvicted
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.router.handles import lookup_prefixes

CFG = load_model_config("tiny")
VOCAB = CFG.vocab_size
REPLY = 4
PREFILL = ("prfaas-0", "pd-0", "pd-2")


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 17 * i + i * i) % VOCAB for i in range(n)]


def multi_turn() -> list[tuple[int, list[int]]]:
    """Five conversations of three turns, interleaved: (conversation, new tokens of the turn)."""
    first = {c: tokens(n, c) for c, n in enumerate((30, 70, 100, 140, 50))}
    return [
        (c, first[c] if turn == 0 else tokens(6 + 5 * turn + c, 100 + 10 * c + turn))
        for turn in range(3)
        for c in first
    ]


def skewed() -> list[tuple[int, list[int]]]:
    """The 128-token system prompt alone, then twelve requests that extend it, three without
    it. (The fake engine prefills in one chunk, so its cache checkpoints whole prompts only.)"""
    system = tokens(128, 7)
    shared = [(i, system + tokens(8 + 3 * i, 50 + i)) for i in range(12)]
    shared[0] = (0, system)
    alone = [(12 + i, tokens(40 + 30 * i, 80 + i)) for i in range(3)]
    return shared[:4] + alone[:1] + shared[4:8] + alone[1:] + shared[8:]


@contextlib.contextmanager
def cluster(tmp_path, *, cache_index: bool, capacity_mib: float = 16.0) -> Iterator:
    path = fake_config(
        tmp_path / f"cluster-{cache_index}.toml",
        instances={"prfaas_prefill": 1, "pd_prefill": 2, "pd_decode": 1},
        prefix_cache={"enabled": True, "capacity_mib": capacity_mib, "block_size": 8},
        router={"cache_index": cache_index},
    )
    config = load_cluster_config(path)
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(CFG)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(CFG)),
        "pd-2": (Role.PD_PREFILL, FakePrefillEngine(CFG)),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=8, max_len=512)),
    }
    with serve_in_process(config, engines, prefix_caches=True) as running:
        yield running


def in_step(running) -> bool:
    feed = running.core.cache_feed
    return all(
        feed.index.is_current(name)
        and feed.index.last_seq(name) == running.prefixes[name].cache.events.last_seq
        for name in PREFILL
    )


def serve(running, workload, *, shadow: list | None = None) -> list[tuple]:
    """Each request of `workload` in turn (a conversation's next turn extends its last prompt
    and reply); the routes. With `shadow`, each lookup is also made by fan-out, beside it."""
    core = running.core
    if shadow is not None:
        indexed = core._lookup

        def both(prompt):
            answer = indexed(prompt)
            stubs = {name: core.workers[name].prefix for name in answer}
            shadow.append((answer, lookup_prefixes(stubs, prompt)))
            return answer

        core._lookup = both
    history: dict[int, list[int]] = {}
    routes = []
    for conversation, new in workload:
        prompt = history.get(conversation, []) + new
        if core.cache_feed is not None:
            assert wait_for(lambda: in_step(running))  # no event in flight: no race
        reply = generate(running.router, prompt, REPLY)
        assert reply.tokens == fake_tokens(prompt, REPLY, VOCAB)
        report = reply.report
        assert report.attempts == 1
        routes.append((report.route, report.prefill_instance, report.cached_len))
        history[conversation] = prompt + reply.tokens
    return routes


def check_equal_to_fan_out(tmp_path, workload) -> list[tuple]:
    shadow: list = []
    with cluster(tmp_path, cache_index=True) as running:
        indexed = serve(running, workload, shadow=shadow)
        stats = running.stats().cache_index
        assert all(p.cache.stats.evictions == 0 for p in running.prefixes.values())
    assert [answer for answer, _ in shadow] == [fanned for _, fanned in shadow]
    assert stats.enabled and (stats.instances, stats.current) == (3, 3)  # pd-1: no cache
    assert (stats.answered, stats.asked) == (len(PREFILL) * len(workload), 0)
    assert stats.overestimates == 0 and stats.events > 0
    with cluster(tmp_path, cache_index=False) as running:
        asked = serve(running, workload)
        assert not running.stats().cache_index.enabled
    assert indexed == asked
    return indexed


def test_multi_turn_routes_equal_the_fan_out_lookup(tmp_path):
    routes = check_equal_to_fan_out(tmp_path, multi_turn())
    assert sum(cached > 0 for _, _, cached in routes) >= 8  # the later turns hit
    assert {route for route, _, _ in routes} == {"prfaas", "pd"}


def test_skewed_cache_routes_equal_the_fan_out_lookup(tmp_path):
    routes = check_equal_to_fan_out(tmp_path, skewed())
    assert sum(cached >= 128 for _, _, cached in routes) >= 8  # the system prompt is reused


def test_outputs_stay_exact_with_evictions_racing_the_index(tmp_path):
    workload = multi_turn() * 2  # each conversation twice as long
    with cluster(tmp_path, cache_index=True, capacity_mib=0.05) as running:
        history: dict[int, list[int]] = {}

        def conversation(c: int) -> int:
            for _, new in [item for item in workload if item[0] == c]:
                prompt = history.get(c, []) + new
                reply = generate(running.router, prompt, REPLY)
                assert reply.tokens == fake_tokens(prompt, REPLY, VOCAB)
                assert reply.report.attempts == 1
                history[c] = prompt + reply.tokens
            return len(history[c])

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            assert all(pool.map(conversation, range(5)))
        evictions = sum(p.cache.stats.evictions for p in running.prefixes.values())
        stats = running.stats()
    assert evictions > 0
    assert stats.requests_failed == 0 and stats.retries == 0
    assert stats.cache_index.answered > 0


def test_a_wrong_index_costs_a_recompute_and_is_put_right(tmp_path):
    with cluster(tmp_path, cache_index=True) as running:
        feed = running.core.cache_feed
        apply = feed.index.apply

        def without_evictions(instance, seq, event):  # an index that misses evictions
            if isinstance(event, BlockEvicted | CheckpointEvicted):
                feed.index._instances[instance].seq = seq
                return True
            return apply(instance, seq, event)

        feed.index.apply = without_evictions
        first = tokens(100, 3)
        reply = generate(running.router, first, REPLY)
        assert reply.report.prefill_instance == "prfaas-0"
        assert wait_for(lambda: in_step(running))
        # prfaas-0 loses everything; the index, blind to evictions, still holds the prompt.
        cache = running.prefixes["prfaas-0"].cache
        with cache._lock:
            cache.stats.capacity_bytes = 0
            cache._evict()
        assert cache.stats.blocks == 0
        assert wait_for(lambda: in_step(running))
        second = first + reply.tokens + tokens(12, 4)
        assert feed.lookup(second, {"prfaas-0": running.core.workers["prfaas-0"].prefix}) == {
            "prfaas-0": 100
        }
        cache.stats.capacity_bytes = 1 << 24
        reply = generate(running.router, second, REPLY)
        assert reply.tokens == fake_tokens(second, REPLY, VOCAB)
        assert (reply.report.attempts, reply.report.cached_len) == (1, 0)
        stats = running.stats().cache_index
        assert stats.overestimates == 1
        # The resync: a fresh snapshot, and the index agrees with the cache again.
        assert wait_for(lambda: feed.counters.snapshots >= 4 and in_step(running))
        probe = [*second, 1]
        stubs = {name: running.core.workers[name].prefix for name in PREFILL}
        assert feed.lookup(probe, stubs) == lookup_prefixes(stubs, probe)
