"""The front door's ``usage.prompt_tokens_details.cached_tokens`` (the prompt tokens the cluster
served from a prefix cache, as the router counted them) and its ``GET /metrics``.

An in-process cluster of fake engines with prefix caches (`serve_in_process`) and the router's
Prometheus endpoint, the front door on loopback in front of them, the `openai` SDK as the
client. The oracles: the router's own accounting (`GetStats`: the growth of its
`cached_tokens` over a finished request), the cache's rule — the fake engine prefills a prompt
in one chunk, so its cache holds whole prompts, and a follow-up reuses exactly the prompt before
it — and, for the exposition, prometheus_client's parser against the requests sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import openai
import pytest
from serving_support import (
    fake_config,
    fake_instances,
    parse_metrics,
    sample,
    scrape_metrics,
    serve_in_process,
)

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, fake_tokens
from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.frontdoor.app import FrontDoor, FrontDoorServer
from prfaas_jax.serving.frontdoor.metrics import FrontDoorMetrics
from prfaas_jax.serving.router.control import RouterControl
from prfaas_jax.serving.router.metrics import MetricsServer

CFG = load_model_config("tiny")
MODEL = "tiny"
TOKENIZER = ByteTokenizer()
SYSTEM = "You answer questions about the shared prefix. " * 3  # 141 bytes: the PrfaaS route


@dataclasses.dataclass
class Door:
    client: openai.OpenAI
    address: str  # the front door's host:port
    router_count: Callable[[], int]  # the router's cached tokens (GetStats)


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """The front door over a fake cluster with prefix caches and the router's metrics."""
    path = fake_config(
        tmp_path_factory.mktemp("cached") / "cluster.toml",
        prefix_cache={"enabled": True, "capacity_mib": 16.0, "block_size": 8},
    )
    config = load_cluster_config(path)
    engines = fake_instances(CFG)  # a decode step of 5 ms: a reply streams in several messages
    engines["pd-1"] = (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=512, step_s=5e-3))
    with serve_in_process(config, engines, prefix_caches=True) as cluster:
        metrics = MetricsServer(RouterControl(cluster.core).snapshot)
        front = FrontDoor(
            cluster.servers["router"].address, model=MODEL, vocab_size=CFG.vocab_size,
            max_len=512, router_metrics=metrics.address,
        )  # fmt: skip
        try:
            with FrontDoorServer(front) as server:
                client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0)
                yield Door(client, server.address, lambda: cluster.stats().cached_tokens)
        finally:
            metrics.stop()


def _create(client, prompt: str, stream: bool, **knobs):
    """The reply's text and usage, streamed (with the usage chunk) or not."""
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **knobs}
    if not stream:
        reply = client.completions.create(**kwargs)
        return reply.choices[0].text, reply.usage
    options = {"include_usage": True}
    chunks = list(client.completions.create(stream=True, stream_options=options, **kwargs))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_what_the_router_counted(cached, stream):
    client, router_count = cached.client, cached.router_count
    first = SYSTEM + ("streamed" if stream else "whole")
    before = router_count()
    _, usage = _create(client, first, stream)
    assert usage.prompt_tokens_details.cached_tokens == router_count() - before == 0
    follow_up = first + " and a question that extends it"
    before = router_count()
    text, usage = _create(client, follow_up, stream)
    reused = router_count() - before
    assert usage.prompt_tokens_details.cached_tokens == reused
    assert reused == len(TOKENIZER.encode(first))
    assert text == TOKENIZER.decode(fake_tokens(TOKENIZER.encode(follow_up), 8, CFG.vocab_size))


def test_a_reply_cut_by_a_stop_string_reports_the_cached_prefix_as_routed(cached):
    """The stop cancels the router call before its final report (the router counts no reuse of
    a cancelled request): the count comes from the routing report of the first message with
    tokens."""
    client = cached.client
    prompt = SYSTEM + "stopped early"
    _create(client, prompt, False)
    follow_up = prompt + ", then again"
    full = TOKENIZER.decode(fake_tokens(TOKENIZER.encode(follow_up), 40, CFG.vocab_size))
    stop = full[20:22]
    text, usage = _create(client, follow_up, True, max_tokens=40, stop=stop)
    assert text == full[: full.index(stop)] and usage.completion_tokens < 40
    assert usage.prompt_tokens_details.cached_tokens == len(TOKENIZER.encode(prompt))


def _scrape(address: str) -> dict:
    kind, text = scrape_metrics(address)
    assert kind.startswith("text/plain; version=0.0.4")
    return parse_metrics(text)[1]


def test_metrics_beside_the_api_count_its_requests_then_show_the_routers(cached):
    def answered(samples, status: str) -> float:
        labels = {"endpoint": "/v1/completions", "status": status}
        return samples.get(("prfaas_frontdoor_requests_total", frozenset(labels.items())), 0.0)

    before = _scrape(cached.address)
    for _ in range(2):
        _create(cached.client, "counted", False)
    with pytest.raises(openai.NotFoundError):
        cached.client.completions.create(model="other", prompt="hi", max_tokens=2)
    after = _scrape(cached.address)
    assert answered(after, "200") - answered(before, "200") == 2
    assert answered(after, "404") - answered(before, "404") == 1
    assert sample(after, "prfaas_frontdoor_router_metrics_up") == 1
    # The router's own series follow, as its GetStats counts them.
    assert sample(after, "prfaas_cached_tokens_total") == cached.router_count()


def test_without_the_routers_endpoint_the_metrics_say_so():
    lost = FrontDoorMetrics("127.0.0.1:1")  # nothing listens on port 1
    for metrics, why in ((FrontDoorMetrics(), b"is not known"), (lost, b"did not answer")):
        text = asyncio.run(metrics.render())
        assert why in text
        assert sample(parse_metrics(text.decode())[1], "prfaas_frontdoor_router_metrics_up") == 0
