"""The OpenAI-compatible front door (serving/frontdoor) over an in-process fake cluster.

The router and its fake-engine workers run in this process (`serve_in_process`, t = 64), the
front door on uvicorn on loopback in front of them, and real clients drive it: the `openai`
SDK (streaming and not, completions and chat) and raw HTTP for the SSE framing benchmark clients
parse. The fake engines' tokens are computable by hand (`fake_tokens`), so every reply is held
against the byte tokenizer's decoding of exactly those tokens, and its usage against the
prompt's length and the budget.
"""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from serving_support import fake_config, fake_instances, serve_in_process

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.engine.tokenizer import ByteTokenizer
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.frontdoor.app import FrontDoor, FrontDoorServer
from prfaas_jax.serving.frontdoor.openai_api import chat_prompt

CFG = load_model_config("tiny")
MODEL = "tiny"
MAX_LEN = 512
TOKEN = "s3cret-token"
TOKENIZER = ByteTokenizer()


def expected_text(prompt_ids: list[int], n: int) -> str:
    return TOKENIZER.decode(fake_tokens(prompt_ids, n, CFG.vocab_size))


ROUTER: dict[str, str] = {}  # the front door's address → its router's


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    """The front door's address, over a cluster of fake engines (no token)."""
    config = load_cluster_config(fake_config(tmp_path_factory.mktemp("oai") / "cluster.toml"))
    with serve_in_process(config, fake_instances(CFG, max_len=MAX_LEN)) as cluster:
        router = cluster.servers["router"].address
        front = FrontDoor(router, model=MODEL, vocab_size=CFG.vocab_size, max_len=MAX_LEN)
        with FrontDoorServer(front) as server:
            ROUTER[server.address] = router
            yield server.address


@pytest.fixture(scope="module")
def client(door):
    return openai.OpenAI(base_url=f"http://{door}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("prompt", ["Hello, PrfaaS!", "x" * 100])  # PD and PrfaaS routes
def test_sdk_completion_equals_the_models_tokens_decoded(client, prompt):
    ids = TOKENIZER.encode(prompt)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected_text(ids, 12)
    assert reply.choices[0].finish_reason == "length"
    assert reply.object == "text_completion" and reply.model == MODEL
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 12)
    assert usage.total_tokens == len(ids) + 12


def test_a_seeded_reply_is_its_seeds_tokens_and_an_unseeded_one_names_its_seed(client):
    prompt = "x" * 90  # the PrfaaS route
    ids = TOKENIZER.encode(prompt)
    knobs = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.8, "top_p": 0.9}
    reply = client.completions.create(seed=77, **knobs)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=77)
    assert reply.choices[0].text == TOKENIZER.decode(fake_tokens(ids, 16, CFG.vocab_size, sampling))
    assert reply.choices[0].text != expected_text(ids, 16) and reply.seed == 77
    fresh = [client.completions.create(**knobs) for _ in range(2)]
    assert fresh[0].seed != fresh[1].seed
    for unseeded in fresh:
        replay = client.completions.create(seed=unseeded.seed, **knobs)
        assert replay.choices[0].text == unseeded.choices[0].text
    chunks = list(client.completions.create(seed=77, stream=True, **knobs))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert {c.seed for c in chunks} == {77}


def fake_scores(ids: list[int], n: int, sampling: SamplingParams, top: int) -> list:
    """The fake model's `TokenLogprobs` of ``ids`` and its ``n`` tokens with ``sampling``."""
    tokens = fake_tokens(ids, n, CFG.vocab_size, sampling)
    return FakePrefillEngine(CFG).score(ids + tokens, top=top)


def test_echo_and_logprobs_are_the_models_log_probabilities(client):
    prompt = "score this prompt"
    ids = TOKENIZER.encode(prompt)
    reply = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    choice = reply.choices[0]
    assert choice.text == prompt + expected_text(ids, 3)
    scored = fake_scores(ids, 3, SamplingParams(), top=2)
    lp = choice.logprobs
    assert lp.tokens == [TOKENIZER.decode([t]) for t in ids + [s.token for s in scored[-3:]]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([s.logprob for s in scored], abs=1e-5)
    for got, want in zip(lp.top_logprobs[1:], scored, strict=True):
        alternatives = {}
        for token, value in want.top:
            alternatives.setdefault(TOKENIZER.decode([token]), value)
        assert got == pytest.approx(alternatives, abs=1e-5)
    assert lp.text_offset[:3] == [0, 1, 2]
    # Without echo, only the new tokens; with echo alone, the prompt's text and no numbers.
    plain = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=0
    ).choices[0]
    assert plain.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[-3:], abs=1e-6)
    assert plain.logprobs.top_logprobs == [{}, {}, {}]
    echoed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True
    ).choices[0]
    assert echoed.text == choice.text and echoed.logprobs is None


