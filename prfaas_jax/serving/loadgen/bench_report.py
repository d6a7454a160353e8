"""What a `prfaas bench` run sums to: `summarize` (the `--json` payload) and `format_summary`
(the table, laid out like `vllm bench serve`'s), from the records and context of
serving/loadgen/bench.py's `run_bench`.

Metrics, per vLLM's definitions: TTFT (send → first token), TPOT = (E2EL − TTFT)/(n − 1),
ITL (gaps between token-carrying messages), E2EL; mean, median, std and the chosen percentiles;
goodput = requests/s that meet every SLO given (DistServe). PrfaaS-specific: the fraction of
requests offloaded (from each RequestReport, or the router's counters through the front door),
the share of requests whose state the router sent narrowed (`[wire]`, by precision, from its
counters), the exposed transfer per route (prefill end → first token, the report's
`exposed_transfer_s`, of requests served in one attempt), the inter-cluster egress during the
run (the router's counter before and after) and, given the link's network device, the bytes the
kernel sent through it, headers and retransmissions included, next to the router's count of
state bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prfaas_jax.serving.loadgen.bench import BenchOptions, BenchResult

METRICS = ("ttft", "tpot", "itl", "e2el")


def _stats(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values if len(values) else [0.0]) * 1e3
    out = {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms))}
    out["std_ms"] = float(ms.std())
    out.update({f"p{p:g}_ms": float(np.percentile(ms, p)) for p in percentiles})
    return out


def summarize(records: list[BenchResult], context: dict, opts: BenchOptions) -> dict:
    done = [r for r in records if r.error is None and r.ttft is not None and r.e2el is not None]
    duration = context["duration_s"]
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    values = {
        "ttft": [r.ttft for r in done],
        "tpot": tpot,
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2el for r in done],
    }

    def meets(r: BenchResult) -> bool:
        per = {"ttft": r.ttft, "e2el": r.e2el}
        if r.output_tokens > 1:
            per["tpot"] = (r.e2el - r.ttft) / (r.output_tokens - 1)
        return all(per.get(k, 0.0) * 1e3 <= slo for k, slo in opts.goodput.items())

    if all(r.route for r in done):
        offload_fraction = sum(r.route == "prfaas" for r in done) / len(done) if done else 0.0
    else:  # through the OpenAI front door: the router's counters
        prfaas, pd = context["routed"]
        offload_fraction = prfaas / (prfaas + pd) if prfaas + pd else 0.0
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    summary = {
        "model": context["model"],
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "request_goodput": sum(meets(r) for r in done) / duration if opts.goodput else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "mean_input_len": input_tokens / len(done) if done else 0.0,
        "offload_fraction": offload_fraction,
        "wire_narrowed": dict(context.get("wire_narrowed", {})),
        "narrowed_fraction": (
            sum(context.get("wire_narrowed", {}).values()) / len(done) if done else 0.0
        ),
        "egress_bytes": context["egress_bytes"],
        "egress_bytes_per_s": context["egress_bytes"] / duration,
        "egress_gbps": context["egress_bytes"] * 8 / 1e9 / duration,
        # The kernel's count on the link device (None: no device given): state bytes plus
        # gRPC, TCP and IP framing, retransmissions and anything else that crossed it.
        "link_kernel_bytes": context.get("link_kernel_bytes"),
        "link_rtt_s": context.get("link_rtt_s", 0.0),
        "link_retransmitted": context.get("link_retransmitted", 0),
        "namespace_retransmitted": context.get("namespace_retransmitted", 0),
        "threshold_start": context["threshold_start"],
        "threshold_end": context["threshold_end"],
    }
    router = context.get("router")
    if router is not None:
        lookups = router["lookups"]
        summary["router"] = {
            "cpu_ms_per_request": 1e3 * router["cpu_s"] / len(done) if done else 0.0,
            "lookup_mean_ms": 1e3 * router["lookup_s"] / lookups if lookups else None,
            "cache_index": router["cache_index"],
            "index_answered": router["index_answered"],
            "index_asked": router["index_asked"],
            "index_entries": router["index_entries"],
            "token_hit_rate": router["hit_rate"],
        }
    for name in METRICS:
        summary[name] = _stats(values[name], opts.percentiles)
    # Per route, of the requests served in one attempt: the transfer compute did not hide.
    exposed: dict[str, list[float]] = {}
    for r in done:
        if r.exposed_transfer is not None:
            exposed.setdefault(r.route, []).append(r.exposed_transfer)
    summary["exposed_transfer"] = {
        route: _stats(exposed[route], opts.percentiles)
        for route in ("prfaas", "pd")
        if route in exposed
    }
    return summary


def format_summary(s: dict, opts: BenchOptions) -> str:
    rows: list[tuple[str, str]] = [
        ("Successful requests", str(s["completed"])),
        ("Failed requests", str(s["failed"])),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Mean input tokens", f"{s['mean_input_len']:.1f}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
    ]
    if s["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", f"{s['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
        ("Offloaded to PrfaaS", f"{s['offload_fraction']:.1%}"),
    ]
    if s.get("wire_narrowed"):
        each = ", ".join(f"{p} {n}" for p, n in sorted(s["wire_narrowed"].items()))
        rows.append(("Sent narrowed ([wire])", f"{s['narrowed_fraction']:.1%} ({each})"))
    rows += [
        ("Inter-cluster egress (bytes)", str(s["egress_bytes"])),
        ("Inter-cluster egress (MB/s)", f"{s['egress_bytes_per_s'] / 1e6:.3f}"),
    ]
    if s["link_kernel_bytes"] is not None:
        kernel, egress = s["link_kernel_bytes"], s["egress_bytes"]
        rows.append(("Egress on the link device (bytes)", str(kernel)))
        if egress:
            rows.append(("  over the router's count", f"{kernel / egress - 1:+.1%}"))
    rtt = s.get("link_rtt_s") or 0.0
    rows += [
        ("Link RTT, measured by TCP (ms)", f"{rtt * 1e3:.1f}" if rtt else "–"),
        ("TCP retransmissions on the transfers", str(s.get("link_retransmitted", 0))),
    ]
    if s["link_kernel_bytes"] is not None:
        rows.append(("  in the PrfaaS namespace", str(s.get("namespace_retransmitted", 0))))
    rows += [
        ("Threshold t (start → end)", f"{s['threshold_start']:.0f} → {s['threshold_end']:.0f}"),
    ]
    router = s.get("router")
    if router is not None:
        rows.append(("Router CPU per request (ms)", f"{router['cpu_ms_per_request']:.2f}"))
        if router["lookup_mean_ms"] is not None:
            rows.append(
                ("Mean prefix lookup at the router (ms)", f"{router['lookup_mean_ms']:.3f}")
            )
            rows.append(("Prompt tokens reused from a cache", f"{router['token_hit_rate']:.1%}"))
        if router["cache_index"]:
            answered, asked = router["index_answered"], router["index_asked"]
            rows.append(("Cache index: answered / asked", f"{answered} / {asked}"))
            rows.append(("Cache index: (key, instance) entries", str(router["index_entries"])))
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)"}
    titles.update({"itl": "Inter-token Latency", "e2el": "End-to-end Latency"})
    lines = ["{:=^56}".format(" Serving Benchmark Result ")]
    lines += [f"{k:<40}{v:>16}" for k, v in rows]
    for name in METRICS:
        lines.append("{:-^56}".format(f" {titles[name]} "))
        for key, value in s[name].items():
            stat = key.removesuffix("_ms")
            label = stat.upper() if stat.startswith("p") else stat.capitalize()
            lines.append(f"{f'{label} {name.upper()} (ms)':<40}{value:>16.2f}")
    names = {"prfaas": "PrfaaS", "pd": "PD"}
    if s.get("exposed_transfer"):
        lines.append("{:-^56}".format(" Exposed Transfer (prefill end → 1st token) "))
        for route, stats in s["exposed_transfer"].items():
            for key in ("mean_ms", "median_ms", f"p{max(opts.percentiles, default=99):g}_ms"):
                if key in stats:
                    stat = key.removesuffix("_ms")
                    label = stat.upper() if stat.startswith("p") else stat.capitalize()
                    lines.append(f"{f'{label} {names[route]} (ms)':<40}{stats[key]:>16.2f}")
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    lines.append("=" * 56)
    return "\n".join(lines)
