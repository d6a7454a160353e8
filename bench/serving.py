"""Serving under load: `prfaas serve` against `transformers serve` on one checkpoint, the same
cores and the same client, at a sweep of request rates.

Each layout is one random checkpoint written with ``save_pretrained`` (bench/engine.py's
``PRESET``: Kimi Linear, MoE, 32K vocabulary) with a word-level ``tokenizer.json`` (token i is
the word ``w<i>``, so a prompt of n words is n tokens to both servers). Two layouts:

    kimi-linear  KDA, KDA, KDA, MLA (bench/engine.py's). `transformers serve` runs it one request
                 at a time (``model.generate``): its continuous batching refuses a model with
                 ``linear_attention`` layers (its paged cache has an allocator for full and
                 sliding attention only).
    mla          the same model with MLA in every layer, which `transformers serve
                 --continuous-batching` runs (paged MLA cache).

Servers, each pinned with ``taskset`` to ``--cores`` and stopped (SIGINT to its process group,
then SIGKILL) when the run ends, fails or is interrupted:

    prfaas   `prfaas serve --openai-port 0` on the checkpoint `prfaas convert-hf` wrote from the
             same files: one PD prefill and one PD decode worker (a single-node cluster, no
             PrfaaS instance, prefix cache off: the prompts share nothing), ``[model] impl``
             bench/engine.py's, ``--max-slots`` decode slots (16: with more, a step over few
             busy slots costs more, since it copies their rows in and out; engine/decode.py);
             ``--set SECTION.KEY=VALUE`` (repeatable, the value in TOML) changes a setting of
             that cluster, e.g. ``engine.prefill_batch_rows=1`` or another instance mode
    transformers  `transformers serve DIR --device cpu --dtype float32`, OMP threads = cores

The client is the project's (serving/loadgen/openai_client.py, what `prfaas bench --openai`
uses): one streamed `/v1/completions` per request, greedy, the prompt as text, no
``ignore_eos`` (`transformers serve` refuses fields outside OpenAI's schema; the checkpoint has
no end-of-sequence id, so every reply runs to ``--output-len``, and one that does not — cut
short, or without its usage chunk — counts as failed), a stream over when the server closes it
(`transformers serve` sends no ``data: [DONE]``). Arrivals are Poisson at each rate
(`arrival_times`), prompt lengths the paper's truncated log-normal scaled to ``--max-prompt``
(`input_lengths`, as `prfaas bench --input-dist paper`); both servers get the same prompts at
the same offsets. Before timing, prfaas' prefill workers finish compiling their batched calls
(`wait_warm`), and each server answers a warm-up (one prompt per power-of-two
length up to ``--max-prompt``, then a burst), which compiles prfaas' shapes and warms
transformers' allocator. Metrics and goodput: bench/serving_metrics.py. Each rate also records
the CPU seconds each server's processes used (bench/process_cpu.py: per process, XLA's threads
apart), printed per process and per output token. Both servers' greedy
replies are compared, prompt by prompt.

    python bench/serving.py [--quick] [--json] [--json-out FILE] [--layouts kimi-linear,mla]
                            [--rates 1,2,4,8,16,24] [--num-prompts 32] [--output-len 32]
                            [--max-prompt 512] [--ttft-ms 1000] [--tpot-ms 100] [--cores 0,1]
                            [--max-slots 16] [--set SECTION.KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from prfaas_jax.serving.loadgen.bench import BenchOptions, InputDist, arrival_times, input_lengths
from prfaas_jax.serving.loadgen.openai_client import HTTPError, stream_completion
from prfaas_jax.serving.loadgen.warm_wait import wait_warm
from prfaas_jax.serving.proto import prfaas_pb2_grpc as pb_grpc
from prfaas_jax.serving.transport.security import router_channel
from prfaas_jax.toml_config import dumps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model" / "hf"))
import hf_fixtures  # the tests' checkpoint builder (tests/model/hf is not a package)
from engine import IMPL, PRESET  # bench/ is the script's own directory
from process_cpu import ProcessCpu, process_tree
from serving_cluster import cluster_sections
from serving_metrics import Objective, Reply, compare, format_table, summarize

# Up to where both servers saturate on 2 cores (`transformers serve`'s continuous batching near
# 6 req/s on the all-MLA layout, prfaas above it).
RATES = [1.0, 2.0, 4.0, 8.0, 16.0, 24.0]
LAYOUTS = {  # layout → (MLA layers, transformers serve's batching flag)
    "kimi-linear": ((3,), "--no-continuous-batching"),
    "mla": ((0, 1, 2, 3), "--continuous-batching"),
}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """``tokenizer.json``: word ``w<i>`` is token i, words split on whitespace; no special
    tokens, so neither server adds any or stops early."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def make_checkpoints(root: Path, layout: str) -> tuple[Path, Path]:
    """(the Hugging Face directory, the prfaas checkpoint converted from it)."""
    hf = root / f"{layout}-hf"
    with contextlib.redirect_stdout(sys.stderr):
        hf_fixtures.make_tiny_kimi_linear(hf, **{**PRESET, "full_attn_layers": LAYOUTS[layout][0]})
    write_word_tokenizer(hf, PRESET["vocab_size"])
    ckpt = root / f"{layout}-prfaas"
    convert = [sys.executable, "-m", "prfaas_jax.cli", "convert-hf", str(hf), str(ckpt), "--json"]
    subprocess.run(convert, check=True, stdout=subprocess.DEVNULL)
    return hf, ckpt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(base_url: str, path: str) -> dict:
    host, _, port = base_url.removeprefix("http://").split("/")[0].partition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("GET", path)
        reply = connection.getresponse()
        return json.loads(reply.read()) if reply.status == 200 else {}
    finally:
        connection.close()