def test_a_streamed_reply_carries_its_tokens_logprobs_chunk_by_chunk(client):
    prompt = "stream the scores " * 5  # the PrfaaS route
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    pieces = [c.choices[0].logprobs for c in chunks]
    assert [t for p in pieces for t in p.tokens] == whole.tokens
    assert [v for p in pieces for v in p.token_logprobs] == whole.token_logprobs
    assert [d for p in pieces for d in p.top_logprobs] == whole.top_logprobs
    assert [o for p in pieces for o in p.text_offset] == whole.text_offset
    messages = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": messages, "max_tokens": 5, "temperature": 0}
    content = client.chat.completions.create(logprobs=True, top_logprobs=1, **chat)
    streamed = client.chat.completions.create(logprobs=True, top_logprobs=1, stream=True, **chat)
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    assert entries == content.choices[0].logprobs.content


def test_n_best_of_and_several_prompts(client):
    ids = [TOKENIZER.encode(p) for p in ("first prompt", "the second one")]
    knobs = {"model": MODEL, "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 40}
    reply = client.completions.create(prompt=[TOKENIZER.decode(i) for i in ids], n=2, **knobs)
    seeds = [SamplingParams(temperature=0.8, top_p=0.9, seed=40 + k) for k in range(3)]
    want = [TOKENIZER.decode(fake_tokens(p, 6, CFG.vocab_size, s)) for p in ids for s in seeds[:2]]
    assert [c.text for c in reply.choices] == want
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert reply.usage.completion_tokens == 24
    # best_of 3, n 1: the choice whose tokens have the highest mean log-probability.
    best = client.completions.create(prompt=ids[0], n=1, best_of=3, **knobs)

    def mean(sampling):
        return np.mean([s.logprob for s in fake_scores(ids[0], 6, sampling, 0)[-6:]])

    winner = max(seeds, key=mean)
    assert best.choices[0].text == TOKENIZER.decode(fake_tokens(ids[0], 6, CFG.vocab_size, winner))
    assert best.choices[0].logprobs is None  # scored to rank them, not asked for


def test_chat_logprobs_list_each_token_with_its_alternatives(client):
    messages = [{"role": "user", "content": "hi"}]
    ids = TOKENIZER.encode(chat_prompt(messages))
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    scored = fake_scores(ids, 4, SamplingParams(), top=3)[-4:]
    assert [c.token for c in content] == [TOKENIZER.decode([s.token]) for s in scored]
    assert [c.logprob for c in content] == pytest.approx([s.logprob for s in scored], abs=1e-5)
    assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        pytest.approx([v for _, v in s.top], abs=1e-5) for s in scored
    ]


def test_sdk_stream_pieces_join_to_the_same_text_with_usage_last(client):
    prompt = "stream me " * 9
    ids = TOKENIZER.encode(prompt)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == expected_text(ids, 20)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_sdk_chat_uses_the_documented_template(client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    ids = TOKENIZER.encode("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n")
    assert TOKENIZER.encode(chat_prompt(messages)) == ids
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=9, temperature=0
    )
    assert reply.choices[0].message.content == expected_text(ids, 9)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected_text(ids, 9)


def test_a_stop_string_ends_the_text_before_it(client):
    ids = TOKENIZER.encode("find the stop")
    full = expected_text(ids, 40)
    stop = full[17:19]  # two characters from the middle of the reply
    cut = full.index(stop)
    for stream in (False, True):
        kwargs = {"model": MODEL, "prompt": "find the stop", "max_tokens": 40, "temperature": 0}
        if stream:
            chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            reply = client.completions.create(stop=stop, **kwargs)
            text, finish = reply.choices[0].text, reply.choices[0].finish_reason
        assert (text, finish) == (full[:cut], "stop")


