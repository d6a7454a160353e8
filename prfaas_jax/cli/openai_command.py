"""`prfaas openai`: an OpenAI-compatible HTTP front door for a running cluster.

It asks the router (``GetStats``) which model it serves, its ``max_len`` and vocabulary, takes
the tokenizer of ``--tokenizer DIR`` or of the served model's directory (a checkpoint with a
``tokenizer.json``, engine/tokenizer.py), else the byte-level one, then serves ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` and ``/metrics`` (its own request counters, then
the router's exposition: ``--router-metrics`` or the ready file's) on ``--host:--port``
(serving/frontdoor) until SIGTERM or Ctrl-C, exiting 0. With ``--token-file`` (the cluster's
``[security]`` token) the router calls carry the token and HTTP clients must present it as
``Authorization: Bearer …``, as the router's own clients do. With ``--cert`` and ``--key`` it
serves HTTPS with that certificate; beyond loopback (``--host``) it needs them and the token,
or ``--allow-plaintext`` (docs/serving.md, Security, "Beyond loopback").
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from prfaas_jax.cli.serving_commands import (
    add_client_security_flags,
    add_router_flags,
    client_security,
    read_ready_file,
)
from prfaas_jax.errors import UserError


def add_openai(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "openai",
        help="an OpenAI-compatible HTTP front door (/v1/completions, /v1/chat/completions) for "
        "a running cluster",
        description="Serve the OpenAI completions and chat-completions APIs (SSE streaming or "
        "not, usage, stop strings) and /v1/models in front of a cluster's router, so the "
        "openai SDK and benchmark clients such as `vllm bench serve` drive the cluster. Text goes "
        "through the model's own tokenizer and chat template when its checkpoint has a "
        "tokenizer.json (`prfaas convert-hf` copies it), else it is byte-level (token i < 256 "
        "is byte i; docs/serving.md has that chat template).",
        epilog="example: prfaas serve --ready-file ready.json & prfaas openai --ready-file "
        "ready.json --port 8000, then point a client at http://127.0.0.1:8000/v1",
    )
    add_router_flags(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; beyond loopback it needs TLS (--ca-cert, --cert, --key: "
        "it then serves HTTPS with that certificate) and --token-file, or --allow-plaintext",
    )
    p.add_argument(
        "--allow-plaintext",
        action="store_true",
        help="listen beyond loopback without TLS and client authentication (a warning)",
    )
    p.add_argument(
        "--port", type=int, default=8000, help="HTTP port (0: any free one; default: 8000)"
    )
    p.add_argument(
        "--address-file", help='write {"address", "base_url"} here (atomically) once listening'
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline in s")
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a directory with tokenizer.json (default: the served checkpoint's, if it has one; "
        "else byte-level)",
    )
    p.add_argument(
        "--router-metrics",
        metavar="HOST:PORT",
        help="the router's Prometheus endpoint, served again after the front door's own series "
        "at /metrics (default: the ready file's `metrics`)",
    )
    add_client_security_flags(p)
    p.set_defaults(run=_run_openai)


def _run_openai(args: argparse.Namespace) -> int:
    import grpc

    from prfaas_jax.engine.tokenizer import load_tokenizer
    from prfaas_jax.serving.cluster_sections import SecuritySection
    from prfaas_jax.serving.frontdoor.app import FrontDoor, FrontDoorServer
    from prfaas_jax.serving.proto import prfaas_pb2 as pb
    from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
    from prfaas_jax.serving.transport.lifecycle import install_stop_handlers, write_json
    from prfaas_jax.serving.transport.security import (
        channel_credentials,
        http_client_context,
        read_token,
        router_channel,
    )

    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in [0, 65536), got {args.port}")
    if not args.timeout > 0:
        raise UserError(f"--timeout must be > 0, got {args.timeout}")
    ready = read_ready_file(args.ready_file) if args.ready_file else {}
    router = args.router or ready["router"]
    security = client_security(args)
    with router_channel(router, security) as channel:
        try:
            stats = pb_grpc.RouterStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)
        except grpc.RpcError as err:
            raise UserError(f"no router at {router}: {err.code().name}: {err.details()}") from None
    tokenizer = load_tokenizer(stats.model, stats.vocab_size, override=args.tokenizer)
    door = FrontDoor(
        router,
        model=stats.model,
        vocab_size=stats.vocab_size,
        max_len=stats.max_len,
        token=read_token(security),
        credentials=channel_credentials(security),
        timeout_s=args.timeout,
        tokenizer=tokenizer,
        router_metrics=args.router_metrics or ready.get("metrics"),
        router_metrics_tls=http_client_context(security),
    )
    stop = install_stop_handlers()
    served = dataclasses.replace(
        security or SecuritySection(), allow_plaintext=args.allow_plaintext
    )
    with FrontDoorServer(door, args.host, args.port, served) as server:
        base_url = server.base_url
        if args.address_file:
            write_json(args.address_file, {"address": server.address, "base_url": base_url})
        print(
            f"OpenAI front door for {stats.model} (max_len {stats.max_len:,}) at {base_url}, "
            f"router {router}; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        stop.wait()
    return 0
