"""The commands that start or drive a cluster of processes: `add_demo`, `add_serve`, `add_certs`
and `add_soak` (`prfaas bench` is cli/bench_command.py).

Each ``add_<name>`` declares a subcommand's flags and sets its ``_run_<name>``, which imports
the serving layer (and gRPC) only when the command runs. demo and soak show their progress on
stderr (cli/progress.py). Also the flag groups every client of a cluster shares
(cli/bench_command.py, cli/chat_command.py, cli/openai_command.py): the router, its ready file,
TLS and tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from prfaas_jax.cli.flags import add_json_flag
from prfaas_jax.cli.progress import progress
from prfaas_jax.errors import UserError


def add_netns_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--netns",
        action="store_true",
        help="run the PrfaaS and PD clusters in network namespaces of their own, joined by a "
        "veth the kernel shapes to [link] bandwidth_mbps (tbf; needs root); the router stays "
        "here. See docs/serving.md",
    )


def add_router_flags(p: argparse.ArgumentParser, *, ready_file_help: str = "its router") -> None:
    """--router ADDR | --ready-file F, one of them required (a ready file is read by
    `read_ready_file`)."""
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--router", help="router address host:port")
    target.add_argument(
        "--ready-file", help=f"a `prfaas serve --ready-file` file: {ready_file_help}"
    )


def add_client_security_flags(p: argparse.ArgumentParser) -> None:
    """How a client reaches a router behind `[security]` (read back by `client_security`)."""
    p.add_argument(
        "--ca-cert", default="", help="PEM CA that signed the router's certificate: use TLS"
    )
    p.add_argument(
        "--token-file", default="", help="file holding the router's bearer token ([security])"
    )
    p.add_argument("--cert", default="", help="client certificate PEM, for a router without token")
    p.add_argument("--key", default="", help="its private key PEM")


def client_security(args: argparse.Namespace):
    from prfaas_jax.serving.transport.security import client_section

    return client_section(
        ca_cert=args.ca_cert, cert=args.cert, key=args.key, token_file=args.token_file
    )


def read_ready_file(path: str) -> dict:
    """A `prfaas serve --ready-file` file, with its router address checked."""
    try:
        ready = json.loads(Path(path).read_text())
        if not isinstance(ready["router"], str):
            raise TypeError("no router address in it")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"cannot read the ready file {path}: {err}") from None
    return ready


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: a toy PrfaaS-PD cluster of real processes serving a checked workload",
        description="Start the toy cluster (router, PrfaaS prefill, PD prefill and decode "
        "workers as separate processes on loopback, with an emulated inter-cluster link), send "
        "a concurrent mix of short and long prompts, print each request's route, uncached "
        "length, threshold, TTFT, decode tokens/s and state bytes against state_nbytes, and "
        "check every output against single-process generation. Exit status 1 on any mismatch.",
    )
    p.add_argument(
        "--config",
        default="toy",
        help="cluster config: a name under configs/clusters/ or a TOML path (default: toy)",
    )
    p.add_argument("--log-dir", help="where the processes' logs go (default: a temp dir)")
    add_netns_flag(p)
    add_json_flag(p)
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.loadgen.demo import run_demo

    with progress("demo: starting the cluster", unit="requests", quiet=args.json) as shown:

        def served(done: int, total: int) -> None:
            shown.update(completed=done, total=total, description="demo: requests served")

        return run_demo(
            args.config,
            as_json=args.json,
            log_dir=args.log_dir,
            on_served=served,
            netns=args.netns,
        )


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run a toy cluster (router + workers as processes on loopback) until Ctrl-C",
        description="Start the router and one worker process per instance of the cluster "
        "config, wait until every server reports SERVING, write the ready file, and run until "
        "SIGINT or SIGTERM, then stop every process.",
        epilog="example: prfaas serve --ready-file ready.json, then in another shell: prfaas "
        "chat --ready-file ready.json",
    )
    p.add_argument(
        "--config",
        default="toy",
        help="cluster config: a name under configs/clusters/ or a TOML path (default: toy, "
        "the demo's cluster)",
    )
    p.add_argument(
        "--ready-file",
        help="write JSON {router, metrics, model, seed, workers: {name: {address, pid, role}}} "
        "here once every server is SERVING (removed on shutdown; router, metrics and pid are "
        "null for what another machine runs)",
    )
    p.add_argument("--log-dir", help="where the processes' logs go (default: a temp dir)")
    p.add_argument(
        "--only",
        type=_parts,
        default=_parts("router,prfaas,pd"),
        metavar="PARTS",
        help="the parts of the cluster this machine runs, comma-separated from router, prfaas "
        "and pd (default: all); another machine runs the rest at the config's [hosts] "
        "addresses (docs/serving.md, Several machines)",
    )
    p.add_argument(
        "--openai-port",
        type=int,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API in front of the router on "
        "127.0.0.1:PORT (0: any free port; the ready file names it as openai); see prfaas openai",
    )
    add_netns_flag(p)
    p.set_defaults(run=_run_serve)


def _parts(text: str) -> frozenset[str]:
    """``router,pd`` → the parts; the launcher checks them (serving/cluster/machines.py)."""
    return frozenset(filter(None, (p.strip() for p in text.split(","))))


def _run_serve(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.cluster.serve import serve

    if args.openai_port is not None and not 0 <= args.openai_port < 65536:
        raise UserError(f"--openai-port must be in [0, 65536), got {args.openai_port}")
    return serve(
        args.config,
        args.ready_file,
        log_dir=args.log_dir,
        netns=args.netns,
        only=args.only,
        openai_port=args.openai_port,
    )


def add_certs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "certs",
        help="make a CA, node certificates and a router token for a cluster's [security]",
        description="Write ca.pem (a new CA), node.pem and node-key.pem (a certificate it "
        "signed for 127.0.0.1 and localhost, for servers and clients alike; every process of "
        "a toy cluster shares it) and router.token (a random bearer token); the key and the "
        "token are readable by their owner only. The CA's key is not kept. With --config, "
        "everything a cluster over several machines needs: one folder per host of its [hosts] "
        "(OUT/HOST/: the CA, that host's own certificate and key, the token), to copy to each "
        "machine as the same folder. Point the cluster config's [security] section at them "
        "(docs/serving.md, Security).",
        epilog="examples: prfaas certs --out certs/ --days 30; prfaas certs --config "
        "two-machines.toml --out certs/",
    )
    p.add_argument("--out", required=True, help="directory to write into (created if missing)")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument(
        "--config",
        help="a cluster config whose [hosts] name the machines: one certificate per host",
    )
    p.set_defaults(run=_run_certs)


def _run_certs(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.cluster_config import load_cluster_config, served_hosts
    from prfaas_jax.serving.transport.certs import (
        write_cluster_credentials,
        write_host_credentials,
    )

    if args.days < 1:
        raise UserError("--days must be ≥ 1")
    if args.config is None:
        paths = write_cluster_credentials(args.out, days=args.days)
        names = ", ".join(path.name for path in paths.values())
        print(f"wrote {names} to {args.out}; for the cluster config:\n\n[security]")
        for key, path in paths.items():
            print(f'{key} = "{path.resolve()}"')
        return 0
    config = load_cluster_config(args.config, security_files=False)
    hosts = served_hosts(config)
    written = write_host_credentials(args.out, hosts, days=args.days)
    out = Path(args.out)
    print(
        f"wrote one folder per host to {out}, each with ca.pem, node.pem, node-key.pem, "
        "router.token:"
    )
    for host in written:
        print(f"  {out / host}/  for {host}")
    folder = "certs"
    print(
        f"\ncopy each to its machine as {folder}/ beside the config; on every machine:\n\n"
        "[security]"
    )
    for key, path in next(iter(written.values())).items():
        print(f'{key} = "{folder}/{path.name}"')
    return 0


def add_soak(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "soak",
        help="a bounded soak of a fake-engine cluster under worker kills and transfer faults",
        description="Start the cluster of --config with worker restarts on (default: "
        "configs/clusters/faults.toml: fake engines, 1 PrfaaS prefill, 2 PD prefill, 2 PD "
        "decode, 3 % of state transfers get a corrupted frame and 3 % a dropped link), send "
        "Poisson arrivals at --rate for --duration seconds while SIGKILLing a worker every "
        "--kill-every seconds (the roles in turn; a decode kill picks a worker with requests "
        "mid-stream), and wait for every request. Checks each request as its client saw it: "
        "accepted or rejected at admission; completed, failed fast (a status code) or lost "
        "(no answer within --deadline); duplicated (tokens delivered twice); wrong (tokens "
        "other than the fake engine's, which depend on the whole sequence, so a resume from "
        "the wrong place shows). Prints a table of those counts, the faults (kills, restarts, "
        "corrupted frames, dropped transfers, router retries and resumes) and the latency of "
        "clean, retried and resumed requests, then the same as JSON. Exit status 1 when a "
        "request was lost, duplicated or wrong. With --netns the soak runs over the emulated "
        "WAN (default config: soak-wan) under a seeded fault schedule instead of --kill-every: "
        "loss bursts, link blackholes, RTT spikes, bandwidth drops, SIGKILL and SIGSTOP/SIGCONT "
        "of each worker role, SIGTERM of the PrfaaS prefill worker and of an OpenAI front door "
        "with requests in flight, and corrupted frames; greedy, seeded-sampled and front-door "
        "requests, prompts up to 16K tokens, shared prefixes, each wire precision (native, bf16, "
        "int8, fp8_e4m3) in turn. It reports each fault kind (scheduled, injected, detected, "
        "recovered, requests in flight and affected), the RSS trend of every incarnation of "
        "every process and whether each process's memory stayed bounded, and exits 1 also when "
        "a kind was injected fewer than twice (when the duration allows two rounds: 10 minutes "
        "does) or a process's memory grew past the rule (docs/serving.md).",
        epilog="example: prfaas soak --duration 60 --kill-every 10 --json; "
        "prfaas soak --netns --duration 600",
    )
    p.add_argument(
        "--config",
        help="cluster config with fake engines: a name under configs/clusters/ or a TOML path "
        "(default: faults; with --netns soak-wan)",
    )
    p.add_argument(
        "--netns",
        action="store_true",
        help="over the emulated WAN in network namespaces, with the fault schedule (needs root; "
        "docs/serving.md)",
    )
    p.add_argument(
        "--duration", type=float, default=180.0, help="seconds of arrivals (default 180)"
    )
    p.add_argument(
        "--rate", type=float, default=2.0, help="requests per second, Poisson (default 2)"
    )
    p.add_argument(
        "--kill-every", type=float, default=20.0, help="seconds between kills; 0: none (default 20)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload and kill choices (default 0)")
    p.add_argument(
        "--deadline",
        type=float,
        default=150.0,
        help="seconds before an unanswered request counts as lost (default 150)",
    )
    p.add_argument("--log-dir", help="keep the cluster's logs here (default: a temp dir)")
    add_json_flag(p, help="print the JSON only")
    p.set_defaults(run=_run_soak)


def _run_soak(args: argparse.Namespace) -> int:
    from prfaas_jax.serving.loadgen.netns_soak import NetnsSoakOptions, run_netns_soak
    from prfaas_jax.serving.loadgen.soak import SoakOptions, run_soak

    if args.netns:
        netns_options = NetnsSoakOptions(
            duration_s=args.duration, rate=args.rate, seed=args.seed, deadline_s=args.deadline
        )
        run = functools.partial(run_netns_soak, args.config or "soak-wan", netns_options)
        report = _show_soak(args, "faults", run)
        return 0 if report.passed() else 1
    options = SoakOptions(
        duration_s=args.duration,
        rate=args.rate,
        kill_every_s=args.kill_every,
        seed=args.seed,
        deadline_s=args.deadline,
    )
    report = _show_soak(
        args, "kills", functools.partial(run_soak, args.config or "faults", options)
    )
    counts = report.counts()
    return 1 if counts["lost"] or counts["duplicated"] or counts["wrong"] else 0


def _show_soak(args: argparse.Namespace, faults: str, run):
    """Run a soak (`run(log_dir=…, progress=…)`) behind a progress bar; print its table (unless
    --json) and its JSON; return its report."""
    from prfaas_jax.serving.loadgen.soak import SoakProgress

    with progress(
        "soak: starting the cluster", total=args.duration, unit="s", quiet=args.json
    ) as shown:

        def tick(now: SoakProgress) -> None:
            shown.update(
                completed=min(now.elapsed_s, args.duration),
                description=f"soak: {now.sent} sent, {now.ended} ended, {now.kills} {faults}",
            )

        report = run(log_dir=args.log_dir, progress=tick)
    if not args.json:
        print(report.format_table())
        print()
    # One line, so a log of many runs holds one JSON object per line.
    print(json.dumps(report.to_dict()))
    return report
