"""The disk tier under a serving worker, in process: fake engines that check every bit of a
prefix state against its tokens, `[prefix_cache] disk_dir` set and a host budget too small to
keep anything, so every prompt's state spills to pd-0's directory. Each `serve_in_process` is a
fresh set of workers over the same directories: a restart.

After a restart the next turn of a conversation reuses its first turn from the warm disk tier
and the output is the fake engine's exact answer; a file damaged while the worker was down is
dropped by the restart's check and the turn is recomputed, exact again. Each report names the
tier its prefix came from.
"""

from __future__ import annotations

from serving_support import fake_config, fake_instances, generate, serve_in_process

from prfaas_jax.config import load_model_config
from prfaas_jax.engine.fake import fake_tokens
from prfaas_jax.engine.prefix_disk import entry_name
from prfaas_jax.serving.cluster_config import load_cluster_config
from prfaas_jax.serving.proto import prfaas_pb2 as pb

CFG = load_model_config("tiny")
REPLY = 4
FIRST = [(7 * i + 3) % CFG.vocab_size for i in range(40)]


def run(config, prompt):
    with serve_in_process(config, fake_instances(CFG), prefix_caches=True) as running:
        reply = generate(running.router, prompt, REPLY)
        stats = running.prefixes["pd-0"].stats()  # as GetStats reports it
    assert reply.tokens == fake_tokens(prompt, REPLY, CFG.vocab_size)
    assert (reply.report.route, reply.report.attempts) == ("pd", 1)
    return reply, stats


def test_a_restarted_worker_reuses_its_disk_tier_and_drops_a_damaged_file(tmp_path):
    disk = tmp_path / "disk"
    path = fake_config(
        tmp_path / "cluster.toml",
        prefix_cache={
            "enabled": True,
            "capacity_mib": 0.0,
            "block_size": 8,
            "disk_dir": str(disk),
            "disk_capacity_mib": 16.0,
        },
        router={"cache_rule": "scarce"},
    )
    config = load_cluster_config(path)
    first, stats = run(config, FIRST)
    assert first.report.cache_tier == pb.CACHE_TIER_NONE
    assert (stats.spills, stats.disk_entries, stats.disk_dropped) == (1, 1, 0)
    assert stats.disk_used_bytes == (disk / "pd-0" / entry_name(FIRST)).stat().st_size
    second = FIRST + first.tokens + [5] * 10

    reply, stats = run(config, second)  # restarted: host memory empty, the disk tier warm
    assert (reply.report.cached_len, reply.report.uncached_len) == (40, 14)
    assert reply.report.cache_tier == pb.CACHE_TIER_DISK
    assert (stats.disk_hits, stats.hits) == (1, 1)

    spilled = disk / "pd-0" / entry_name(FIRST)
    data = bytearray(spilled.read_bytes())
    data[-100] ^= 0x01
    spilled.write_bytes(bytes(data))
    reply, stats = run(config, second)
    assert (reply.report.cached_len, reply.report.uncached_len) == (0, 54)
    assert reply.report.cache_tier == pb.CACHE_TIER_NONE
    assert stats.disk_dropped == 1
    assert not spilled.exists()
