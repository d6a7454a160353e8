"""What ``bench/kernels_gpu.py`` and ``bench/kernels_tpu.py`` share: every Pallas kernel compiled
natively on one accelerator, checked against its jnp path and timed (``main(argv, backend)``).

For each case the kernel is compiled natively (``interpret=False``: Triton on GPUs, Mosaic on
TPUs, each with its own default block sizes), run on the same inputs as the jnp path, checked by
relative RMS (fp32 both sides, so a kernel that is right sits near 1e-6; the pass mark is 1e-4)
and timed (best of --repeats after a warm-up, compile time apart). A case that fails to compile
or run is reported with its error and the others go on.

    kda / gdn     kda_pallas / gdn_pallas vs the chunked ops     B=1, H=8, K=V=128, T=4K and 16K
                                                                 (TPU: 1K and 4K)
    lightning     lightning_pallas vs lightning_chunk            the same shapes
    flash-mla     flash_attention vs attention, causal prefill   H=16, q/k 192, v 128, T=4K
    flash-swa     the same, GQA 32/4 heads, D=128, window 1024 and sinks, T=4K
    mla-decode    mla_decode_pallas vs mla_decode_absorbed       16 slots of lengths up to 8K,
                                                                 H=32, R=512, P=64; 1 and 4 splits

Without the accelerator it says so and exits with status 2; ``--interpret --quick`` runs the
whole script on CPU with tiny shapes (the kernels interpreted, tiled for the named backend).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.ops.attention import (
    MlaDecodeBlockSizes,
    attention,
    flash_attention,
    mla_decode_absorbed,
    mla_decode_pallas,
)
from prfaas_jax.ops.delta_rule import gdn_chunk, gdn_pallas, kda_chunk, kda_pallas
from prfaas_jax.ops.lightning import lightning_chunk, lightning_pallas
from prfaas_jax.ops.pallas_backend import forced_tiling

PASS_MARK = 1e-4
Case = tuple[str, dict, Callable, Callable, tuple]  # name, shape info, jnp fn, kernel fn, args


def _unit(rng, shape):
    x = rng.standard_normal(shape)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _linear_cases(rng, lengths, heads, dim, interpret) -> list[Case]:
    cases = []
    for T in lengths:
        shape = (1, T, heads)
        q, k, v = _unit(rng, (*shape, dim)), _unit(rng, (*shape, dim)), _normal(rng, *shape, dim)
        beta = (1 / (1 + np.exp(-rng.standard_normal(shape)))).astype(np.float32)
        g_kda = -np.logaddexp(0, -rng.standard_normal((*shape, dim))).astype(np.float32)
        g_gdn = -np.logaddexp(0, -rng.standard_normal(shape)).astype(np.float32)
        S0 = _normal(rng, 1, heads, dim, dim)
        info = {"B": 1, "T": T, "H": heads, "K": dim, "V": dim}
        kw = {"initial_state": S0, "output_final_state": True}
        for name, jnp_op, kernel, g in (  # default arguments bind this iteration's values
            ("kda", kda_chunk, kda_pallas, g_kda),
            ("gdn", gdn_chunk, gdn_pallas, g_gdn),
        ):
            cases.append(
                (
                    name,
                    info,
                    lambda *a, f=jnp_op, kw=kw: f(*a, **kw),
                    lambda *a, f=kernel, kw=kw: f(*a, **kw, interpret=interpret),
                    (q, k, v, g, beta),
                )
            )
        decay = -(2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
        lkw = kw | {"decay": decay}
        cases.append(
            (
                "lightning",
                info,
                lambda *a, kw=lkw: lightning_chunk(*a, **kw),
                lambda *a, kw=lkw: lightning_pallas(*a, **kw, interpret=interpret),
                (q, k, v),
            )
        )
    return cases


def _flash_cases(rng, T, interpret) -> list[Case]:
    cases = []
    for name, H, G, Dk, Dv, window, sinks in (
        ("flash-mla", 16, 16, 192, 128, 0, None),
        ("flash-swa", 32, 4, 128, 128, min(1024, T // 4), _normal(rng, 32)),
    ):
        q, k, v = _normal(rng, 1, T, H, Dk), _normal(rng, 1, T, G, Dk), _normal(rng, 1, T, G, Dv)
        kw = {"q_pos": np.arange(T)[None], "kv_pos": np.arange(T)[None], "scale": Dk**-0.5}
        kw |= {"window": window, "sinks": sinks}
        info = {"B": 1, "T": T, "H": H, "H_kv": G, "Dk": Dk, "Dv": Dv, "window": window}
        cases.append(
            (
                name,
                info,
                lambda *a, kw=kw: attention(*a, **kw),
                lambda *a, kw=kw: flash_attention(*a, **kw, interpret=interpret),
                (q, k, v),
            )
        )
    return cases


def _mla_decode_cases(rng, slots, max_len, heads, rank, interpret) -> list[Case]:
    nope, rope, dv = 128, 64, 128
    lengths = rng.integers(1, max_len + 1, size=slots)
    kv_pos = np.where(np.arange(max_len)[None] < lengths[:, None], np.arange(max_len)[None], -1)
    args = (
        _normal(rng, slots, 1, heads, nope),
        _normal(rng, slots, 1, heads, rope),
        _normal(rng, slots, max_len, rank),
        _normal(rng, slots, max_len, rope),
        _normal(rng, rank, heads, nope) / rank**0.5,
        _normal(rng, rank, heads, dv) / rank**0.5,
    )
    kw = {"q_pos": (lengths - 1)[:, None], "kv_pos": kv_pos, "scale": (nope + rope) ** -0.5}
    info = {"slots": slots, "max_len": max_len, "H": heads, "R": rank, "P": rope}
    default = MlaDecodeBlockSizes.get_default()  # for the backend forced by main
    blocks = {splits: dataclasses.replace(default, num_splits=splits) for splits in (1, 4)}
    return [
        (
            f"mla-decode/{splits}",
            info | {"splits": splits},
            lambda *a: mla_decode_absorbed(*a, **kw),
            lambda *a, sizes=sizes: mla_decode_pallas(
                *a, **kw, block_sizes=sizes, interpret=interpret
            ),
            args,
        )
        for splits, sizes in blocks.items()
    ]


def _outputs(result) -> list[jax.Array]:
    return [x for x in jax.tree_util.tree_leaves(result) if x is not None]


def _rel_rms(got, want) -> float:
    num = sum(
        float(jnp.sum((a.astype(jnp.float32) - b) ** 2)) for a, b in zip(got, want, strict=True)
    )
    den = sum(float(jnp.sum(b.astype(jnp.float32) ** 2)) for b in want)
    return (num / den) ** 0.5


def _timed(fn: Callable, args: tuple, repeats: int) -> tuple[float, float, list]:
    """(compile seconds, best run seconds, outputs) of ``jax.jit(fn)`` on ``args``."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    out = _outputs(jax.block_until_ready(compiled(*args)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return compile_s, best, out


