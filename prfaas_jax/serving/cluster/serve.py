"""`prfaas serve`: run a cluster (or this machine's part of it) until SIGINT or SIGTERM.

`serve` starts it with `ClusterProcesses` (serving/cluster/launcher.py) with worker restarts on,
writes the ready file and rewrites it when a restarted worker has a new address, and shuts the
cluster down if the router dies on its own.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Collection
from pathlib import Path

from prfaas_jax.serving.cluster.launcher import ClusterProcesses
from prfaas_jax.serving.cluster.machines import PARTS
from prfaas_jax.serving.cluster.processes import ClusterError
from prfaas_jax.serving.frontdoor.app import cluster_front_door
from prfaas_jax.serving.transport.lifecycle import write_json

INTERPRETED_WARNING = (
    'prfaas serve: warning: impl = "pallas" without a GPU or TPU: the workers run the Pallas '
    "kernels interpreted (same outputs as chunk, much slower)"
)


def serve(
    config_path: str,
    ready_file: str | None,
    *,
    log_dir: str | None = None,
    netns: bool = False,
    only: Collection[str] = PARTS,
    openai_port: int | None = None,
) -> int:
    """`prfaas serve`: run the cluster until SIGINT/SIGTERM; 1 if the router died on its own
    (a dead worker is restarted, and its logs are then kept). With `openai_port` (0: any free
    port) this process also serves the OpenAI-compatible front door in front of the router
    (serving/frontdoor), and the ready file names its base URL as ``openai``."""
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with contextlib.ExitStack() as stack:
            cluster = stack.enter_context(
                ClusterProcesses(
                    config_path,
                    log_dir=log_dir,
                    stop_event=stop,
                    restart_workers=True,
                    netns=netns,
                    only=only,
                )
            )
            try:
                ready = cluster.start()
            except ClusterError:
                if stop.is_set():
                    return 0  # asked to stop while starting: not an error
                raise
            extra = {}
            if openai_port is not None and ready["router"]:
                door = stack.enter_context(
                    cluster_front_door(
                        cluster.config,
                        ready["router"],
                        port=openai_port,
                        router_metrics=ready["metrics"],
                    )
                )
                extra["openai"] = door.base_url
            if ready_file:
                write_json(ready_file, {**ready, **extra})
            local = len(ready["workers"]) - len(cluster.remote)
            scheme = "https" if cluster.config.security.tls else "http"
            where = (
                f"router {ready['router']}, metrics {scheme}://{ready['metrics']}/metrics"
                if ready["router"]
                else "for the router on another machine"
            )
            if extra:
                where += f", OpenAI API {extra['openai']}"
            print(
                f"prfaas serve: {where}, {local} workers here, logs in {ready['log_dir']}; "
                "Ctrl-C stops",
                flush=True,
            )
            if ready["interpreted_kernels"]:
                print(INTERPRETED_WARNING, file=sys.stderr, flush=True)
            restarts = 0
            while not stop.wait(0.5):
                if ready_file and cluster.restarts != restarts:
                    restarts = cluster.restarts
                    write_json(ready_file, {**cluster.ready, **extra})  # a worker's new address
                dead = cluster.dead_child()
                if dead is not None:
                    cluster.failed = True
                    print(
                        f"prfaas serve: {dead} exited; shutting down (logs: {cluster.log_dir})",
                        file=sys.stderr,
                    )
                    return 1
            if cluster.restarts:
                print(
                    f"prfaas serve: {cluster.restarts} worker restart(s); logs kept in "
                    f"{cluster.log_dir}",
                    file=sys.stderr,
                )
        return 0
    finally:
        if ready_file:
            with contextlib.suppress(FileNotFoundError):
                Path(ready_file).unlink()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
