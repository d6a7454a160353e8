"""Training speed against ``transformers`` on the same weights: train-step tokens/s.

One small random Kimi-Linear checkpoint (KDA + NoPE MLA at 3:1, DeepSeek-style MoE: the layout
of the ``tiny`` preset) is written with ``save_pretrained`` (tests/model/hf/hf_fixtures.py) and
loaded twice: by ``transformers`` (float32, CPU, train mode, its torch fallbacks for KDA) and
by ``prfaas_jax.model.hf.load_hf``. Both take the same optimizer step — AdamW behind global-norm
clipping — on the same MQAR batches (``--batch-size`` × ``--seq-len``), cross-entropy at the
answer positions only:

    prfaas  ``train.loop.train_step``: jitted forward, ``jax.value_and_grad``, optax update
    HF      ``model(input_ids).logits`` → masked cross-entropy → ``backward`` → clip → AdamW

A row times ``--steps`` steps after ``--warmup`` untimed ones (prfaas compiles in its first);
tokens/s is B·L over the median step. The first step's losses of both sides are printed: they
start from the same weights and batch, so they agree to float32 rounding (a check that the two
sides compute the same model). The load average is printed at start and end: timings on a
shared machine are noisy. The prfaas step is also held against this machine's matmul peak,
measured in the same run (bench/roofline.py): a step counts 3 × the forward's FLOPs (backward ≈ 2
× forward) — planning/prefill_cost.py's count of B sequences of L, with the LM head at every
position, as the loss computes logits everywhere.

Each length gets a prfaas row per ``--impls`` entry: the token scans (``reference``, what
``prfaas train`` runs on a CPU) and the chunked ops (``chunk``, its choice on an accelerator),
against one HF measurement.

    python bench/train.py [--json] [--batch-size 16] [--seq-lens 64,256] [--steps 10]
                          [--impls chunk,reference]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.errors import UserError
from prfaas_jax.model.hf import load_hf
from prfaas_jax.planning.prefill_cost import prefill_flops
from prfaas_jax.tables import table
from prfaas_jax.train.loop import TRAINABLE_IMPLS, TrainConfig, optimizer, train_step
from prfaas_jax.train.tasks import TaskSpec, make_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model" / "hf"))
import hf_fixtures  # the tests' checkpoint builder (tests/model/hf is not a package)
from roofline import ceilings  # bench/ is the script's own directory

# The `tiny` preset's layout as a Kimi-Linear checkpoint: KDA, KDA, KDA, MLA; dense then MoE.
PRESET = dict(
    seed=0,
    num_layers=4,
    full_attn_layers=(3,),
    first_k_dense=1,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_num_heads=2,
    linear_head_dim=16,
    num_experts=8,
    top_k=2,
    num_shared_experts=1,
    moe_intermediate_size=32,
    vocab_size=256,
    init_std=0.02,
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench_prfaas(cfg, params, spec: TaskSpec, config: TrainConfig, warmup: int, steps: int):
    p = jax.tree.map(jnp.copy, params)  # train_step donates its params; each row starts afresh
    o = optimizer(config).init(p)
    times, losses = [], []
    for i in range(warmup + steps):
        key = jax.random.fold_in(jax.random.PRNGKey(0), i)
        start = time.perf_counter()
        p, o, loss, _ = train_step(p, o, key, cfg=cfg, spec=spec, config=config.for_step())
        loss = float(loss)
        times.append(time.perf_counter() - start)
        losses.append(loss)
    return np.asarray(times[warmup:]), losses, times[0]


def bench_hf(path: Path, spec: TaskSpec, config: TrainConfig, warmup: int, steps: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    times, losses = [], []
    for i in range(warmup + steps):
        batch = make_batch(jax.random.fold_in(jax.random.PRNGKey(0), i), spec, config.batch_size)
        ids = torch.from_numpy(np.asarray(batch.tokens, np.int64))
        targets = torch.from_numpy(np.asarray(batch.targets, np.int64))
        mask = torch.from_numpy(np.asarray(batch.mask))
        start = time.perf_counter()
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return np.asarray(times[warmup:]), losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16, help="examples per step")
    parser.add_argument("--seq-lens", default="64,256", help="tokens per example, per row")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--impls",
        default=",".join(impl.value for impl in TRAINABLE_IMPLS),
        help="the ops prfaas trains with, a row each (chunk,reference)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    try:
        impls = [TrainConfig(impl=name).impl for name in args.impls.split(",") if name]
    except (ValueError, UserError) as err:
        parser.error(f"--impls: {err}")
    load_start = _load()
    _log(f"load average at start: {load_start}")
    rows = []
    machine = ceilings()
    peak = machine["matmul_flops"]
    _log(f"matmul peak measured in this run: {peak / 1e9:,.0f} GFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        with contextlib.redirect_stdout(sys.stderr):
            path = hf_fixtures.make_tiny_kimi_linear(tmp, **PRESET)
            cfg, params = load_hf(path, name="bench-train-kimi-linear")
        for seq_len in [int(n) for n in args.seq_lens.split(",") if n]:
            spec = TaskSpec(vocab_size=cfg.vocab_size, seq_len=seq_len, num_pairs=4)
            config = TrainConfig(steps=1000, batch_size=args.batch_size)
            theirs, their_losses = bench_hf(path, spec, config, args.warmup, args.steps)
            tokens = args.batch_size * seq_len
            forward = prefill_flops(cfg, seq_len) + 2 * cfg.hidden_dim * cfg.vocab_size * (
                seq_len - 1
            )
            flops = 3 * args.batch_size * forward
            for impl in impls:
                config = dataclasses.replace(config, impl=impl)
                ours, our_losses, first_s = bench_prfaas(
                    cfg, params, spec, config, args.warmup, args.steps
                )
                rows.append(
                    {
                        "seq_len": seq_len,
                        "batch_size": args.batch_size,
                        "impl": impl.value,
                        "prfaas_tok_s": tokens / float(np.median(ours)),
                        "hf_tok_s": tokens / float(np.median(theirs)),
                        "ratio": float(np.median(theirs) / np.median(ours)),
                        "prfaas_step_s": float(np.median(ours)),
                        "hf_step_s": float(np.median(theirs)),
                        "prfaas_compile_s": max(first_s - float(np.median(ours)), 0.0),
                        "first_loss": {"prfaas": our_losses[0], "hf": their_losses[0]},
                        "flops": flops,
                        "achieved_flops_s": flops / float(np.median(ours)),
                        "fraction_of_matmul_peak": flops / float(np.median(ours)) / peak,
                    }
                )
                _log(
                    f"  L={seq_len} {impl.value}: prfaas {np.median(ours):.3f} s/step, "
                    f"HF {np.median(theirs):.3f}"
                )
    result = {
        "train": rows,
        "ceilings": machine,
        "load_average": {"start": load_start, "end": _load()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    end = result["load_average"]["end"]
    print(f"load average (1, 5, 15 min) at start {load_start}, at end {end}")
    print(f"matmul peak measured in this run: {peak / 1e9:,.0f} GFLOP/s")
    headers = (
        "B×L", "ops", "prfaas tok/s", "HF tok/s", "ratio", "GFLOP/s", "of peak", "compile s",
        "first loss (prfaas / HF)",
    )  # fmt: skip
    print(
        table(
            [
                (
                    f"{r['batch_size']}×{r['seq_len']}",
                    r["impl"],
                    f"{r['prfaas_tok_s']:,.0f}",
                    f"{r['hf_tok_s']:,.0f}",
                    f"{r['ratio']:.1f}×",
                    f"{r['achieved_flops_s'] / 1e9:,.1f}",
                    f"{100 * r['fraction_of_matmul_peak']:.0f} %",
                    f"{r['prfaas_compile_s']:.1f}",
                    f"{r['first_loss']['prfaas']:.5f} / {r['first_loss']['hf']:.5f}",
                )
                for r in rows
            ],
            headers,
            align="llrrrrrrr",
        )
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
