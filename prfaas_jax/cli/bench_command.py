"""`prfaas bench`: load against a running cluster, through the router or the OpenAI front door
(`add_bench`).

Its flags are `vllm bench serve`'s (the request rate, the input and output lengths, goodput
objectives) and the link's; the router, ready-file and TLS flags are those every client
command shares (cli/serving_commands.py). The serving layer is imported only when it runs.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from prfaas_jax.cli.flags import add_json_flag, parse_int_list, print_json
from prfaas_jax.cli.progress import progress
from prfaas_jax.cli.serving_commands import (
    add_client_security_flags,
    add_router_flags,
    client_security,
    read_ready_file,
)
from prfaas_jax.errors import UserError

if TYPE_CHECKING:
    from prfaas_jax.serving.loadgen.bench import InputDist


def _parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise UserError(f"--goodput expects metric:milliseconds, got {item!r}") from None
    return slos


def _input_dist(text: str) -> InputDist:
    """``--input-dist`` as bench's enum, imported only once a bench command line is parsed:
    the serving layer is too heavy to load for ``--help``."""
    from prfaas_jax.serving.loadgen.bench import InputDist

    try:
        return InputDist(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(InputDist)}") from None


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test a running router (vllm bench serve conventions)",
        description="Send prompts to a router at a Poisson or gamma arrival rate and report "
        "TTFT, TPOT, ITL and end-to-end latency (mean, median, std, percentiles), goodput "
        "against SLOs, the fraction offloaded to PrfaaS and the inter-cluster egress (with a "
        "link device, also as the kernel counted it on the wire).",
        epilog="example: prfaas bench --router 127.0.0.1:50051 --num-prompts 50 "
        "--request-rate 4 --burstiness 0.5 --goodput ttft:500 tpot:50; against "
        "`prfaas serve --netns --ready-file ready.json`: prfaas bench --ready-file ready.json",
    )
    add_router_flags(p, ready_file_help="its router, and under --netns its link device")
    p.add_argument(
        "--link-device",
        type=_link_device,
        metavar="[NS/]DEV",
        help="also count the bytes the kernel sends on this network device (in network "
        "namespace NS), e.g. the inter-cluster link's; needs the rights to read it there",
    )
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="mean arrivals per second; inf sends all at once (default)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the inter-arrival gaps: 1 Poisson, <1 burstier (default 1)",
    )
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument(
        "--input-dist",
        type=_input_dist,
        default="paper",
        metavar="DIST",
        help="prompt lengths: paper (the paper's log-normal scaled to the model, default), "
        "lognormal, uniform (around --input-len) or fixed",
    )
    p.add_argument("--input-len", type=int, default=64, help="fixed/uniform length (default 64)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="uniform: ±ratio (default 0.5)")
    p.add_argument("--lognormal-mu", type=float, default=4.0, help="lognormal: mu (default 4.0)")
    p.add_argument("--lognormal-sigma", type=float, default=1.0, help="lognormal: sigma")
    p.add_argument(
        "--length-scale",
        type=float,
        help="paper: scale of the 128..131072-token distribution (default: fit max_len)",
    )
    p.add_argument("--output-len", type=int, default=16, help="new tokens each (default 16)")
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="open every prompt with a shared random prefix of this many tokens, before the "
        "drawn length (default 0: none)",
    )
    p.add_argument(
        "--num-prefixes",
        type=int,
        default=1,
        help="distinct shared prefixes, one picked uniformly per prompt (default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument(
        "--metric-percentiles",
        type=parse_int_list,
        default=[50, 90, 99],
        help="comma-separated percentiles (default 50,90,99)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:2000",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per-request deadline in s")
    p.add_argument(
        "--endpoint",
        choices=("grpc", "openai"),
        help="where the requests go: the router's gRPC API (the default), or the OpenAI front "
        "door, timing TTFT and ITL from its SSE stream as vllm bench serve does (its base URL: "
        "--openai URL, or the ready file's `openai`, as `prfaas serve --openai-port` writes "
        "it); the router still gives the stats and egress",
    )
    p.add_argument(
        "--openai",
        "--base-url",
        metavar="URL",
        help="the OpenAI front door's base URL (`prfaas openai`, e.g. http://127.0.0.1:8000/v1); "
        "implies --endpoint openai",
    )
    add_client_security_flags(p)
    add_json_flag(p)
    p.set_defaults(run=_run_bench)


def _link_device(text: str):
    from prfaas_jax.serving.loadgen.bench import LinkDevice

    try:
        return LinkDevice.parse(text)
    except UserError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _bench_target(args: argparse.Namespace):
    """The router address and the link device: from the flags, or from a ready file."""
    from prfaas_jax.serving.loadgen.bench import LinkDevice

    if args.router:
        return args.router, args.link_device
    ready = read_ready_file(args.ready_file)
    router, netns = ready["router"], ready.get("netns")
    link = args.link_device
    if link is None and netns:
        link = LinkDevice(netns["link_device"], netns["prfaas_namespace"])
    return router, link


def _openai_url(args: argparse.Namespace) -> str | None:
    """The front door's base URL when the requests go through it (`--endpoint openai`)."""
    if args.endpoint == "grpc" and args.openai:
        raise UserError("--endpoint grpc sends to the router; drop --openai URL")
    if args.openai or args.endpoint != "openai":
        return args.openai
    url = read_ready_file(args.ready_file).get("openai") if args.ready_file else None
    if not url:
        raise UserError(
            "--endpoint openai needs the front door's base URL: --openai URL, or a ready file "
            "of `prfaas serve --openai-port`"
        )
    return url


def _run_bench(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.loadgen.bench import BenchOptions, run_bench
    from prfaas_jax.serving.loadgen.bench_report import format_summary, summarize

    router, link_device = _bench_target(args)
    openai_url = _openai_url(args)
    opts = BenchOptions(
        router=router,
        wait_warm=True,
        link_device=link_device,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        input_dist=args.input_dist,
        input_len=args.input_len,
        range_ratio=args.range_ratio,
        lognormal_mu=args.lognormal_mu,
        lognormal_sigma=args.lognormal_sigma,
        length_scale=args.length_scale,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        seed=args.seed,
        percentiles=tuple(float(p) for p in args.metric_percentiles),
        goodput=_parse_goodput(args.goodput),
        timeout_s=args.timeout,
        security=client_security(args),
        openai_url=openai_url,
    )
    total = opts.num_prompts
    with progress("bench", total=total, unit="requests", quiet=args.json) as shown:
        records, context = run_bench(opts, on_done=lambda done, _: shown.update(completed=done))
    summary = summarize(records, context, opts)
    if args.json:
        print_json(summary)
    else:
        print(format_summary(summary, opts))
    return 0 if summary["failed"] == 0 else 1