def run_case(case: Case, repeats: int) -> dict:
    name, info, jnp_fn, kernel_fn, host_args = case
    row = {"kernel": name, "shape": info}
    args = tuple(jnp.asarray(a) for a in host_args)
    try:
        row["jnp_compile_s"], row["jnp_s"], want = _timed(jnp_fn, args, repeats)
        row["pallas_compile_s"], row["pallas_s"], got = _timed(kernel_fn, args, repeats)
        row["rel_rms"] = _rel_rms(got, want)
        row["ok"] = bool(np.isfinite(row["rel_rms"]) and row["rel_rms"] <= PASS_MARK)
        row["speedup"] = row["jnp_s"] / row["pallas_s"]
    except Exception as err:  # report and go on: one broken lowering must not hide the others
        row["ok"] = False
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        row["traceback"] = traceback.format_exc(limit=3)
    return row


def _table(rows: list[dict]) -> str:
    lines = [("kernel", "shape", "jnp (ms)", "pallas (ms)", "speedup", "compile (s)", "rel RMS")]
    for r in rows:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items())
        if "rel_rms" not in r:
            lines.append((r["kernel"], shape, "-", "-", "-", "-", r.get("error") or r["skipped"]))
            continue
        lines.append(
            (
                r["kernel"],
                shape,
                f"{1e3 * r['jnp_s']:.2f}",
                f"{1e3 * r['pallas_s']:.2f}",
                f"{r['speedup']:.2f}x",
                f"{r['pallas_compile_s']:.1f}",
                f"{r['rel_rms']:.1e}" + ("" if r["ok"] else " FAIL"),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)) + "  " + line[-1]
        for line in lines
    )