@dataclasses.dataclass
class Server:
    name: str
    process: subprocess.Popen
    log: Path
    base_url: str = ""  # http://host:port/v1
    model: str = ""

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} exited ({self.process.returncode}):\n{tail}")


@contextlib.contextmanager
def running(name: str, argv: list[str], log: Path, env: dict | None = None) -> Iterator[Server]:
    """Start ``argv`` in a process group of its own; on leaving, SIGINT the group (both servers
    stop their children on it), then SIGKILL whatever is left after 30 s."""
    with log.open("w") as out:
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        yield Server(name, process, log)
    finally:
        _stop(name, process)


def _stop(name: str, process: subprocess.Popen) -> None:
    """SIGINT the server's group, give it 30 s, then SIGKILL the group (children it left); a
    second Ctrl-C while it stops goes straight to the kill."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=30)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        _log(f"{name} did not stop on SIGINT: killing it")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _wait_ready(server: Server, ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        server.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{server.name} not ready after {timeout_s:.0f} s (log {server.log})"
            )
        time.sleep(0.5)
    models = _get_json(server.base_url, "/v1/models").get("data") or [{}]
    server.model = models[0].get("id", "")


@contextlib.contextmanager
def prfaas_server(ckpt: Path, work: Path, cores: str, sections: dict) -> Iterator[Server]:
    config, ready_file = work / "cluster.toml", work / "ready.json"
    config.write_text(dumps(sections))
    argv = ["taskset", "-c", cores, sys.executable, "-m", "prfaas_jax.cli", "serve"]
    argv += ["--config", str(config), "--ready-file", str(ready_file), "--openai-port", "0"]
    argv += ["--log-dir", str(work / "prfaas-logs")]
    with running("prfaas serve", argv, work / "prfaas-serve.log") as server:

        def ready() -> bool:
            if not ready_file.exists():
                return False
            with contextlib.suppress(ValueError):
                server.base_url = json.loads(ready_file.read_text())["openai"]
            return bool(server.base_url)

        _wait_ready(server, ready, 600)
        # Its prefill workers compile their batched calls behind their start: not in the timing.
        with router_channel(json.loads(ready_file.read_text())["router"], None) as channel:
            wait_warm(pb_grpc.RouterStub(channel))
        yield server


@contextlib.contextmanager
def transformers_server(hf: Path, work: Path, cores: str, batching: str) -> Iterator[Server]:
    port = _free_port()
    argv = ["taskset", "-c", cores, "transformers", "serve", str(hf), batching, "--device", "cpu"]
    argv += ["--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cores.split(",")))}
    with running("transformers serve", argv, work / "transformers-serve.log", env) as server:
        server.base_url = f"http://127.0.0.1:{port}/v1"

        def ready() -> bool:  # /health answers once the model is loaded and warmed up
            try:
                _get_json(server.base_url, "/health")
            except OSError:
                return False
            return True

        _wait_ready(server, ready, 600)
        yield server


def send(server: Server, prompt: str, max_tokens: int, rec: Reply) -> None:
    """One streamed completion, timed as `prfaas bench --openai` times it, except that only a
    chunk with text is a token's arrival (both servers end with an empty chunk carrying
    ``finish_reason``, which the end-to-end latency counts)."""
    sent = last = time.perf_counter()
    try:
        for now, chunk in stream_completion(
            server.base_url, server.model, prompt, max_tokens, ignore_eos=False, until_done=False
        ):
            if "error" in chunk:
                error = chunk["error"]
                raise HTTPError(error.get("message", error) if isinstance(error, dict) else error)
            text = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if text:
                if rec.ttft is None:
                    rec.ttft = now - sent
                else:
                    rec.itl.append(now - last)
                last = now
                rec.text += text
            if chunk.get("usage"):
                rec.output_tokens = int(chunk["usage"]["completion_tokens"])
        rec.e2el = time.perf_counter() - sent
    except (HTTPError, OSError, ValueError) as err:
        rec.error = f"{type(err).__name__}: {str(err)[:200]}"


def run_rate(
    server: Server, prompts: list[str], lengths: list[int], offsets: np.ndarray, max_tokens: int
) -> tuple[list[Reply], float]:
    """Send every prompt at its offset; (the replies, first send → last reply in seconds)."""
    replies = [Reply(n, max_tokens) for n in lengths]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        start = time.perf_counter()
        futures = []
        for prompt, rec, offset in zip(prompts, replies, offsets, strict=True):
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            futures.append(pool.submit(send, server, prompt, max_tokens, rec))
        for future in futures:
            future.result()
        duration = time.perf_counter() - start
    return replies, duration


def _words(ids: np.ndarray) -> str:
    return " ".join(f"w{i}" for i in ids)


def warm_up(server: Server, max_prompt: int, max_tokens: int, rng: np.random.Generator) -> None:
    """One prompt per power-of-two length (each of prfaas' prefill shapes), then a burst."""
    lengths = [2**k for k in range(3, max_prompt.bit_length())] + [max_prompt]
    for n in lengths:
        rec = Reply(n, max_tokens)
        send(server, _words(rng.integers(0, PRESET["vocab_size"], n)), max_tokens, rec)
        if rec.error:
            raise RuntimeError(f"{server.name} failed a warm-up request: {rec.error}")
    burst = [int(n) for n in rng.integers(8, max_prompt, 8)]
    texts = [_words(rng.integers(0, PRESET["vocab_size"], n)) for n in burst]
    run_rate(server, texts, burst, np.zeros(len(burst)), max_tokens)


def workload(args: argparse.Namespace) -> tuple[list[str], list[int], dict[float, np.ndarray]]:
    """The prompts (as text), their lengths and each rate's send offsets: the same for both."""
    opts = BenchOptions(
        router="-",
        num_prompts=args.num_prompts,
        input_dist=InputDist.PAPER,
        output_len=args.output_len,
        seed=args.seed,
    )
    rng = np.random.default_rng(args.seed)
    lengths = [int(n) for n in input_lengths(opts, args.max_prompt, rng)]
    prompts = [_words(rng.integers(0, PRESET["vocab_size"], n)) for n in lengths]
    offsets = {rate: arrival_times(len(prompts), rate, 1.0, rng) for rate in args.rates}
    return prompts, lengths, offsets


def serve_sweep(
    server: Server, args: argparse.Namespace, objective: Objective
) -> tuple[dict[float, dict], dict[float, list[str]]]:
    """Warm up, then each rate in turn: (summary by rate, reply texts by rate)."""
    prompts, lengths, offsets = workload(args)
    _log(f"  {server.name} ({server.model}) at {server.base_url}: warming up")
    warm_up(server, args.max_prompt, args.output_len, np.random.default_rng(args.seed + 1))
    summaries, texts = {}, {}
    for rate in args.rates:
        server.check_alive()
        cpu = ProcessCpu(process_tree(server.process.pid))
        replies, duration = run_rate(server, prompts, lengths, offsets[rate], args.output_len)
        summaries[rate] = summarize(replies, duration, objective)
        summaries[rate]["cpu_s"] = cpu.used()
        texts[rate] = [r.text if r.complete else None for r in replies]
        s = summaries[rate]
        _log(
            f"  {server.name} at {rate:g} req/s: {s['completed']}/{s['requests']} done in "
            f"{duration:.1f} s, goodput {s['goodput']:.2f} req/s, TTFT P50 "
            f"{s['ttft_ms']['p50']:,.0f} ms, ITL P50 {s['itl_ms']['p50']:.1f} ms; "
            f"CPU s {cpu_line(s['cpu_s'])}"
        )
    return summaries, texts


def cpu_line(cpu_s: dict[str, dict[str, float]]) -> str:
    """``name total (XLA xla)`` for each process, by total CPU seconds."""
    rows = sorted(cpu_s.items(), key=lambda item: -item[1]["total"])
    return ", ".join(f"{name} {row['total']:.1f} (XLA {row['xla']:.1f})" for name, row in rows)


def cpu_table(ours: dict[float, dict], theirs: dict[float, dict]) -> str:
    """Per rate, each server's CPU seconds by process, and per output token."""
    lines = ["| rate (req/s) | server | CPU s by process (XLA threads) | CPU ms per output token |"]
    lines.append("|" + "---|" * 4)
    for rate in sorted(set(ours) & set(theirs)):
        for name, s in (("prfaas serve", ours[rate]), ("transformers serve", theirs[rate])):
            total = sum(row["total"] for row in s["cpu_s"].values())
            tokens = s["output_throughput"] * s["duration_s"]
            per_token = f"{total / tokens * 1e3:.1f}" if tokens else "–"
            lines.append(f"| {rate:g} | {name} | {cpu_line(s['cpu_s'])} | {per_token} |")
    return "\n".join(lines)


def bench_layout(root: Path, layout: str, args: argparse.Namespace) -> dict:
    _log(f"{layout}: writing the checkpoint")
    hf, ckpt = make_checkpoints(root, layout)
    objective = Objective(args.ttft_ms, args.tpot_ms)
    work = root / f"{layout}-runs"
    work.mkdir()
    max_len = args.max_prompt + args.output_len
    sections = cluster_sections(ckpt, IMPL, max_len, args.max_slots, args.set)
    with prfaas_server(ckpt, work, args.cores, sections) as server:
        ours, our_texts = serve_sweep(server, args, objective)
    batching = LAYOUTS[layout][1]
    with transformers_server(hf, work, args.cores, batching) as server:
        theirs, their_texts = serve_sweep(server, args, objective)
    same = {
        rate: sum(a is not None and a == b for a, b in zip(t, their_texts[rate], strict=True))
        for rate, t in our_texts.items()
    }
    return {
        "layout": layout,
        "mla_layers": list(LAYOUTS[layout][0]),
        "transformers_batching": batching.removeprefix("--"),
        "prfaas": ours,
        "transformers": theirs,
        "comparison": compare(ours, theirs),
        "equal_greedy_replies": same,
    }


def _parse_rates(text: str) -> list[float]:
    return sorted({float(r) for r in text.split(",") if r})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--layouts", default="kimi-linear,mla", help="of: " + ", ".join(LAYOUTS))
    parser.add_argument("--rates", type=_parse_rates, default=RATES, help="req/s")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per reply")
    parser.add_argument("--max-prompt", type=int, default=512, help="longest prompt (tokens)")
    parser.add_argument("--ttft-ms", type=float, default=1000.0, help="goodput's TTFT objective")
    parser.add_argument("--tpot-ms", type=float, default=100.0, help="goodput's TPOT objective")
    parser.add_argument("--max-slots", type=int, default=16, help="prfaas decode slots")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a prfaas cluster setting over the bench's (repeatable; VALUE in TOML)",
    )
    parser.add_argument("--cores", default="0,1", help="the cores both servers are pinned to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 prompts at 1, 4 and 16 req/s")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--json-out", help="also write the JSON to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.num_prompts = [1.0, 4.0, 16.0], 8
        args.output_len, args.max_prompt = 16, 128
    try:  # a malformed --set stops here, not after the checkpoints are written
        cluster_sections("-", IMPL, args.max_prompt + args.output_len, args.max_slots, args.set)
    except ValueError as err:
        parser.error(str(err))
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown or shutil.which("transformers") is None or shutil.which("taskset") is None:
        parser.error(f"unknown layouts {unknown}" if unknown else "needs transformers and taskset")
    # SIGTERM unwinds like Ctrl-C, so every server started is stopped. SIGINT gets Python's
    # handler even where it was ignored (a shell's background job): the servers then start with
    # SIGINT at its default, the way they stop on it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    _log(f"load average at start: {load_start}")
    try:
        with tempfile.TemporaryDirectory(prefix="prfaas-serving-bench-") as tmp:
            results = [bench_layout(Path(tmp), layout, args) for layout in layouts]
    except KeyboardInterrupt:
        _log("interrupted: every server started is stopped")
        return 130
    result = {
        "layouts": results,
        "objective": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
        "workload": {
            "num_prompts": args.num_prompts,
            "rates": args.rates,
            "output_len": args.output_len,
            "max_prompt": args.max_prompt,
            "input_dist": "paper, scaled to --max-prompt",
            "seed": args.seed,
        },
        "cores": args.cores,
        "prfaas_cluster": {"max_slots": args.max_slots, "settings": args.set},
        "load_average": {"start": load_start, "end": " ".join(f"{x:.2f}" for x in os.getloadavg())},
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"objective: TTFT ≤ {args.ttft_ms:g} ms and TPOT ≤ {args.tpot_ms:g} ms; cores {args.cores}"
    )
    print(f"load average at start {load_start}, at end {result['load_average']['end']}")
    for r in results:
        print(f"\n{r['layout']} (transformers serve {r['transformers_batching']})")
        print(format_table(r["prfaas"], r["transformers"], r["comparison"]))
        print(f"equal greedy replies by rate: {r['equal_greedy_replies']}")
        print(cpu_table(r["prfaas"], r["transformers"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
