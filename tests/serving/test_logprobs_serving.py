"""Log-probabilities through an in-process cluster of fake engines (both routes): the prompt's on
the first message, each new token's beside it, held against the fake model's by hand
(`FakePrefillEngine.score` of the whole sequence: engine/fake.py gives the formula); a request
that does not ask gets none."""

from __future__ import annotations

import grpc
import pytest
from serving_support import fake_config, fake_instances, serve_in_process

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import FakePrefillEngine, fake_tokens
from prfaas_jax.engine.sampling_params import SamplingParams
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

CFG = load_model_config("tiny")
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=21)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    config = load_cluster_config(fake_config(tmp_path_factory.mktemp("lp") / "cluster.toml"))
    with (
        serve_in_process(config, fake_instances(CFG)) as cluster,
        grpc.insecure_channel(cluster.servers["router"].address) as channel,
    ):
        yield pb_grpc.RouterStub(channel)


def assert_scores(got, want) -> None:
    """`got` (`TokenLogprob` messages, float32) equal `want` (the engine's `TokenLogprobs`)."""
    assert [(s.token_id, list(s.top_ids)) for s in got] == [
        (w.token, [t for t, _ in w.top]) for w in want
    ]
    values = [[s.logprob, *s.top_logprobs] for s in got]
    assert values == [pytest.approx([w.logprob, *(v for _, v in w.top)], abs=1e-5) for w in want]


@pytest.mark.parametrize("length", [12, 90])  # PD, PrfaaS
def test_prompt_and_token_logprobs_are_the_models(router, length):
    prompt = [(7 * i + 3) % 250 for i in range(length)]
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        max_new_tokens=9,
        temperature=SAMPLED.temperature,
        top_p=SAMPLED.top_p,
        seed=SAMPLED.seed,
        logprobs=3,
        prompt_logprobs=True,
    )
    messages = list(router.Generate(request, timeout=60))
    tokens = [t for m in messages for t in m.token_ids]
    assert tokens == fake_tokens(prompt, 9, CFG.vocab_size, SAMPLED)
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    scored = FakePrefillEngine(CFG).score(prompt + tokens, top=3)
    assert_scores(messages[0].prompt_logprobs, scored[: length - 1])
    assert not any(m.prompt_logprobs for m in messages[1:])
    got = [s for m in messages for s in m.logprobs]
    assert_scores(got, scored[length - 1 :])


def test_only_what_is_asked_comes(router):
    prompt = [5, 6, 7, 8]
    plain = list(router.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=4)))
    assert not any(m.logprobs or m.prompt_logprobs for m in plain)
    echo = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=1, prompt_logprobs=True)
    (message,) = list(router.Generate(echo))
    assert len(message.prompt_logprobs) == 3 and not message.logprobs
    assert all(not s.top_ids for s in message.prompt_logprobs)  # no alternatives asked
    with pytest.raises(grpc.RpcError) as err:
        list(
            router.Generate(
                pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=2, logprobs=21)
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
