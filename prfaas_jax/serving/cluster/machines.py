"""A cluster over several machines: `PARTS`, `remote_instances` and `wait_remote`.

One cluster config describes every machine (`[hosts]`: where each server listens). A launcher
runs some of the parts — the router, the PrfaaS instances, the PD instances (`prfaas serve
--only`) — and the instances of the other parts are *remote*: another machine's launcher runs
them at their `[hosts]` address, which must then carry a port if this machine runs the router
(it cannot read their address files). The router's launcher waits for them before starting it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Collection

from prfaas_jax.errors import UserError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster.processes import ClusterError
from prfaas_jax.serving.cluster_config import ClusterConfig, instance_part, instance_roles
from prfaas_jax.serving.transport.server import health_status

PARTS = ("router", "prfaas", "pd")


def remote_instances(config: ClusterConfig, only: Collection[str]) -> dict[str, Role]:
    """The instances another machine runs when this one runs ``only``; one-line errors for an
    unknown part and for a remote instance the local router could not find."""
    only = frozenset(only)
    unknown = sorted(only - set(PARTS))
    if unknown or not only:
        raise UserError(
            f"--only takes some of {', '.join(PARTS)}, got {', '.join(unknown) or 'nothing'}"
        )
    remote = {n: r for n, r in instance_roles(config).items() if instance_part(n) not in only}
    if "router" in only:
        for name in remote:  # the router must find them without an address file
            if not config.hosts.endpoint(name).port:
                raise UserError(
                    f"{name} runs on another machine (--only {','.join(sorted(only))}): "
                    f'[hosts] must give its port ({instance_part(name)} = "HOST:PORT" or '
                    f'"{name}" = "HOST:PORT") so the router can reach it'
                )
    return remote


def wait_remote(
    config: ClusterConfig,
    remote: Collection[str],
    deadline: float,
    stop: threading.Event,
    timeout_s: float,
) -> None:
    """Wait until every instance in ``remote`` reports SERVING at its `[hosts]` address."""
    waiting = {name: str(config.hosts.endpoint(name)) for name in remote}
    if waiting:
        listing = ", ".join(f"{n} at {a}" for n, a in waiting.items())
        print(
            f"prfaas serve: waiting for {listing} (another machine's prfaas serve --only …)",
            file=sys.stderr,
            flush=True,
        )
    while waiting:
        if stop.is_set():
            raise ClusterError("interrupted while waiting for the other machines")
        for name, address in list(waiting.items()):
            if health_status(address, security_section=config.security) == "SERVING":
                del waiting[name]
        if waiting and time.monotonic() > deadline:
            listing = ", ".join(f"{n} at {a}" for n, a in waiting.items())
            raise ClusterError(f"{listing} not SERVING after {timeout_s:.0f} s")
        if waiting:
            time.sleep(0.5)
