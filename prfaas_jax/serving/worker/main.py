"""A worker process: one instance of the cluster, `python -m prfaas_jax.serving.worker.main`.

Exposes `WorkerNode` (the role, the engines and the `WorkerControl` service) and `main`.

A node serves `WorkerControl` and `PrefixCache` (serving/worker/prefix.py: its hybrid prefix
cache, which prefill goes through) always, and `PrefillWorker` or `DecodeWorker` according to
its current role; a call for the other role is FAILED_PRECONDITION. PrfaaS nodes are prefill-only
and own the inter-cluster `LinkShaper` (`SetLink` changes its bandwidth at run time); under
`--netns` the kernel shapes the link (`--kernel-link`: a `tbf` on the namespace's veth, which
`SetLink` reshapes) and the shaper only adds the propagation delay. PD nodes
may be switched between pd_prefill and pd_decode by `SetRole`, which the router sends only
after draining the node: the call is refused while the node still has work, builds and warms
the engine of the new role if this node never had it (both engines then stay resident, so
switching back is instant), and returns how long that took.

The process binds `--host` (127.0.0.1 by default; `[hosts]`, or the cluster's host address under
`--netns`) on `--port` (0: a free one), writes {"address", "pid"} to `--address-file`
(atomically) as soon as it listens, builds and warms the engine of its first role, then reports
SERVING on the health service. With `[security]` certificates its port and every channel it
opens use mutual TLS (serving/transport/security.py).

SIGTERM or SIGINT stops it within a short grace, not a drain: the port closes at once (new
calls fail UNAVAILABLE), the calls in flight — prefills with their pushes, decode streams — get
`STOP_GRACE_S` (2 s, serving/transport/server.py) to finish, and whatever still runs then is
cancelled; its caller sees UNAVAILABLE, which the router handles as a dead worker (it resumes
the request elsewhere, or on the worker's replacement). Then the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import threading
import time

import grpc
import jax

from prfaas_jax.engine.compile_cache import enable_compile_cache, enable_weights_cache
from prfaas_jax.engine.host_memory import STATE_BLOCKS, reuse_freed_memory
from prfaas_jax.engine.spmd import CommandChannel, LeaderLostError, ProcessGroup, follow, join
from prfaas_jax.engine.tracing_gc import collect_for_tracing
from prfaas_jax.errors import UserError
from prfaas_jax.policy.routing import Role
from prfaas_jax.serving.cluster_config import (
    ClusterConfig,
    load_cluster_config,
    load_security_file,
)
from prfaas_jax.serving.proto import prfaas_pb2 as pb
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transfer.data_path import DataListener
from prfaas_jax.serving.transfer.faults import FaultInjector
from prfaas_jax.serving.transfer.increments import build_decode_kv_cache
from prfaas_jax.serving.transfer.state_chunks import add_decode_worker_servicer
from prfaas_jax.serving.transport.kernel_link import KernelLink, KernelLinkError, tcp_segments
from prfaas_jax.serving.transport.lifecycle import (
    die_with_parent,
    install_stop_handlers,
    write_json,
)
from prfaas_jax.serving.transport.link import LinkProfile, LinkShaper
from prfaas_jax.serving.transport.messages import role_from_proto, role_to_proto
from prfaas_jax.serving.transport.security import server_credentials
from prfaas_jax.serving.transport.server import ServingServer, full_service_name
from prfaas_jax.serving.worker.decode import DecodeService
from prfaas_jax.serving.worker.engines import EngineFactory
from prfaas_jax.serving.worker.mixed import MixedDecodeService, MixedPrefillService
from prfaas_jax.serving.worker.prefill import PrefillService
from prfaas_jax.serving.worker.prefix import PrefixService, build_prefix_cache
from prfaas_jax.wire_precision import WIRE_NATIVE

log = logging.getLogger("prfaas.worker")


def link_profile(config: ClusterConfig, *, kernel_shaped: bool = False) -> LinkProfile:
    """One PrfaaS worker's share of the cluster's egress link; ``kernel_shaped``: the kernel
    holds the rate (`--netns`), the sender only adds the propagation delay — none when the
    link is in packets (`[link] in_packets`): the WAN namespace's delay line holds it then, so
    it is not counted twice."""
    link, share = config.link, max(config.instances.prfaas_prefill, 1)
    return LinkProfile(
        bandwidth_bytes_per_s=math.inf if kernel_shaped else link.bandwidth_bytes_per_s / share,
        latency_s=0.0 if kernel_shaped and link.in_packets else link.one_way_delay_s,
        burst_bytes=link.burst_kib * 1024,
        schedule=link.schedule,
        repeat_s=link.repeat_s,
    )


class WorkerNode(pb_grpc.WorkerControlServicer):
    def __init__(
        self,
        name: str,
        role: Role,
        config: ClusterConfig,
        *,
        kernel_link: str | None = None,
        group: ProcessGroup | None = None,
        data_path: DataListener | None = None,
    ) -> None:
        """``kernel_link``: the veth (in this process's namespace) whose `tbf` shapes the
        inter-cluster link (`--netns`); None shapes it in this process. ``group``: this node
        leads a multi-process instance (engine/spmd.py). ``data_path``: its decode side's
        data port (serving/transfer/data_path.py; None: pushes come on their streams)."""
        self.name, self.config = name, config
        self._role, self._role_lock = role, threading.Lock()
        self.factory = EngineFactory(config, group, prfaas=role is Role.PRFAAS_PREFILL)
        cfg, engine = self.factory.cfg, config.engine
        prfaas = role is Role.PRFAAS_PREFILL
        self.kernel_link = (
            KernelLink(kernel_link, config.instances.prfaas_prefill)
            if prfaas and kernel_link
            else None
        )
        shaped_by_kernel = self.kernel_link is not None
        self.shaper = (
            LinkShaper(link_profile(config, kernel_shaped=shaped_by_kernel)) if prfaas else None
        )
        # The cache lives as long as the process: a PD node switched to decode and back keeps it.
        self.prefixes = PrefixService(
            cfg=cfg,
            cache=build_prefix_cache(cfg, config, name),
            max_len=engine.max_len,
            frame_bytes=engine.frame_bytes,
            shaper=self.shaper,
            fetch_timeout_s=config.router.request_timeout_s,
            security=config.security,
        )
        self.prefill = PrefillService(
            engine=self.factory.prefill_engine,
            cfg=cfg,
            max_len=engine.max_len,
            frame_bytes=engine.frame_bytes,
            shaper=self.shaper,
            admit=self._admit_prefill,
            push_timeout_s=config.router.request_timeout_s,
            prefixes=self.prefixes,
            security=config.security,
            faults=FaultInjector.build(config.faults, name),
            max_queue=engine.max_prefill_queue,
            batch_rows=engine.prefill_batch_rows,
            batch_tokens=engine.prefill_batch_tokens,
            batch_ready=self.factory.batch_ready,
            streams=config.link.streams,
            name=name,
            precision=config.link.wire_precision if prfaas else WIRE_NATIVE,
            data_path=config.link.data_path,
        )
        decode_options = dict(
            cfg=cfg,
            max_len=engine.max_len,
            admit=self._admit_decode,
            state_timeout_s=config.router.request_timeout_s,
            max_pending_states=config.pending_states_limit,
            # The router admits at most max_in_flight requests; twice that leaves room for
            # attempts it gave up on whose cancellation has not arrived yet.
            max_waiting=2 * config.router.max_in_flight,
            kv_cache=None if prfaas else build_decode_kv_cache(cfg, config, self.prefixes.cache),
            data_path=data_path,
        )
        # A mixed PD instance (`pd_mode = "mixed"`) prefills local prompts in its decode steps:
        # its PrefillWorker calls go to its decode service (serving/worker/mixed.py).
        self.mixed = config.instances.mixed and role is Role.PD_DECODE
        self.prefill_calls: pb_grpc.PrefillWorkerServicer = self.prefill
        if self.mixed:
            self.decode = MixedDecodeService(
                mixer=self.factory.mixer, max_prompts=engine.max_prefill_queue, **decode_options
            )
            self.prefill_calls = MixedPrefillService(
                self.decode,
                max_len=engine.max_len,
                admit=self._admit_decode,
                timeout_s=config.router.request_timeout_s,
            )
        else:
            self.decode = DecodeService(engine=self.factory.decode_engine, **decode_options)

    @property
    def rpc_threads(self) -> int:
        """Server threads for every call the bounded queues admit at once (prefills waiting for
        or on the engine, decode streams waiting or in a slot, pushes being received), plus room
        for the short calls (stats, prefix lookups): a full queue never starves the calls that
        drain it, such as the pushes that waiting `Generate` streams need."""
        prefill, decode, slots = self.prefill, self.decode, self.factory.decode_rows
        return prefill.max_queue + decode.max_waiting + slots + decode.max_pending_states + 16

    @property
    def role(self) -> Role:
        with self._role_lock:
            return self._role

    def warm(self) -> None:
        """Build the engine of the current role (compiles happen here, before SERVING; a
        prefill engine's batched calls compile after, behind it)."""
        if self.role.is_prefill:
            self.prefixes.warm(self.factory.prefill_engine())
            self.factory.warm_batches()
        elif self.mixed:
            self.factory.mixer()
        else:
            self.factory.decode_engine()

    def _admit_prefill(self, context: grpc.ServicerContext) -> None:
        if not self.role.is_prefill:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name} is a decode node")

    def _admit_decode(self, context: grpc.ServicerContext) -> None:
        if self.role is not Role.PD_DECODE:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name} is a prefill node")

    # --- WorkerControl --------------------------------------------------------------------

    def GetStats(  # noqa: N802
        self, request: pb.GetStatsRequest, context: grpc.ServicerContext
    ) -> pb.WorkerStats:
        decode = self.decode.stats()
        role = self.role
        stats = pb.WorkerStats(
            name=self.name,
            role=role_to_proto(role),
            queue_depth=self.prefill.queued if role.is_prefill else decode["queue_depth"],
            active_slots=decode["active_slots"],
            max_slots=self.config.engine.max_slots,
            pending_states=decode["pending_states"],
            completed=self.prefill.completed + decode["completed"],
            tokens_generated=decode["tokens_generated"],
            state_bytes_received=decode["state_bytes_received"],
            data_path_pushes=decode["data_path_pushes"],
            batch_calls_warming=self.factory.batch_calls_warming,
        )
        stats.prefix_cache.CopyFrom(self.prefixes.stats())
        if self.shaper is not None:
            stats.egress_bytes = self.shaper.sent_bytes
            stats.link.CopyFrom(self._link_state())
        return stats

    def _link_state(self) -> pb.LinkState:
        assert self.shaper is not None
        rate = self.kernel_link.rate() if self.kernel_link is not None else self.shaper.rate()
        state = pb.LinkState(bandwidth_bytes_per_s=rate, latency_s=self.shaper.latency_s)
        state.learned_bytes_per_s, state.learned_samples = self.prefill.learned_link()
        state.measured_rtt_s, state.rtt_samples = self.prefill.measured_rtt()
        state.data_retransmitted_segments = self.prefill.retransmits
        if self.kernel_link is not None:  # the namespace's TCP is the link's
            try:
                state.tcp_out_segments, state.tcp_retransmitted_segments = tcp_segments()
                state.tcp_counted = True
            except KernelLinkError as err:
                log.warning("%s", err)
        return state

    def SetRole(  # noqa: N802
        self, request: pb.SetRoleRequest, context: grpc.ServicerContext
    ) -> pb.SetRoleReply:
        try:
            target = role_from_proto(request.role)
        except UserError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        current = self.role
        if Role.PRFAAS_PREFILL in (current, target) and current is not target:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "PrfaaS nodes stay prefill-only")
        if target is current:
            return pb.SetRoleReply(role=request.role, switch_s=0.0)
        if self.prefill.busy or self.decode.busy:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{self.name} still has requests: drain it first",
            )
        start = time.perf_counter()
        if target.is_prefill:
            self.prefixes.warm(self.factory.prefill_engine())
            self.factory.warm_batches()
        else:
            self.factory.decode_engine()
        with self._role_lock:
            self._role = target
        log.info("%s: %s → %s", self.name, current.value, target.value)
        return pb.SetRoleReply(role=request.role, switch_s=time.perf_counter() - start)

    def SetLink(  # noqa: N802
        self, request: pb.SetLinkRequest, context: grpc.ServicerContext
    ) -> pb.LinkState:
        if self.shaper is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{self.name} has no inter-cluster link"
            )
        try:
            if self.kernel_link is None:
                self.shaper.set_link(request.bandwidth_bytes_per_s, request.latency_s)
            elif request.bandwidth_bytes_per_s > 0:
                self.kernel_link.set_rate(request.bandwidth_bytes_per_s)
                self.shaper.set_link(math.inf, request.latency_s)
            else:
                raise ValueError("a link needs bandwidth > 0 and latency ≥ 0")
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except KernelLinkError as err:
            context.abort(grpc.StatusCode.INTERNAL, f"cannot reshape the link: {err}")
        return self._link_state()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one PrfaaS worker process (see prfaas serve)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--role", required=True, choices=[r.value for r in Role])
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--parent-pid", type=int, help="exit when this process (the launcher) dies")
    parser.add_argument(
        "--compile-cache",
        help="shared JAX compilation cache directory; given, a seeded preset's weights are "
        "also read from (or kept in) the weights cache, ~/.cache/prfaas_jax/weights",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    parser.add_argument(
        "--kernel-link", metavar="DEV", help="the tbf-shaped veth of the inter-cluster link"
    )
    parser.add_argument("--local-devices", type=int, help="CPU devices of this process")
    parser.add_argument(
        "--cluster-security",
        metavar="FILE",
        help="a [security] table replacing the config's (the certificates a --netns run made)",
    )
    spmd = parser.add_argument_group("a multi-process instance (engine/spmd.py)")
    spmd.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's coordination service")
    spmd.add_argument("--num-processes", type=int, default=1)
    spmd.add_argument("--process-id", type=int, default=0, help="0 serves; the others follow it")
    args = parser.parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    collect_for_tracing()  # the engines' warm-up traces every program a request can need
    reuse_freed_memory()  # states and their frames come and go, many MiB each
    tag = args.name if args.process_id == 0 else f"{args.name}/{args.process_id}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {tag} %(message)s")
    config = load_cluster_config(args.config)
    if args.cluster_security:
        config = dataclasses.replace(config, security=load_security_file(args.cluster_security))
    STATE_BLOCKS.keep_bytes = int(config.engine.state_pool_mib * 2**20)
    group = None
    if args.num_processes > 1:
        group = ProcessGroup(
            args.coordinator, args.num_processes, args.process_id, args.local_devices or 1
        )
        join(group)  # before anything touches a device
    elif args.local_devices:
        jax.config.update("jax_num_cpu_devices", args.local_devices)
    # After join: jax.distributed installs a SIGTERM handler of its own (preemption notices).
    stop = install_stop_handlers()
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
        enable_weights_cache()
    if group is not None and not group.leader:
        return _follow(config, group, args.address_file, stop)
    # Pushes to this node's decode side may send their frames here, beside PushState.
    data_path = DataListener(args.host, config.security) if config.link.data_path else None
    node = WorkerNode(
        args.name,
        Role(args.role),
        config,
        kernel_link=args.kernel_link,
        group=group,
        data_path=data_path,
    )
    server = ServingServer(
        [
            (pb_grpc.add_WorkerControlServicer_to_server, node, full_service_name("WorkerControl")),
            (
                pb_grpc.add_PrefillWorkerServicer_to_server,
                node.prefill_calls,
                full_service_name("PrefillWorker"),
            ),
            (
                add_decode_worker_servicer,
                node.decode,
                full_service_name("DecodeWorker"),
            ),
            (
                pb_grpc.add_PrefixCacheServicer_to_server,
                node.prefixes,
                full_service_name("PrefixCache"),
            ),
        ],
        # With certificates configured, only CA-signed peers may call a worker (mutual TLS).
        credentials=server_credentials(config.security, require_client_auth=True),
        security_section=config.security,
        what=f"worker {args.name}",
        max_workers=node.rpc_threads,
        host=args.host,
        port=args.port,
    )
    interpreted = node.factory.interprets_kernels
    write_json(
        args.address_file,
        {"address": server.address, "pid": os.getpid(), "interpreted_kernels": interpreted},
    )
    try:
        start = time.perf_counter()
        node.warm()
        if stop.is_set():
            server.stop(0)
            return 0
        server.set_serving()
        log.info(
            "%s (%s) serving on %s after %.1f s",
            args.name,
            args.role,
            server.address,
            time.perf_counter() - start,
        )
        while not stop.wait(0.5):  # a timed wait, so the signal handler gets to run
            pass
        server.stop()
        if data_path is not None:
            data_path.close()
        node.decode.stop()
    finally:
        # Ends the batched prefill warm-up: no compile left running as the interpreter exits.
        node.factory.close()
    return 0


def _follow(
    config: ClusterConfig, group: ProcessGroup, address_file: str, stop: threading.Event
) -> int:
    """A follower process: warm the same engine as the leader, then replay its calls."""
    engine = EngineFactory(config, group, prfaas=True).prefill_engine()
    write_json(address_file, {"pid": os.getpid(), "process_id": group.process_id})
    log.info("following process 0 at %s", group.coordinator)
    try:
        replayed = follow(engine, CommandChannel(), stop)
    except LeaderLostError as err:
        log.error("%s; exiting", err)
        return 1
    log.info("replayed %d prefills; stopping", replayed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
