"""Cutting the real link 10× mid-run raises t within a few control periods and keeps PrfaaS
egress under the new cap; restoring it brings t back (fake engines, real processes; the router
learns the capacity from the transfers, never from the shaper). The same dynamics with an
injected clock are tested in test_link.py."""

from __future__ import annotations

import itertools
import threading
import time

import grpc
from serving_support import fake_config, generate

from prfaas_jax.policy.link_capacity import CapacityMeter
from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc

PERIOD_S = 0.25
STALE_S = CapacityMeter().stale_s  # a learned capacity with no sample this long is dropped
BANDWIDTH = 400_000.0  # bytes/s; the toy state of a 200-token prompt is 41.6 KB
OVERRIDES = {
    "fake": {"prefill_s_per_token": 0.0002, "decode_step_s": 0.005},
    "link": {"bandwidth_mbps": BANDWIDTH * 8 / 1e6, "latency_ms": 2.0, "burst_kib": 16.0},
    "router": {"control_period_s": PERIOD_S},
    "controller": {
        "enabled": True,
        "window": 64,
        "min_samples": 8,
        "min_dwell_s": 1.0,
        "utilization_window_s": 1.0,
        "rate_horizon_s": 5.0,
        "resolve_every_s": 2.0,  # t follows the window as it fills during warm-up
    },
    "profile": {"prfaas_prefill_s": [0.0, 0.001], "pd_prefill_s": [0.0, 0.002]},
}


class Load:
    """8 requests/s with uncached lengths cycling through 16, 32, …, 256, until stopped."""

    def __init__(self, stub: pb_grpc.RouterStub) -> None:
        self.stub, self.stop = stub, threading.Event()
        self.errors: list[str] = []
        self.done: list[int] = []  # list.append is atomic; a counter += is not
        self.threads: list[threading.Thread] = []

    def _one(self, length: int) -> None:
        try:
            generate(self.stub, [length % 256] * length, 2)
            self.done.append(length)
        except grpc.RpcError as err:
            self.errors.append(err.code().name)

    def run(self) -> None:
        for i in itertools.count():
            if self.stop.wait(0.125):
                return
            thread = threading.Thread(target=self._one, args=(16 * (1 + i % 16),))
            thread.start()
            self.threads.append(thread)


def test_link_cut_raises_t_and_restore_brings_it_back(tmp_path):
    config = fake_config(tmp_path / "cluster.toml", **OVERRIDES)
    with ClusterProcesses(config, log_dir=tmp_path / "logs") as cluster:
        ready = cluster.start()
        channel = grpc.insecure_channel(ready["router"])
        stub = pb_grpc.RouterStub(channel)
        link = pb_grpc.WorkerControlStub(
            grpc.insecure_channel(ready["workers"]["prfaas-0"]["address"])
        )

        def threshold() -> float:
            return stub.GetStats(pb.GetStatsRequest()).threshold

        def egress() -> int:
            return link.GetStats(pb.GetStatsRequest()).egress_bytes

        load = Load(stub)
        runner = threading.Thread(target=load.run)
        runner.start()
        try:
            # The controller's 64-request window fills (8/s), then t holds through one
            # periodic re-solve (every 2 s).
            deadline = time.monotonic() + 60
            while len(load.done) < OVERRIDES["controller"]["window"]:
                assert time.monotonic() < deadline, f"only {len(load.done)} requests done"
                time.sleep(0.1)
            before, settled = threshold(), False
            while not settled:
                assert time.monotonic() < deadline, "t did not settle"
                time.sleep(2.5)
                now = threshold()
                settled, before = now == before, now
            assert before < 256, "something must be offloaded before the cut"
            cut_at = time.monotonic()
            link.SetLink(pb.SetLinkRequest(bandwidth_bytes_per_s=BANDWIDTH / 10, latency_s=0.002))
            while threshold() <= before:
                assert time.monotonic() - cut_at < 8 * PERIOD_S + 4.0, "t did not rise"
                time.sleep(0.05)
            raised = threshold()
            # Egress while cut: at most the new cap (plus one 16 KiB burst).
            time.sleep(1.0)
            start_bytes, start = egress(), time.monotonic()
            time.sleep(2.0)
            rate = (egress() - start_bytes) / (time.monotonic() - start)
            assert rate <= BANDWIDTH / 10 + 16 * 1024 / 2.0
            assert threshold() >= raised
            restored_at = time.monotonic()
            link.SetLink(pb.SetLinkRequest(bandwidth_bytes_per_s=BANDWIDTH, latency_s=0.002))
            # The capacity is learned from transfers: while t keeps states off the link, the
            # estimate goes stale (STALE_S after its last sample) and the configured bandwidth
            # is tried again; transfers at the restored rate then confirm it.
            while threshold() >= raised:
                limit = STALE_S + 8 * PERIOD_S + 4.0
                assert time.monotonic() - restored_at < limit, "t did not come back"
                time.sleep(0.05)
            assert abs(threshold() - before) <= 16
        finally:
            load.stop.set()
            runner.join()
            for thread in load.threads:
                thread.join(timeout=30)
            channel.close()
    assert not load.errors and len(load.done) > 60
