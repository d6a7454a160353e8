"""Engine throughput against ``transformers`` on the same weights: prefill and decode tokens/s.

One random Kimi-Linear checkpoint (KDA + NoPE MLA at 3:1, DeepSeek-style MoE; ``PRESET``) is
written with ``save_pretrained`` (tests/model/hf/hf_fixtures.py) and loaded twice: by
``transformers`` (float32, CPU, eval, ``torch.inference_mode``) and by
``prfaas_jax.model.hf.load_hf``.

    prefill  one prompt of T tokens, batch 1
             prfaas: ``PrefillEngine.prefill`` (wall time: token upload, the compiled block,
             the first-token sample, the result state)
             HF:     one ``model(ids, use_cache=True, logits_to_keep=1)`` forward, as
                     ``generate`` runs its prefill
    decode   B prompts of ``--context`` tokens, then ``--steps`` greedy tokens per row
             prfaas: B slots of a ``DecodeEngine`` filled by ``PrefillEngine``; ``step()`` calls
             HF:     a batch prefill, then ``model(next_B1, cache=cache)`` once per token

Both sides are checked against each other: prefill's first greedy token, and each decode row's
whole greedy continuation. Each prfaas row is also held against the machine's own ceilings,
measured in the same run (bench/roofline.py: a jitted fp32 matmul's FLOP/s, a jitted read's
bytes/s): its counted FLOPs (planning/prefill_cost.py, planning/decode_cost.py) and the bytes it
must read (the weights once — for a decode step only the experts its rows route to — and every
row's state) give achieved GFLOP/s and GB/s, the ceiling the row runs into by its arithmetic
intensity, and the fraction of that ceiling reached. prfaas compile time is excluded from
tokens/s and reported apart (first call minus a warm one). A prefill timing is the best of
``--repeats`` after a warm-up (HF runs stop early past ``--budget`` seconds: an 8K HF prefill is
timed once or twice). Decode tokens/s is B over the median of ``--steps`` timed steps, after
``--warmup`` untimed ones (the mean is in the JSON too). Timings on a shared machine are noisy —
PyTorch's OpenMP threads stall badly when the cores are oversubscribed — so the load average is
printed at start and end.

    python bench/engine.py [--json] [--lengths 512,2048,8192] [--batches 1,8,32]
                           [--context 512] [--steps 64] [--repeats 3] [--budget 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from prfaas_jax.engine.decode import DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.model.hf import load_hf
from prfaas_jax.planning.decode_cost import (
    decode_step_bytes,
    decode_step_flops,
    decode_weight_bytes,
)
from prfaas_jax.planning.prefill_cost import prefill_flops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model" / "hf"))
import hf_fixtures  # the tests' checkpoint builder (tests/model/hf is not a package)
from roofline import bound, ceilings, fraction  # bench/ is the script's own directory

# A small Kimi-Linear: 4 blocks KDA, KDA, KDA, MLA; the first MLP dense, the rest MoE.
PRESET = dict(
    seed=0,
    num_layers=4,
    full_attn_layers=(3,),
    first_k_dense=1,
    hidden_size=512,
    intermediate_size=1024,
    num_heads=4,  # MLA
    kv_lora_rank=256,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    linear_num_heads=4,  # KDA
    linear_head_dim=128,
    num_experts=8,
    top_k=2,
    num_shared_experts=1,
    moe_intermediate_size=256,
    vocab_size=32000,
    init_std=0.02,
)
IMPL = "reference"  # KDA by its token scan: on CPU faster than the chunked form (docs/kernels.md)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _best(run: Callable[[], object], repeats: int, budget_s: float) -> tuple[float, int, object]:
    """Best wall time of up to ``repeats`` calls (fewer once ``budget_s`` is spent; ≥ 1)."""
    times: list[float] = []
    out = None
    while len(times) < repeats and (not times or sum(times) < budget_s):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return min(times), len(times), out


class HfModel:
    """The ``transformers`` side: greedy prefill and batched cached decode."""

    def __init__(self, path: Path, attn: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(2)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn
        ).eval()

    def prefill(self, ids_BT: np.ndarray) -> tuple[np.ndarray, object]:
        """Greedy next token per row ``[B]`` and the cache."""
        with self.torch.inference_mode():
            out = self.model(
                input_ids=self.torch.from_numpy(ids_BT), use_cache=True, logits_to_keep=1
            )
        return out.logits[:, -1].argmax(-1).numpy(), out.cache

    def step(self, tokens_B: np.ndarray, cache: object) -> np.ndarray:
        with self.torch.inference_mode():
            out = self.model(
                input_ids=self.torch.from_numpy(tokens_B[:, None]), cache=cache, use_cache=True
            )
        return out.logits[:, -1].argmax(-1).numpy()


def bench_prefill(
    hf: HfModel, engine: PrefillEngine, lengths: list[int], repeats: int, budget_s: float
) -> list[dict]:
    rng = np.random.default_rng(1)
    vocab = engine.cfg.vocab_size
    hf.prefill(rng.integers(0, vocab, (1, 64)))  # warm-up: allocator, thread pool
    rows = []
    for length in lengths:
        ids = rng.integers(0, vocab, length).astype(np.int64)
        start = time.perf_counter()
        first = engine.prefill(ids)  # compiles this length's block
        first_call_s = time.perf_counter() - start
        ours_s, ours_runs, ours = _best(lambda ids=ids: engine.prefill(ids), repeats, budget_s)
        hf_s, hf_runs, (hf_token, _) = _best(
            lambda ids=ids: hf.prefill(ids[None]), repeats, budget_s
        )
        rows.append(
            {
                "length": length,
                "prfaas_tok_s": length / ours_s,
                "hf_tok_s": length / hf_s,
                "ratio": hf_s / ours_s,
                "prfaas_s": ours_s,
                "hf_s": hf_s,
                "prfaas_runs": ours_runs,
                "hf_runs": hf_runs,
                "prfaas_compile_s": max(first_call_s - ours_s, 0.0),
                "first_token_match": bool(ours.first_token == first.first_token == hf_token[0]),
            }
        )
        _log(f"  prefill T={length}: prfaas {ours_s:.3f} s, HF {hf_s:.3f} s ({hf_runs} runs)")
    return rows


def _decode_prfaas(
    prefill: PrefillEngine, prompts: np.ndarray, steps: int, warmup: int
) -> tuple[np.ndarray, float, np.ndarray]:
    """(seconds of each timed step, compile seconds, tokens [B, 1 + warmup + steps])."""
    batch, context = prompts.shape
    total = warmup + steps
    engine = DecodeEngine(
        prefill.cfg, prefill.params, max_slots=batch, max_len=context + total, impl=prefill.impl
    )
    tokens = np.zeros((batch, 1 + total), np.int64)
    for prompt in prompts:
        result = prefill.prefill(prompt)
        slot = engine.insert(result.state, result.first_token, max_new_tokens=total)
        tokens[slot, 0] = result.first_token
    step_s = []
    for index in range(1, 1 + total):
        start = time.perf_counter()
        out = engine.step()
        step_s.append(time.perf_counter() - start)
        for slot, token in out:
            tokens[slot, index] = token
    timed = np.asarray(step_s[warmup:])
    return timed, max(step_s[0] - float(np.median(timed)), 0.0), tokens


def _decode_hf(
    hf: HfModel, prompts: np.ndarray, steps: int, warmup: int
) -> tuple[np.ndarray, np.ndarray]:
    """(seconds of each timed step, tokens [B, 1 + warmup + steps])."""
    token, cache = hf.prefill(prompts)
    tokens = [token]
    step_s = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        token = hf.step(token, cache)
        step_s.append(time.perf_counter() - start)
        tokens.append(token)
    return np.asarray(step_s[warmup:]), np.stack(tokens, axis=1)


def bench_decode(
    hf: HfModel,
    prefill: PrefillEngine,
    batches: list[int],
    context: int,
    steps: int,
    warmup: int,
) -> list[dict]:
    rng = np.random.default_rng(2)
    rows = []
    for batch in batches:
        prompts = rng.integers(0, prefill.cfg.vocab_size, (batch, context)).astype(np.int64)
        ours_steps, compile_s, tokens = _decode_prfaas(prefill, prompts, steps, warmup)
        hf_steps, hf_tokens = _decode_hf(hf, prompts, steps, warmup)
        # The median step: robust to the stalls other jobs cause on a shared machine.
        ours_s, hf_s = float(np.median(ours_steps)), float(np.median(hf_steps))
        rows.append(
            {
                "batch": batch,
                "prfaas_tok_s": batch / ours_s,
                "hf_tok_s": batch / hf_s,
                "ratio": hf_s / ours_s,
                "prfaas_step_ms": 1e3 * ours_s,
                "hf_step_ms": 1e3 * hf_s,
                "prfaas_mean_step_ms": 1e3 * float(np.mean(ours_steps)),
                "hf_mean_step_ms": 1e3 * float(np.mean(hf_steps)),
                "prfaas_compile_s": compile_s,
                "first_token_match": bool(np.array_equal(tokens[:, 0], hf_tokens[:, 0])),
                "rows_matching_all_tokens": int(np.sum(np.all(tokens == hf_tokens, axis=1))),
            }
        )
        _log(
            f"  decode B={batch}: prfaas {rows[-1]['prfaas_step_ms']:.1f} ms/step, "
            f"HF {rows[-1]['hf_step_ms']:.1f} ms/step"
        )
    return rows


def add_roofline(row: dict, flops: float, nbytes: float, seconds: float, machine: dict) -> None:
    """The row's counted work, its achieved rates and its share of the binding ceiling."""
    row.update(
        flops=flops,
        bytes=nbytes,
        achieved_flops_s=flops / seconds,
        achieved_bytes_s=nbytes / seconds,
        bound=bound(flops, nbytes, machine),
        fraction_of_ceiling=fraction(flops, nbytes, seconds, machine),
    )


