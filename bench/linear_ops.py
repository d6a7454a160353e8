"""CPU timings of the linear-attention ops: chunked ``jnp`` vs the reference scan vs the PyTorch
fallbacks that Hugging Face ``transformers`` runs when no fused kernel is installed.

For each op and sequence length T (B = 1, a Kimi-like head config H = 4, K = V = 128, fp32):

    jnp-chunk      prfaas_jax.ops.{delta_rule,lightning}.chunk (C = 64), jitted
    jnp-ref        prfaas_jax.ops.{delta_rule,lightning}.reference, token-by-token lax.scan, jitted
    torch          kda: transformers.models.kimi_linear ``chunk_kimi_delta_attention`` (fla's
                   naive chunk algorithm); lightning: ``MiniMaxLightningAttention.forward`` with
                   its projections, activation, norm and gate replaced by identities, so only the
                   block-wise lightning recurrence runs on our q, k, v (its decay is our decay)
    pallas-interp  (--pallas) the Pallas kernels run by the interpreter, i.e. XLA:CPU executing
                   the kernel body: a curiosity, not a kernel timing

Compile time (lower + compile) is measured once and reported apart; each row is the best of
--repeats timed runs after one warm-up (fewer once the row has used --budget seconds). Outputs
are checked against jnp-chunk (relative RMS), so the rows provably compute the same thing.
Timings on a shared machine are noisy: rerun on a quiet one before quoting them.

    python bench/linear_ops.py [--json] [--lengths 1024,4096,16384] [--repeats 3] [--budget 30]
                            [--ops kda,lightning] [--no-torch] [--pallas]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.ops.delta_rule import StateBlockSizes, kda_chunk, kda_pallas, kda_reference
from prfaas_jax.ops.lightning import lightning_chunk, lightning_pallas, lightning_reference

HEADS, KEY_DIM, VALUE_DIM, CHUNK = 4, 128, 128, 64


def _inputs(op: str, seq_len: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (1, seq_len, HEADS)

    def unit(x):  # the layers L2-normalise q and k per head
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    arrays = {
        "q": unit(rng.standard_normal((*shape, KEY_DIM))),
        "k": unit(rng.standard_normal((*shape, KEY_DIM))),
        "v": rng.standard_normal((*shape, VALUE_DIM)).astype(np.float32),
    }
    if op == "kda":
        # log-sigmoid gates, as fla's tests draw them; beta in (0, 1)
        arrays["g"] = -np.logaddexp(0, -rng.standard_normal((*shape, KEY_DIM))).astype(np.float32)
        arrays["beta"] = (1 / (1 + np.exp(-rng.standard_normal(shape)))).astype(np.float32)
    return arrays


def _time(
    run: Callable[[], np.ndarray], repeats: int, budget_s: float
) -> tuple[float, int, np.ndarray]:
    """Best of up to ``repeats`` timed runs after a warm-up; returns (seconds, runs, output).

    Runs stop early once they have used ``budget_s`` (at least one always counts), so the slow
    rows at 16K tokens do not take minutes each.
    """
    output = run()  # warm-up: caches, allocator, thread pools
    times: list[float] = []
    while len(times) < repeats and (not times or sum(times) < budget_s):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times), len(times), output


def _jax_impl(fn: Callable, arrays: dict, **static) -> tuple[Callable[[], np.ndarray], float]:
    """Compiles ``fn`` for these inputs; returns (timed call, compile seconds)."""
    args = tuple(jnp.asarray(a) for a in arrays.values())

    def call(*xs):
        return fn(*xs, **static)[0]

    start = time.perf_counter()
    compiled = jax.jit(call).lower(*args).compile()
    compile_seconds = time.perf_counter() - start
    return lambda: np.asarray(jax.block_until_ready(compiled(*args))), compile_seconds


def _torch_kda(arrays: dict) -> Callable[[], np.ndarray]:
    import torch
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    tensors = [torch.from_numpy(arrays[name]) for name in ("q", "k", "v", "g", "beta")]

    def run():
        with torch.no_grad():
            return chunk_kimi_delta_attention(*tensors, chunk_size=CHUNK)[0].numpy()

    return run


def _minimax_module():
    """MiniMax's lightning layer reduced to its recurrence: identities around the core."""
    import torch
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = MiniMaxConfig(
        hidden_size=3 * HEADS * KEY_DIM,
        num_attention_heads=HEADS,
        head_dim=KEY_DIM,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    module = MiniMaxLightningAttention(config, layer_idx=0).eval()
    module.qkv_proj = module.act_fn = module.norm = module.out_proj = torch.nn.Identity()

    class HalfGate(torch.nn.Module):  # sigmoid(0) = 1/2: the gate multiplies the core by 0.5
        def forward(self, x):
            return torch.zeros((), dtype=x.dtype)

    module.output_gate = HalfGate()
    return module


def _torch_lightning(arrays: dict, module) -> Callable[[], np.ndarray]:
    import torch

    # Per head [q | k | v], the layout MiniMax's forward splits its projection into.
    packed = np.concatenate([arrays["q"], arrays["k"], arrays["v"]], axis=-1)
    hidden = torch.from_numpy(packed.reshape(*packed.shape[:2], -1))

    def run():
        with torch.no_grad():
            out = module(hidden, position_embeddings=None, attention_mask=None)[0]
        return 2 * out.reshape(*arrays["v"].shape).numpy()

    return run


def _rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def _minimax_decay() -> np.ndarray:
    """MiniMax's layer-0 log decay: -2^(-8(h+1)/H) (1 + 1e-5), the slope its module builds."""
    return -(2.0 ** (-8.0 * np.arange(1, HEADS + 1) / HEADS)) * (1 + 1e-5)


def bench(
    ops: list[str],
    lengths: list[int],
    repeats: int,
    *,
    budget_s: float,
    with_torch: bool,
    with_pallas: bool = False,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    rows = []
    module = _minimax_module() if with_torch and "lightning" in ops else None
    for op in ops:
        for seq_len in lengths:
            arrays = _inputs(op, seq_len)
            if op == "lightning":
                # MiniMax applies no q scale; its module derives the same decay as ours.
                static = {"decay": jnp.asarray(_minimax_decay(), jnp.float32), "scale": 1.0}
                chunk_fn, ref_fn, kernel = lightning_chunk, lightning_reference, lightning_pallas
            else:
                static, chunk_fn, ref_fn, kernel = {}, kda_chunk, kda_reference, kda_pallas
            impls: dict[str, tuple[Callable, float | None]] = {
                "jnp-chunk": _jax_impl(chunk_fn, arrays, chunk_size=CHUNK, **static),
                "jnp-ref": _jax_impl(ref_fn, arrays, **static),
            }
            if with_pallas:
                blocks = dataclasses.replace(StateBlockSizes.get_default(), chunk_size=CHUNK)
                impls["pallas-interp"] = _jax_impl(kernel, arrays, block_sizes=blocks, **static)
            if with_torch:
                torch_run = _torch_kda(arrays) if op == "kda" else _torch_lightning(arrays, module)
                impls["torch"] = (torch_run, None)
            expected = None
            for impl, (run, compile_seconds) in impls.items():
                seconds, runs, output = _time(run, repeats, budget_s)
                expected = output if expected is None else expected
                rows.append(
                    {
                        "op": op,
                        "seq_len": seq_len,
                        "impl": impl,
                        "seconds": seconds,
                        "runs": runs,
                        "compile_seconds": compile_seconds,
                        "tokens_per_second": seq_len / seconds,
                        "rel_rms_vs_jnp_chunk": _rel_rms(output, expected),
                    }
                )
                if on_row is not None:
                    on_row(rows[-1])
    return rows


def _environment() -> dict:
    env = {
        "batch": 1,
        "heads": HEADS,
        "key_dim": KEY_DIM,
        "value_dim": VALUE_DIM,
        "chunk_size": CHUNK,
        "dtype": "float32",
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    try:
        import torch
        import transformers

        env |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def _table(rows: list[dict]) -> str:
    header = (
        "op",
        "T",
        "impl",
        "best run (ms)",
        "runs",
        "compile (s)",
        "tokens/s",
        "rel RMS vs chunk",
    )
    lines = [header]
    for r in rows:
        compile_s = "-" if r["compile_seconds"] is None else f"{r['compile_seconds']:.2f}"
        lines.append(
            (
                r["op"],
                str(r["seq_len"]),
                r["impl"],
                f"{1e3 * r['seconds']:.1f}",
                str(r["runs"]),
                compile_s,
                f"{r['tokens_per_second']:,.0f}",
                f"{r['rel_rms_vs_jnp_chunk']:.1e}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines
    )


def _progress(row: dict) -> None:
    print(f"  {row['op']} T={row['seq_len']} {row['impl']}: {row['seconds']:.3f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384", help="comma-separated T values")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--ops", default="kda,lightning", help="comma-separated: kda, lightning")
    parser.add_argument(
        "--budget", type=float, default=30.0, help="seconds of timed runs per row before stopping"
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the transformers rows")
    parser.add_argument(
        "--pallas", action="store_true", help="add the Pallas kernels, interpreted on CPU"
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    ops = [op for op in args.ops.split(",") if op]
    if not ops or not set(ops) <= {"kda", "lightning"}:
        parser.error(f"--ops takes kda and/or lightning, got {args.ops!r}")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    repeats = max(args.repeats, 1)
    rows = bench(
        ops,
        lengths,
        repeats,
        budget_s=args.budget,
        with_torch=not args.no_torch,
        with_pallas=args.pallas,
        on_row=None if args.json else _progress,
    )
    result = {"config": _environment() | {"repeats": repeats}, "results": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print()
        print(", ".join(f"{k}={v}" for k, v in result["config"].items()))
        print(_table(rows))
        print()
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
