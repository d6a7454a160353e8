"""The engine protocols of engine/api.py hold for both implementations: the JAX engines and the
fakes. Structurally, as a type checker would see it: every member of a protocol exists on the
engine (`isinstance` with `runtime_checkable`), and every method accepts the protocol's
parameters under the same names, kinds and defaults, with no further required parameter; a
prefill's result carries every field of `PrefillOutput`.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from conftest import preset

from prfaas_jax.engine.api import DecodeEngineLike, PrefillEngineLike, PrefillOutput
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.fake import FakeDecodeEngine, FakePrefillEngine, FakePrefillResult
from prfaas_jax.engine.prefill import PrefillEngine, PrefillResult


def protocol_methods(protocol: type) -> list[str]:
    return [
        name
        for name, member in vars(protocol).items()
        if inspect.isfunction(member) and not name.startswith("_")
    ]


def protocol_properties(protocol: type) -> list[str]:
    return [name for name, member in vars(protocol).items() if isinstance(member, property)]


def assert_accepts(protocol: type, implementation: type) -> None:
    """Each protocol method exists on `implementation` and takes the protocol's calls."""
    for name in protocol_methods(protocol):
        wanted = inspect.signature(getattr(protocol, name)).parameters
        given = inspect.signature(getattr(implementation, name)).parameters
        for param in wanted.values():
            assert param.name in given, f"{implementation.__name__}.{name}: no {param.name!r}"
            have = given[param.name]
            where = f"{implementation.__name__}.{name}({param.name})"
            assert have.kind == param.kind, f"{where}: {have.kind} ≠ {param.kind}"
            assert have.default == param.default, f"{where}: default {have.default!r}"
        extra = [
            p.name
            for p in given.values()
            if p.name not in wanted
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        assert not extra, f"{implementation.__name__}.{name} also requires {extra}"


@pytest.mark.parametrize("implementation", [PrefillEngine, FakePrefillEngine])
def test_prefill_engines_take_the_protocols_calls(implementation):
    assert_accepts(PrefillEngineLike, implementation)


@pytest.mark.parametrize("implementation", [DecodeEngine, FakeDecodeEngine])
def test_decode_engines_take_the_protocols_calls(implementation):
    assert_accepts(DecodeEngineLike, implementation)


@pytest.mark.parametrize("result", [PrefillResult, FakePrefillResult])
def test_prefill_results_carry_the_output_fields(result):
    fields = {field.name for field in dataclasses.fields(result)}
    assert set(protocol_properties(PrefillOutput)) <= fields


def test_engine_instances_are_protocol_instances():
    cfg, params = preset("tiny")
    prefill_engines = [PrefillEngine(cfg, params), FakePrefillEngine(cfg)]
    decode_engines = [
        DecodeEngine(cfg, params, max_slots=2, max_len=32),
        FakeDecodeEngine(cfg, max_slots=2, max_len=32),
    ]
    for engine in prefill_engines:
        assert isinstance(engine, PrefillEngineLike), type(engine).__name__
        assert not isinstance(engine, DecodeEngineLike), type(engine).__name__
    for engine in decode_engines:
        assert isinstance(engine, DecodeEngineLike), type(engine).__name__
        assert not isinstance(engine, PrefillEngineLike), type(engine).__name__
        assert engine.max_slots == 2
    # A result of a real call (the fake's: the JAX engine's would cost a compile).
    assert isinstance(FakePrefillEngine(cfg).prefill([1, 2, 3]), PrefillOutput)
