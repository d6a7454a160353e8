"""Fixtures for cluster tests: a launched fake-engine cluster and a router client, shared by a
module."""

from __future__ import annotations

import grpc
import pytest
from serving_support import fake_config

from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    """A running fake-engine cluster, shared by a module: its ready info."""
    root = tmp_path_factory.mktemp("fake-cluster")
    with ClusterProcesses(fake_config(root / "cluster.toml"), log_dir=root / "logs") as cluster:
        yield cluster.start()


@pytest.fixture(scope="module")
def router(fake_cluster):
    with grpc.insecure_channel(fake_cluster["router"]) as channel:
        yield pb_grpc.RouterStub(channel)
