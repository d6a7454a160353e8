"""`[link] precision`: a PrfaaS worker pushes the state it sends to decode in narrower encodings,
a PD prefill worker's push stays exact (router and real JAX engines of `tiny` in this process).

A conversation at a lossy setting with the prefix cache on, the decode worker keeping the KV it
receives: the second turn reuses the first prompt from the PrfaaS worker's cache and ships only
an increment to a decode worker that holds the first turn's rows, and its first transfer is
corrupted on the way, so the router retries it. The lossy encodings scale per position (KV,
latents) and per state row, so rows received in an earlier turn plus an increment must decode
to what the whole state decodes to.

Oracles: the byte formula at each setting (`state_nbytes(cfg, L, precision)`), and generation in
this process through the codec with the same setting — prefill, encode, decode, then decode
steps on an engine of its own — or, for the exact route, with none.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import preset
from serving_support import fake_config, generate, serve_in_process

from prfaas_jax.engine import codec
from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling_params import GREEDY
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.transfer.faults import FaultInjector, TransferFaults
from prfaas_jax.state_bytes import state_nbytes
from prfaas_jax.wire_precision import WIRE_NATIVE, WirePrecision

MAX_LEN, NEW = 128, 6
SETTING = "state=int8,latent=fp8_e4m3,conv=bf16"
SECTIONS = {
    "model": {"preset": "tiny", "engine": "jax"},
    "engine": {"max_len": MAX_LEN},
    "link": {"precision": SETTING},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg, params = preset("tiny")
    path = tmp_path_factory.mktemp("wire") / "cluster.toml"
    config = load_cluster_config(fake_config(path, **SECTIONS))
    prefill = PrefillEngine(cfg, params, chunk_len=16, buckets=(MAX_LEN,))
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, prefill),
        "pd-1": (Role.PD_DECODE, DecodeEngine(cfg, params, max_slots=2, max_len=MAX_LEN)),
    }
    alone = DecodeEngine(cfg, params, max_slots=1, max_len=MAX_LEN)
    with serve_in_process(config, engines) as cluster:
        yield cluster, cfg, prefill, alone


def through_the_codec(cfg, prefill, alone, prompt, setting) -> list[int]:
    result = prefill.prefill(prompt)
    frames = list(codec.encode(result.state, cfg, precision=setting))
    state = codec.decode(frames, cfg, max_len=MAX_LEN)
    slot = alone.insert(state, result.first_token, GREEDY, max_new_tokens=NEW - 1)
    tokens = [result.first_token]
    while not alone.is_finished(slot):
        tokens += [token for s, token in alone.step() if s == slot]
    alone.free(slot)
    return tokens


@pytest.mark.parametrize(
    ("length", "route", "setting"),
    [(90, "prfaas", WirePrecision.parse(SETTING)), (20, "pd", WIRE_NATIVE)],
)
def test_the_link_carries_the_configured_precision(served, length, route, setting):
    cluster, cfg, prefill, alone = served
    prompt = np.random.default_rng(length).integers(1, cfg.vocab_size, length).tolist()
    reply = generate(cluster.router, prompt, NEW)
    assert reply.report.route == route
    assert reply.report.state_bytes == state_nbytes(cfg, length, setting)
    assert reply.tokens == through_the_codec(cfg, prefill, alone, prompt, setting)
    if route == "prfaas":  # a quarter of the exact state, or less, crossed the link
        assert reply.report.state_bytes < 0.6 * state_nbytes(cfg, length)


def test_a_bad_precision_is_a_one_line_config_error(tmp_path):
    path = fake_config(tmp_path / "cluster.toml", link={"precision": "state=int4"})
    with pytest.raises(Exception, match=r"link\.precision: wire precision state='int4'"):
        load_cluster_config(path)


class CorruptOnce(FaultInjector):
    """Flips a byte of the first data frame of one transfer, the `which`-th (from 0); the
    others go clean."""

    def __init__(self, config, which: int) -> None:
        super().__init__(config.faults, "prfaas-0")
        self.which, self.transfers = which, 0

    def plan(self, header, extra_frames: int, label: str) -> TransferFaults | None:
        with self._lock:
            index, self.transfers = self.transfers, self.transfers + 1
        if index != self.which:
            return None
        num_frames = header.num_frames + extra_frames
        return TransferFaults(
            self,
            label,
            corrupt_data_frame=0,
            corrupt_pick=0.5,
            corrupt_mask=0xFF,
            cut_after=None,
            num_frames=num_frames,
        )


def test_a_lossy_increment_after_a_prefix_hit_survives_a_retry(served, tmp_path):
    _, cfg, prefill, alone = served
    _, params = preset("tiny")
    block = 16
    sections = {
        **SECTIONS,
        "prefix_cache": {"enabled": True, "block_size": block, "checkpoint_every": 1},
        # The second turn stays on PrfaaS, where its prefix is cached.
        "router": {"threshold": 64, "cache_rule": "scarce"},
    }
    config = load_cluster_config(fake_config(tmp_path / "cluster.toml", **sections))
    engines = {
        "prfaas-0": (Role.PRFAAS_PREFILL, prefill),
        "pd-0": (Role.PD_PREFILL, prefill),
        "pd-1": (Role.PD_DECODE, DecodeEngine(cfg, params, max_slots=2, max_len=MAX_LEN)),
    }
    faults = CorruptOnce(config, which=1)  # the second turn's first transfer
    rng = np.random.default_rng(5)
    first = rng.integers(1, cfg.vocab_size, 70).tolist()
    with serve_in_process(
        config, engines, faults={"prfaas-0": faults}, prefix_caches=True, decode_kv_caches=True
    ) as cluster:
        r1 = generate(cluster.router, first, NEW)
        second = first + r1.tokens + rng.integers(1, cfg.vocab_size, 20).tolist()
        r2 = generate(cluster.router, second, NEW)
    setting = WirePrecision.parse(SETTING)
    assert faults.corrupted == 1
    assert (r1.report.route, r1.report.attempts, r1.report.decode_cached_len) == ("prfaas", 1, 0)
    assert r1.tokens == through_the_codec(cfg, prefill, alone, first, setting)
    report = r2.report
    assert (report.route, report.attempts) == ("prfaas", 2)
    assert report.cached_len >= len(first) // block * block  # a prefix hit
    held = report.decode_cached_len
    assert held >= len(first) // block * block  # the first turn's rows, kept by the decode side
    # An increment: the whole state at the setting less the held rows at the setting's size.
    held_bytes = state_nbytes(cfg, held, setting) - state_nbytes(cfg, 0, setting)
    assert report.state_bytes == state_nbytes(cfg, len(second), setting) - held_bytes
    assert r2.tokens == through_the_codec(cfg, prefill, alone, second, setting)