EOS_PROMPT = "end of sequence"
EOS_AT = 5  # the fake model's 6th token is the end-of-sequence id of `EosTokenizer`


class EosTokenizer(ByteTokenizer):
    """The byte tokenizer with an end-of-sequence id: one the fake model makes for EOS_PROMPT
    at position EOS_AT, and not before."""

    eos_ids = frozenset({fake_tokens(TOKENIZER.encode(EOS_PROMPT), 40, CFG.vocab_size)[EOS_AT]})


def test_the_eos_id_of_this_prompt_comes_first_at_its_position():
    tokens = fake_tokens(TOKENIZER.encode(EOS_PROMPT), 40, CFG.vocab_size)
    assert tokens.index(next(iter(EosTokenizer.eos_ids))) == EOS_AT


@pytest.fixture(scope="module")
def eos_client(door):
    """A second front door on the same cluster, serving with `EosTokenizer`."""
    front = FrontDoor(
        ROUTER[door], model=MODEL, vocab_size=CFG.vocab_size, max_len=MAX_LEN,
        tokenizer=EosTokenizer(),
    )  # fmt: skip
    with FrontDoorServer(front) as server:
        yield openai.OpenAI(base_url=f"http://{server.address}/v1", api_key="-", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_end_of_sequence_id_ends_the_reply_counted_not_shown(eos_client, stream):
    ids = TOKENIZER.encode(EOS_PROMPT)
    tokens = fake_tokens(ids, 40, CFG.vocab_size)
    kwargs = {"model": MODEL, "prompt": EOS_PROMPT, "max_tokens": 40, "temperature": 0}
    if stream:
        options = {"include_usage": True}
        chunks = list(eos_client.completions.create(stream=True, stream_options=options, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        reply = eos_client.completions.create(**kwargs)
        text, finish, usage = reply.choices[0].text, reply.choices[0].finish_reason, reply.usage
    assert (text, finish) == (TOKENIZER.decode(tokens[:EOS_AT]), "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), EOS_AT + 1)
    # ignore_eos (vLLM's extension, which benchmark clients send) runs to the budget.
    reply = eos_client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    assert reply.choices[0].text == TOKENIZER.decode(tokens)
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 40)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def _post(door: str, path: str, body: object, headers: dict | None = None):
    host, port = door.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, raw, {"content-type": "application/json", **(headers or {})})
    reply = connection.getresponse()
    return reply.status, reply.getheader("content-type"), reply.read().decode()


def test_sse_framing_is_what_benchmark_clients_parse(door):
    """`data: <json>` events split by blank lines, the usage chunk, then `data: [DONE]`."""
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    status, kind, text = _post(door, "/v1/completions", body, {"x-request-id": "bench-1"})
    assert status == 200 and kind.startswith("text/event-stream")
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"cmpl-bench-1"}
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},  # no prefix cache in this cluster
    }
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected_text([5, 6, 7], 6)
    # Every chunk with choices carries text (each is a client's inter-token sample); the last
    # also carries the finish reason, as the router's last message carries the last tokens.
    assert all(c["choices"][0]["text"] for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"


BAD_BODIES = [
    (b"{not json", None),
    ([1, 2], None),
    ({"prompt": "hi", "max_tokens": 2}, "model"),
    ({"model": MODEL, "max_tokens": 2}, "prompt"),
    ({"model": MODEL, "prompt": "", "max_tokens": 2}, "prompt"),
    ({"model": MODEL, "prompt": ["a", ""], "max_tokens": 2}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], [3.5]], "max_tokens": 2}, "prompt"),
    ({"model": MODEL, "prompt": [1, 999], "max_tokens": 2}, "prompt"),
    ({"model": MODEL, "prompt": "x" * 600, "max_tokens": 2}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": -3}, "seed"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": ["a"] * 5}, "stop"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 0}, "n"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 17}, "n"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 3, "best_of": 2}, "best_of"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "logprobs": -1}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2, "stream": True}, "stream"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": True, "stream": True}, "stream"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": "yes"}, "stream"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_malformed_requests_are_400_in_openai_shape(door, body, param):
    status, kind, text = _post(door, "/v1/completions", body)
    assert status == 400 and kind == "application/json"
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_a_bad_chat_and_a_bad_request_id_are_400(door):
    status, _, text = _post(door, "/v1/chat/completions", {"model": MODEL, "messages": []})
    assert status == 400 and json.loads(text)["error"]["param"] == "messages"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for name in ("max_tokens", "max_completion_tokens"):
        status, _, text = _post(door, "/v1/chat/completions", {**chat, name: 10**6})
        error = json.loads(text)["error"]
        assert (status, error["param"], error["code"]) == (400, name, "context_length_exceeded")
    status, _, text = _post(door, "/v1/chat/completions", {**chat, "messages": [{"role": "x"}]})
    assert status == 400 and json.loads(text)["error"]["param"] == "messages[0]"
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"),
                         ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"logprobs": 2}, "logprobs")):  # fmt: skip
        status, _, text = _post(door, "/v1/chat/completions", {**chat, **extra})
        assert status == 400 and json.loads(text)["error"]["param"] == param, extra
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    status, _, text = _post(door, "/v1/completions", body, {"x-request-id": "a" * 300})
    assert status == 400 and json.loads(text)["error"]["param"] == "x-request-id"