def _table(title: str, key: str, rows: list[dict]) -> str:
    header = (
        key, "prfaas tok/s", "HF tok/s", "ratio", "GFLOP/s", "GB/s", "bound", "of ceiling",
        "prfaas compile (s)", "greedy match",
    )  # fmt: skip
    lines = [header]
    for r in rows:
        match = "yes" if r["first_token_match"] else "NO"
        if "rows_matching_all_tokens" in r:
            match = f"{r['rows_matching_all_tokens']}/{r['batch']} rows"
        lines.append(
            (
                str(r[key]),
                f"{r['prfaas_tok_s']:,.0f}",
                f"{r['hf_tok_s']:,.0f}",
                f"{r['ratio']:.1f}x",
                f"{r['achieved_flops_s'] / 1e9:,.1f}",
                f"{r['achieved_bytes_s'] / 1e9:,.1f}",
                r["bound"],
                f"{100 * r['fraction_of_ceiling']:.0f} %",
                f"{r['prfaas_compile_s']:.1f}",
                match,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    body = "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines
    )
    return f"{title}\n{body}"


def _ceilings_line(machine: dict) -> str:
    return (
        f"ceilings measured in this run: matmul {machine['matmul_flops'] / 1e9:,.0f} GFLOP/s, "
        f"read {machine['read_bytes_s'] / 1e9:,.1f} GB/s "
        f"(ridge {machine['ridge_flops_per_byte']:.1f} FLOP/byte)"
    )


def _environment(cfg, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    return {
        "model": {
            "layers": [str(kind) for kind in cfg.layers],
            "mlps": [str(kind) for kind in cfg.mlps],
            "hidden_dim": cfg.hidden_dim,
            "vocab_size": cfg.vocab_size,
            "kda": f"{cfg.linear.num_heads} heads x {cfg.linear.head_dim}",
            "mla": (
                f"{cfg.mla.num_heads} heads, kv_lora_rank {cfg.mla.kv_lora_rank}, "
                f"qk {cfg.mla.qk_nope_head_dim}+{cfg.mla.qk_rope_head_dim}, "
                f"v {cfg.mla.v_head_dim}"
            ),
            "moe": (
                f"{cfg.moe.num_experts} experts top-{cfg.moe.top_k} x {cfg.moe.expert_dim}, "
                f"{cfg.moe.num_shared_experts} shared"
            ),
            "dtype": cfg.dtype,
        },
        "prfaas": {"impl": IMPL, "chunk_len": args.chunk_len},
        "hf": {"attn_implementation": args.hf_attn, "torch_threads": torch.get_num_threads()},
        "decode": {"context": args.context, "steps": args.steps, "warmup": args.warmup},
        "repeats": args.repeats,
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "machine": {"cpu_count": os.cpu_count(), "arch": platform.machine()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048,8192", help="prefill prompt lengths")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="decode prompt length")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per HF row")
    parser.add_argument("--chunk-len", type=int, default=8192, help="PrefillEngine chunk_len")
    parser.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    batches = [int(n) for n in args.batches.split(",") if n]
    repeats = max(args.repeats, 1)
    load_start = _load()
    _log(f"load average at start: {load_start}")
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        path = hf_fixtures.make_tiny_kimi_linear(tmp, **PRESET)
        cfg, params = load_hf(path, name="bench-kimi-linear")
        hf = HfModel(path, args.hf_attn)
    env = _environment(cfg, args)
    _log(json.dumps(env["model"]))
    machine = ceilings(repeats=repeats)
    _log(_ceilings_line(machine))
    engine = PrefillEngine(cfg, params, impl=IMPL, chunk_len=args.chunk_len)
    prefill_rows = bench_prefill(hf, engine, lengths, repeats, args.budget)
    for row in prefill_rows:  # FLOP-bound: every weight read once, every expert touched
        work = prefill_flops(cfg, row["length"]), decode_weight_bytes(cfg, row["length"])
        add_roofline(row, *work, row["prfaas_s"], machine)
    decode_rows = bench_decode(hf, engine, batches, args.context, args.steps, args.warmup)
    context = args.context + args.warmup + args.steps / 2  # a timed step's mean context
    for row in decode_rows:
        batch = row["batch"]
        work = decode_step_flops(cfg, batch, context), decode_step_bytes(cfg, batch, context)
        add_roofline(row, *work, row["prfaas_step_ms"] / 1e3, machine)
    env["load_average"] = {"start": load_start, "end": _load()}
    result = {"prefill": prefill_rows, "decode": decode_rows, "ceilings": machine, "config": env}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(json.dumps(env["model"]))
    print(f"load average (1, 5, 15 min) at start {load_start}, at end {env['load_average']['end']}")
    print(_ceilings_line(machine))
    print(_table("prefill (batch 1)", "length", prefill_rows))
    print()
    print(
        _table(f"decode ({args.context}-token prompts, {args.steps} steps)", "batch", decode_rows)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
