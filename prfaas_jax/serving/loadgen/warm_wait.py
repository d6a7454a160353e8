"""Waiting for a cluster's prefill workers to finish compiling behind their start:
`wait_warm(stub, timeout_s) -> pb.RouterStats`.

A prefill worker reports ready once its one-prompt calls are compiled and compiles its batched
calls afterwards on a thread of its own (serving/worker/batch_warmup.py), so a cluster answers
sooner. A measurement started then would time those compiles beside its requests; it waits for
them first. Each worker counts the calls it has left (`WorkerStats.batch_calls_warming`), and the
router's stats carry what its control loop last heard from every worker.
"""

from __future__ import annotations

import time

from prfaas_jax.errors import UserError
from prfaas_jax.serving.proto import prfaas_pb2 as pb


def wait_warm(
    stub, timeout_s: float = 600.0, poll_s: float = 0.5, unheard_s: float = 30.0
) -> pb.RouterStats:
    """Block until the router has heard from every worker and none is still compiling
    batched calls; the router's stats that said so. A worker still unheard after
    ``unheard_s`` (down since the router started) is not waited for; `UserError` when calls
    still compile after ``timeout_s``."""
    start = time.monotonic()
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
        waited = time.monotonic() - start
        # A worker the control loop has not polled yet shows only its name and role.
        heard = waited > unheard_s or all(worker.max_slots for worker in stats.workers)
        warming = sum(worker.batch_calls_warming for worker in stats.workers)
        if heard and not warming:
            return stats
        if waited > timeout_s:
            raise UserError(
                f"the cluster is not warm after {timeout_s:.0f} s: "
                f"{warming} batched prefill calls still compiling"
            )
        time.sleep(poll_s)