def test_a_body_larger_than_any_valid_request_is_413(door):
    body = {"model": MODEL, "prompt": "x" * (16 * MAX_LEN + 65536), "max_tokens": 2}
    status, _, text = _post(door, "/v1/completions", body)
    assert status == 413 and "request body is over" in json.loads(text)["error"]["message"]


def test_an_unknown_path_is_404_in_openai_shape(door):
    status, kind, text = _post(door, "/v1/embeddings", {"model": MODEL, "input": "hi"})
    assert status == 404 and kind == "application/json"
    assert "no such endpoint" in json.loads(text)["error"]["message"]


@pytest.mark.parametrize("chat", [False, True])
def test_an_unknown_model_is_404_model_not_found_as_openai_answers(client, chat):
    with pytest.raises(openai.NotFoundError) as raised:
        if chat:
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="other", messages=messages, max_tokens=2)
        else:
            client.completions.create(model="other", prompt="hi", max_tokens=2)
    assert raised.value.status_code == 404
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    assert raised.value.type == "invalid_request_error"


def test_the_cluster_keeps_serving_after_refusals(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-5)
    reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
    assert reply.choices[0].text == expected_text(TOKENIZER.encode("hi"), 3)


def test_a_token_is_required_when_set(door):
    router_door = FrontDoor(
        "127.0.0.1:1", model=MODEL, vocab_size=CFG.vocab_size, max_len=MAX_LEN, token=TOKEN
    )
    with FrontDoorServer(router_door) as server:
        url = f"http://{server.address}/v1"
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=url, api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as err:
                bad.models.list()
            assert err.value.status_code == 401
        good = openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0)
        assert [m.id for m in good.models.list()] == [MODEL]
        # The token passes; the router there is not: 503 in OpenAI's shape.
        with pytest.raises(openai.APIStatusError) as err:
            good.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503


def test_bench_through_the_front_door_counts_what_the_grpc_bench_counts(door):
    """`prfaas bench --openai URL`: the same seeded workload through the front door and
    straight to the router completes alike — every request, every output token (from the usage
    chunks), the same share offloaded (prompts past t = 64 go to PrfaaS) — with TTFT and ITL
    timed from the SSE stream."""
    from prfaas_jax.serving.loadgen.bench import BenchOptions, run_bench
    from prfaas_jax.serving.loadgen.bench_report import summarize

    router = ROUTER[door]
    common = {"num_prompts": 12, "input_dist": "uniform", "input_len": 64, "output_len": 5}
    grpc_opts = BenchOptions(router=router, **common)
    http_opts = BenchOptions(router=router, openai_url=f"http://{door}/v1", **common)
    grpc_records, grpc_context = run_bench(grpc_opts)
    http_records, http_context = run_bench(http_opts)
    grpc_run = summarize(grpc_records, grpc_context, grpc_opts)
    http_run = summarize(http_records, http_context, http_opts)
    assert http_run["completed"] == grpc_run["completed"] == 12 and http_run["failed"] == 0
    assert [r.output_tokens for r in http_records] == [5] * 12
    assert [r.prompt_len for r in http_records] == [r.prompt_len for r in grpc_records]
    past_t = sum(r.prompt_len > 64 for r in http_records) / 12
    assert 0 < past_t < 1
    assert http_run["offload_fraction"] == grpc_run["offload_fraction"] == past_t
    for r in http_records:  # the chunks' arrival times: TTFT, then the gaps, within E2EL
        assert 0 < r.ttft <= r.e2el and min(r.itl, default=0) >= 0
        assert r.ttft + sum(r.itl) <= r.e2el


