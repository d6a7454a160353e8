"""The router's per-request cache rule (serving/router/cache_rule.py) on hand-computed numbers:
the fake cluster's `tiny` model (S_kv(100) = 25,600 bytes), a PD prefill of 0.25 ms per token
([profile] pd_prefill_s = [0.005, 2.5e-4]), a 2 MB/s link."""

from __future__ import annotations

import pytest
from serving_support import fake_config

from prfaas_jax.config import load_model_config
from prfaas_jax.errors import ConfigError
from prfaas_jax.model.state import state_nbytes
from prfaas_jax.policy.routing import InstanceLoad, LinkView
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.router.cache_rule import CacheRule

CFG = load_model_config("tiny")


@pytest.fixture
def rule(tmp_path) -> CacheRule:
    path = fake_config(tmp_path / "cluster.toml", link={"bandwidth_mbps": 16.0})
    return CacheRule(load_cluster_config(path), CFG)


def held(prfaas: int, pd: int) -> tuple[tuple[InstanceLoad, ...], tuple[InstanceLoad, ...]]:
    return (InstanceLoad("r0", cached_len=prfaas),), (InstanceLoad("p0", cached_len=pd),)


def test_auto_moves_a_prefix_only_when_the_link_beats_recomputing_it(rule):
    assert rule.rule == "auto" and state_nbytes(CFG, 100) == 25_600
    # Moving 25.6 KB over 2 MB/s takes 12.8 ms; PD would spend 100 × 0.25 ms = 25 ms on it.
    assert rule.abundant(116, *held(100, 0), LinkView(2e6, 0.0))
    # With 60 % of the link in use the move takes 32 ms: recompute instead.
    assert not rule.abundant(116, *held(100, 0), LinkView(2e6, 0.6))
    # A 1 MB/s link: 25.6 ms, just over the 25 ms.
    assert not rule.abundant(116, *held(100, 0), LinkView(1e6, 0.0))
    # Past the controller's high_utilization (0.85) nothing moves.
    assert not rule.abundant(116, *held(100, 0), LinkView(1e9, 0.9))
    # PD holding 40 of the 100: only 60 tokens to recompute (15 ms) against the same move.
    assert rule.abundant(116, *held(100, 40), LinkView(2e6, 0.0))
    assert not rule.abundant(116, *held(100, 60), LinkView(2e6, 0.0))  # 10 ms < 12.8 ms
    # Equal prefixes: both rules route alike, so nothing is counted.
    assert not rule.abundant(116, *held(50, 50), LinkView(2e6, 0.0))
    assert rule.counts == {"abundant": 2, "scarce": 4}


def test_a_fixed_rule_is_kept(tmp_path):
    for name, expected in (("scarce", False), ("abundant", True)):
        path = fake_config(tmp_path / f"{name}.toml", router={"cache_rule": name})
        rule = CacheRule(load_cluster_config(path), CFG)
        assert rule.abundant(116, *held(100, 0), LinkView(2e6, 0.0)) is expected
        assert rule.abundant(116, *held(0, 100), LinkView(2e6, 0.99)) is expected
    bad = fake_config(tmp_path / "bad.toml", router={"cache_rule": "sometimes"})
    with pytest.raises(ConfigError, match=r"router\.cache_rule: must be one of"):
        load_cluster_config(bad)
