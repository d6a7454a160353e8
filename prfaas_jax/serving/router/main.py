"""The router process: ``python -m prfaas_jax.serving.router.main --config … --workers …``.

Reads the cluster config and the launcher's workers file, builds the request path
(``RouterCore``, serving/router/core.py) and its control loop (``RouterControl``,
serving/router/control.py), serves the ``Router`` API on the client port (TLS and bearer token
when ``[security]`` sets them) and Prometheus metrics, and writes its address file.

SIGTERM or SIGINT stops it within a short grace, not a drain: a new ``Generate`` fails
UNAVAILABLE from then on, the control loop and the metrics endpoint stop, the client port
closes (a new call of any kind fails UNAVAILABLE), requests in flight
get ``STOP_GRACE_S`` (2 s, serving/transport/server.py) to finish, and a stream still running
then ends UNAVAILABLE for its client, its calls to the workers cancelled (they free the slot).
Then the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from prfaas_jax.serving.cluster_config import (
    load_cluster_config,
    load_security_file,
    serving_model_config,
)
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.router.control import RouterControl, read_workers
from prfaas_jax.serving.router.core import RouterCore, RouterService
from prfaas_jax.serving.router.metrics import MetricsServer
from prfaas_jax.serving.transport.lifecycle import (
    die_with_parent,
    install_stop_handlers,
    write_json,
)
from prfaas_jax.serving.transport.messages import router_max_request_bytes
from prfaas_jax.serving.transport.security import (
    TokenAuth,
    client_port_summary,
    read_token,
    server_credentials,
)
from prfaas_jax.serving.transport.server import ServingServer, full_service_name

log = logging.getLogger("prfaas.router")
ROUTER_THREADS = 512


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the PrfaaS router process (see prfaas serve)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--workers", required=True, help="JSON {name: {address, role}}")
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--parent-pid", type=int, help="exit when this process (the launcher) dies")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (and metrics)")
    parser.add_argument("--port", type=int, default=0, help="client port (0: any free one)")
    parser.add_argument(
        "--cluster-security",
        metavar="FILE",
        help="a [security] table for the channels to the workers (the certificates a --netns "
        "run made); the client port and the metrics keep the config's",
    )
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(message)s")
    stop = install_stop_handlers()
    config = load_cluster_config(args.config)
    clients = config.security  # the client port's and the metrics endpoint's
    if args.cluster_security:
        config = dataclasses.replace(config, security=load_security_file(args.cluster_security))
    workers = read_workers(args.workers)
    core = RouterCore(config, serving_model_config(config), workers)
    control = RouterControl(core, args.workers)
    token = read_token(clients)
    server = ServingServer(
        [
            (
                pb_grpc.add_RouterServicer_to_server,
                RouterService(core, control.router_stats),
                full_service_name("Router"),
            )
        ],
        # Each in-flight request holds a thread for its whole stream.
        max_workers=ROUTER_THREADS,
        # No valid request is larger: an oversized one is refused before it is parsed.
        max_receive_bytes=router_max_request_bytes(config.engine.max_len),
        # The client port (serving/transport/security.py): TLS when certificates are set; a
        # client proves itself by the bearer token when there is one, else by a CA-signed
        # certificate.
        credentials=server_credentials(clients, require_client_auth=token is None),
        interceptors=[TokenAuth(token, [full_service_name("Router")])] if token else [],
        security_section=clients,
        what="the router's client port",
        host=args.host,
        port=args.port,
    )
    metrics = MetricsServer(
        control.snapshot, port=config.router.metrics_port, host=args.host, security=clients
    )
    control.start()
    write_json(
        args.address_file,
        {"address": server.address, "pid": os.getpid(), "metrics": metrics.address},
    )
    server.set_serving()
    log.info("serving on %s, metrics on http://%s/metrics", server.address, metrics.address)
    log.info("client port: %s", client_port_summary(clients))
    while not stop.wait(0.5):
        pass
    core.stop_admitting()
    control.stop()
    core.close()
    metrics.stop()
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