class GatedPrefill(FakePrefillEngine):
    """The fake prefill engine, holding each prompt until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__(CFG)
        self.entered, self.gate = threading.Event(), threading.Event()

    def prefill(self, tokens, **options):
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().prefill(tokens, **options)


def test_admission_refusal_is_429_and_a_busy_request_id_409(tmp_path):
    """With `[router] max_in_flight = 1` and one request held in prefill, a second is refused
    at once: 429 in OpenAI's shape (the SDK's RateLimitError); the same x-request-id as the
    held one is 409. The held request then completes with its tokens."""
    path = fake_config(tmp_path / "cluster.toml", router={"max_in_flight": 1})
    gated = GatedPrefill()
    instances = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(CFG)),
        "pd-0": (Role.PD_PREFILL, gated),
        "pd-1": (Role.PD_DECODE, FakeDecodeEngine(CFG, max_slots=4, max_len=MAX_LEN)),
    }
    with serve_in_process(load_cluster_config(path), instances) as cluster:
        router = cluster.servers["router"].address
        front = FrontDoor(router, model=MODEL, vocab_size=CFG.vocab_size, max_len=MAX_LEN)
        with FrontDoorServer(front) as server, ThreadPoolExecutor(1) as pool:
            url = f"http://{server.address}/v1"
            client = openai.OpenAI(base_url=url, api_key="-", max_retries=0)
            ask = {"model": MODEL, "prompt": "held", "max_tokens": 4, "temperature": 0}
            held = pool.submit(
                client.completions.create, **ask, extra_headers={"x-request-id": "r1"}
            )
            assert gated.entered.wait(30)
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(**ask)
            assert refused.value.body["type"] == "rate_limit_error"
            status, _, text = _post(server.address, "/v1/completions", ask, {"x-request-id": "r1"})
            error = json.loads(text)["error"]
            assert (status, error["code"]) == (409, "ALREADY_EXISTS") and "r1" in error["message"]
            gated.gate.set()
            assert held.result(timeout=30).choices[0].text == expected_text(
                TOKENIZER.encode("held"), 4
            )


class DyingDecode(FakeDecodeEngine):
    """The fake decode engine, whose every step after the first `steps` raises."""

    def __init__(self, steps: int) -> None:
        super().__init__(CFG, max_slots=4, max_len=MAX_LEN, step_s=0.01)
        self.steps = steps

    def step(self):
        self.steps -= 1
        if self.steps < 0:
            raise RuntimeError("injected decode fault")
        return super().step()


def test_a_failure_after_the_first_token_is_an_error_event_that_ends_the_stream(tmp_path):
    """The 200 is gone once text streams: a router that gives up mid-stream (one attempt, the
    decode engine failing after 3 steps) reaches the client as an OpenAI error object in a last
    `data:` event, after text that is a prefix of the reply, and without `[DONE]`."""
    path = fake_config(tmp_path / "cluster.toml", router={"max_attempts": 1})
    instances = {
        "prfaas-0": (Role.PRFAAS_PREFILL, FakePrefillEngine(CFG)),
        "pd-0": (Role.PD_PREFILL, FakePrefillEngine(CFG)),
        "pd-1": (Role.PD_DECODE, DyingDecode(steps=3)),
    }
    with serve_in_process(load_cluster_config(path), instances) as cluster:
        router = cluster.servers["router"].address
        front = FrontDoor(router, model=MODEL, vocab_size=CFG.vocab_size, max_len=MAX_LEN)
        with FrontDoorServer(front) as server:
            body = {"model": MODEL, "prompt": "abc", "max_tokens": 30, "stream": True}
            status, _, text = _post(server.address, "/v1/completions", {**body, "temperature": 0})
    assert status == 200
    events = [json.loads(e.removeprefix("data: ")) for e in text.strip().split("\n\n")]
    *chunks, last = events
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks and expected_text(TOKENIZER.encode("abc"), 30).startswith(streamed)
    assert set(last) == {"error"} and last["error"]["message"] and last["error"]["type"]