# What each script needs: JAX's backend name, how to get one, the linear lengths it times.
ACCELERATORS = {
    "gpu": ("a CUDA jaxlib (pip install 'jax[cuda12]') on a GPU machine", [4096, 16384]),
    # The linear kernels hold one head's whole sequence in VMEM: 16K tokens do not fit.
    "tpu": ("a TPU jaxlib (pip install 'jax[tpu]') on a TPU VM", [1024, 4096]),
}


def main(argv: list[str] | None, backend_name: str, description: str) -> int:
    """The bench on ``backend_name`` ("gpu" or "tpu"); ``description`` heads ``--help``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the best is kept")
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke test)")
    parser.add_argument(
        "--interpret", action="store_true", help="interpret the kernels (runs on CPU too)"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=480.0, help="skip the cases left after this long"
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    how, lengths = ACCELERATORS[backend_name]
    if backend != backend_name and not args.interpret:
        message = (
            f"bench/kernels_{backend_name}.py needs a {backend_name.upper()}, but JAX's default "
            f"backend is {backend!r} (devices: {jax.devices()}). Install {how}, or pass "
            "--interpret --quick to check the script on CPU."
        )
        print(json.dumps({"error": message}) if args.json else message, file=sys.stderr)
        return 2
    with forced_tiling(backend_name):  # interpreted: the accelerator's tiling all the same
        return _run(args, backend, lengths)


def _run(args: argparse.Namespace, backend: str, lengths: list[int]) -> int:
    rng = np.random.default_rng(0)
    if args.quick:  # 520 slots: 4 splits of 130 still hold a whole TPU lane tile
        cases = _linear_cases(rng, [100], 2, 32, args.interpret)
        cases += _flash_cases(rng, 64, args.interpret)
        cases += _mla_decode_cases(rng, 3, 520, 4, 64, args.interpret)
    else:
        cases = _linear_cases(rng, lengths, 8, 128, args.interpret)
        cases += _flash_cases(rng, 4096, args.interpret)
        cases += _mla_decode_cases(rng, 16, 8192, 32, 512, args.interpret)

    started, rows = time.perf_counter(), []
    for case in cases:
        if time.perf_counter() - started > args.max_seconds:
            rows.append({"kernel": case[0], "shape": case[1], "ok": False, "skipped": "time"})
            continue
        rows.append(run_case(case, max(args.repeats, 1)))
        if not args.json:
            r = rows[-1]
            status = r.get("error") or f"rel RMS {r['rel_rms']:.1e}, {1e3 * r['pallas_s']:.2f} ms"
            print(f"  {r['kernel']} {r['shape']}: {status}", flush=True)

    result = {
        "device": str(jax.devices()[0]),
        "backend": backend,
        "interpret": args.interpret,
        "jax": jax.__version__,
        "pass_mark": PASS_MARK,
        "seconds": time.perf_counter() - started,
        "results": rows,
    }
    tracebacks = {r["kernel"]: r.pop("traceback") for r in rows if "traceback" in r}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"\n{result['device']} (jax {result['jax']}, interpret={args.interpret})")
        print(_table(rows))
        for kernel, text in tracebacks.items():
            print(f"\n{kernel}:\n{text}")
        print(json.dumps(result))
    return 0 if all(r["ok"] for r in rows) else 1
