"""Where a small-batch decode step's time goes: each part of the step compiled and timed alone,
against the time its bytes take at this machine's read bandwidth.

The model is bench/engine.py's (``PRESET``: the random Kimi-Linear checkpoint, KDA, KDA, KDA,
MLA, a dense first MLP then MoE, vocab 32,000, fp32, loaded by ``load_hf``), its engines with
``impl = reference``. For each B in ``--batches``, B prompts of ``--context`` tokens fill a
``DecodeEngine``'s B slots, then:

    engine.step()   what bench/engine.py times: the compiled step plus the host's per-slot work
    compiled step   the engine's jitted step (decode + sampling) alone, its state fed back
    parts           each compiled on its own, on the step's real inputs (the slots' state):
                      embed       the B rows of the embedding table
                      L<i> mixer  RMSNorm + the layer's decode step (KDA recurrence or
                                  absorbed MLA) on its state
                      L<i> mlp    RMSNorm + SwiGLU or MoE
                      head        final RMSNorm + LM head
                      sample      the all-greedy argmax
    dispatch        an empty jitted call: the floor each separately compiled part pays
    kv_b unsplit    the compiled step and each MLA mixer on the engine's split ``kv_b``
                    (model/decode_weights.py) and on ``kv_b`` as loaded, taking turns
                    (``interleaved_s``: best of 5 rounds): what splitting it once saves; rows
                    after the sums, which leave them out
    in the step     ``engine.step()`` under ``jax.profiler`` for ``--calls`` steps, each op's
                    time charged to the part of the model that emitted it
                    (bench/step_trace.py): the linear-attention and attention mixers, the
                    dense and MoE MLPs, the head, sampling, the rest of the blocks, and the
                    copies XLA adds; µs per step, summed over both threads (ops overlap, so
                    ``all ops`` can exceed the step's wall time)

Each time is the median of ``--calls`` calls after a warm-up. A part's bytes are what it must
read once: its parameters (an MoE layer only the experts B tokens route to in expectation,
planning/decode_cost.py) and its layer's state at ``--context`` tokens for B rows; its bound is
those bytes at the read bandwidth measured in the same run (bench/roofline.py). The parts' sum
beside the compiled step shows what XLA gains by compiling them together; each part's time
beside its bound shows which of them stands between the step and the weight-streaming bound.
A part timed alone returns a new copy of its layer's state (the step donates it and writes in
place), so the mixers' times are upper bounds; the timed steps grow the context from
``--context`` by up to 2·``--calls`` + 4 tokens, which the bytes (counted at ``--context``)
leave out. With ``--weight-dtype bfloat16`` the engine and every part run on the narrowed
weights (model/narrow_weights.py), and the bytes count them at their width.

A part timed call after call finds its bytes in the last-level cache (this machine's is large);
inside the step most of them come from DRAM, because the step as a whole reads more than the
caches keep between calls. So the parts' sum falls short of the step's time, and the in-step
rows are where the step's time goes. With ``--cold`` every timed call follows a read of 400 MB
(`timing.dram_flush`): each part then reads from DRAM, but also starts with cold threads and
caches, so the cold parts overstate what they cost inside the step.

    python bench/decode_profile.py [--batches 1,8] [--context 512] [--calls 200]
                                   [--weight-dtype bfloat16] [--cold] [--json]
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from prfaas_jax.cli.flags import parse_int_list, print_json
from prfaas_jax.config import MlpKind
from prfaas_jax.engine.decode import _STEP, DecodeEngine
from prfaas_jax.engine.prefill import PrefillEngine
from prfaas_jax.engine.sampling import draw_tokens
from prfaas_jax.model.hybrid import HeadLayouts, bind
from prfaas_jax.model.mixers.context import StepContext
from prfaas_jax.ops.dispatch import Impl
from prfaas_jax.planning.decode_cost import decode_step_bytes, experts_touched
from prfaas_jax.state_bytes import layer_nbytes

# tests/model/hf holds the checkpoint builder bench_model uses (hf_fixtures; not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model" / "hf"))
from engine import IMPL  # bench/ is the script's own directory
from layer_parts import bench_model, mixer_part, mlp_part, parts_table
from roofline import ceilings
from step_trace import op_functions, op_seconds_by_caller
from timing import dram_flush, interleaved_s, median_s


def _nbytes(tree) -> int:
    """The bytes a step reads of ``tree``: a head held in both layouts counts once."""

    def read(leaf) -> int:
        return leaf.by_vocab.nbytes if isinstance(leaf, HeadLayouts) else leaf.nbytes

    is_head = lambda x: isinstance(x, HeadLayouts)  # noqa: E731
    return sum(read(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_head))


_EXPERTS = ("experts_gate", "experts_up", "experts_down")


def _kv_b(mixer: dict) -> dict:
    return {"kv_b": mixer["kv_b"]} if "kv_b" in mixer else {}


def _taking_turns(name: str, split, unsplit, calls: int, nbytes: float, before=None) -> list[tuple]:
    """``name`` on the engine's split ``kv_b`` and on ``kv_b`` as loaded, taking turns (5
    rounds of ``calls`` / 5): ``(part, seconds, bytes)`` rows."""
    pair = {"split": split, "unsplit": unsplit}
    seconds = interleaved_s(pair, 5, max(calls // 5, 1), before)
    return [
        (f"{name}, kv_b split (turns)", seconds["split"], nbytes),
        (f"{name}, kv_b unsplit (turns)", seconds["unsplit"], nbytes),
    ]


def _narrowing_saves(wide, narrow) -> int:
    """The bytes narrowing ``wide`` to ``narrow`` (the same tree) saves."""
    return _nbytes(wide) - _nbytes(narrow)


# The model code a step's ops are charged to (bench/step_trace.py), by the outermost of these
# functions on the stack that traced them.
CALLERS = {
    "DeltaMixer.__call__": "linear-attention mixers",
    "LightningMixer.__call__": "linear-attention mixers",
    "MlaMixer.__call__": "attention mixers",
    "GqaMixer.__call__": "attention mixers",
    "SwiGLU.__call__": "dense MLPs",
    "MoE.__call__": "MoE MLPs",
    "HybridLM.head": "head",
    "draw_tokens": "sample",
}


def _part_label(cfg, index: int, part: str) -> str:
    """The ``CALLERS`` label of layer ``index``'s ``part`` ("mixer" or "mlp")."""
    if part == "mixer":
        return "linear-attention mixers" if cfg.layers[index].is_linear else "attention mixers"
    return "MoE MLPs" if cfg.mlps[index] is MlpKind.MOE else "dense MLPs"


def _param_label(cfg):
    """The ``CALLERS`` label of the part that reads a parameter of the step's program (named by
    its path, ``params__layers___3___mixer____o_proj__``), None for another."""

    def label(name: str) -> str | None:
        if name.startswith("params__lm_head"):
            return "head"
        match = re.match(r"params__layers___(\d+)___(mixer|mlp)", name)
        return None if match is None else _part_label(cfg, int(match.group(1)), match.group(2))

    return label


def _op_functions(engine: DecodeEngine, controls, knobs) -> dict[str, list[str]]:
    """The functions that traced each op of ``engine.step()``'s compiled program."""
    lowered = _STEP.lower(
        engine.params, engine._state, *controls, *knobs, cfg=engine.cfg, impl=engine.impl
    )
    return op_functions(lowered.compile().as_text())


def _context(state, impl: Impl) -> StepContext:
    batch = state.lengths.shape[0]
    valid = jnp.ones((batch,), jnp.int32)
    return StepContext(lengths=state.lengths, valid_len=valid, seq_len=1, impl=impl, decode=True)


def profile(
    prefill: PrefillEngine,
    batch: int,
    context: int,
    calls: int,
    bandwidth: float,
    weight_dtype: str | None = None,
    cold: bool = False,
):
    cfg, params, impl = prefill.cfg, prefill.params, Impl(prefill.impl)
    before = dram_flush() if cold else None

    def timed(call) -> float:
        return median_s(call, calls, before)

    max_len = context + 4 * calls + 16
    engine = DecodeEngine(
        cfg, params, max_slots=batch, max_len=max_len, impl=impl, weight_dtype=weight_dtype
    )
    params = engine.params
    rng = np.random.default_rng(batch)
    for _ in range(batch):
        result = prefill.prefill(rng.integers(0, cfg.vocab_size, context))
        engine.insert(result.state, result.first_token, max_new_tokens=4 * calls + 8)
    rows: list[dict] = []

    def add(name: str, seconds: float, nbytes: float | None) -> None:
        bound_us = None if nbytes is None else 1e6 * nbytes / bandwidth
        rows.append({"part": name, "us": 1e6 * seconds, "bytes": nbytes, "bound_us": bound_us})

    moe = cfg.moe
    step_bytes = decode_step_bytes(cfg, batch, context) - _narrowing_saves(prefill.params, params)
    if moe is not None:  # ... less what it saves on the experts a step never reads
        untouched = moe.num_experts - experts_touched(moe.num_experts, moe.top_k, batch)
        for wide, narrow in zip(prefill.params["layers"], params["layers"], strict=True):
            experts = [k for k in _EXPERTS if k in wide["mlp"]]
            saved = sum(_narrowing_saves(wide["mlp"][k], narrow["mlp"][k]) for k in experts)
            step_bytes += untouched * saved / moe.num_experts
    add("engine.step()", timed(engine.step), step_bytes)

    controls = tuple(jnp.asarray(a) for a in (engine._tokens, np.ones(batch, bool), engine._keys))
    controls += (jnp.asarray(engine._index),)
    knobs = tuple(jnp.asarray(a) for a in (engine._temperature, engine._top_k, engine._top_p))
    functions = _op_functions(engine, controls, knobs)
    # Traced first: the compiled-step rows below donate the engine's state.
    in_step = op_seconds_by_caller(functions, engine.step, calls, CALLERS, _param_label(cfg))
    held = {"state": engine._state}

    def compiled_step():
        held["state"], tokens = _STEP(params, held["state"], *controls, *knobs, cfg=cfg, impl=impl)
        return tokens

    loaded = {  # the engine's weights with kv_b as loaded
        **params,
        "layers": tuple(
            {**block, "mixer": {**block["mixer"], **_kv_b(wide["mixer"])}}
            for block, wide in zip(params["layers"], prefill.params["layers"], strict=True)
        ),
    }
    held["unsplit"] = jax.tree.map(jnp.copy, held["state"])  # the same slots, for kv_b as loaded

    def compiled_unsplit():
        held["unsplit"], tokens = _STEP(
            loaded, held["unsplit"], *controls, *knobs, cfg=cfg, impl=impl
        )
        return tokens

    add("compiled step", timed(compiled_step), step_bytes)
    unsplit = _taking_turns(
        "compiled step", compiled_step, compiled_unsplit, calls, step_bytes, before
    )
    state = held["state"]

    empty = jax.jit(lambda x: x)
    one = jnp.zeros(())
    dispatch_s = timed(lambda: empty(one))

    tokens = controls[0]
    embed = jax.jit(lambda p, t: p["embed"][t][:, None])
    h = embed(params, tokens)
    row_bytes = batch * cfg.hidden_dim * 4
    add("embed", timed(lambda: embed(params, tokens)), row_bytes)

    def run_mixer_part(p, h, layer_state, state, index):
        return mixer_part(cfg, p, h, layer_state, _context(state, impl), index)

    bytes_of: dict = {}  # by CALLERS label, for the in-step rows
    mixer = jax.jit(run_mixer_part, static_argnames="index")
    mlp = jax.jit(functools.partial(mlp_part, cfg), static_argnames="index")
    for index, kind in enumerate(cfg.layers):
        layer = params["layers"][index]
        layer_state = state.layers[index]
        nbytes = _nbytes(layer["mixer"]) + batch * layer_nbytes(cfg, kind, context)

        def run_mixer(index=index, layer_state=layer_state):
            return mixer(params, h, layer_state, state, index=index)

        add(f"L{index} {kind.value} mixer", timed(run_mixer), nbytes)
        label = _part_label(cfg, index, "mixer")
        bytes_of[label] = bytes_of.get(label, 0) + nbytes
        if "kv_b" in layer["mixer"]:  # beside it, on kv_b as loaded (split in every step)

            def run_unsplit(index=index, layer_state=layer_state):
                return mixer(loaded, h, layer_state, state, index=index)

            name = f"L{index} {kind.value} mixer"
            unsplit += _taking_turns(name, run_mixer, run_unsplit, calls, nbytes, before)
        weights = _nbytes(layer["mlp"])
        if cfg.mlps[index] is MlpKind.MOE:
            expert = 3 * cfg.hidden_dim * moe.expert_dim * layer["mlp"]["experts_up"].itemsize
            untouched = moe.num_experts - experts_touched(moe.num_experts, moe.top_k, batch)
            weights -= untouched * expert
            name = f"L{index} MoE mlp"
        else:
            name = f"L{index} dense mlp"
        add(name, timed(lambda index=index: mlp(params, h, index=index)), weights)
        label = _part_label(cfg, index, "mlp")
        bytes_of[label] = bytes_of.get(label, 0) + weights

    head = jax.jit(lambda p, h: bind(cfg, p).head(h)[:, 0])
    head_bytes = _nbytes(params["lm_head"] if "lm_head" in params else params["embed"])
    add("head", timed(lambda: head(params, h)), head_bytes)
    logits = head(params, h)
    sample = jax.jit(draw_tokens)
    add("sample", timed(lambda: sample(logits, *controls[2:], *knobs)), None)
    parts_s = sum(r["us"] for r in rows[2:]) / 1e6
    add("sum of the parts", parts_s, step_bytes)
    add("dispatch (empty jit)", dispatch_s, None)
    add("sum less a dispatch each", parts_s - (len(rows) - 4) * dispatch_s, step_bytes)
    for name, seconds, nbytes in unsplit:
        add(name, seconds, nbytes)
    bytes_of["head"] = head_bytes
    names = {"elsewhere": "norms, residuals, embedding", "XLA's own ops": "XLA's own copies"}
    for label, seconds in sorted(in_step.items(), key=lambda kv: -kv[1]):
        add(f"in the step: {names.get(label, label)}", seconds, bytes_of.get(label))
    add("in the step: all ops", sum(in_step.values()), step_bytes)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batches", type=parse_int_list, default=[1, 8], help="rows (1,8)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens (512)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per part (200)")
    parser.add_argument("--weight-dtype", help="narrow the projections (bfloat16)")
    parser.add_argument(
        "--cold", action="store_true", help="each timed call after a 400 MB read (from DRAM)"
    )
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args(argv)
    if not args.batches or min(args.batches) < 1 or args.context < 1 or args.calls < 1:
        parser.error("--batches, --context and --calls must be ≥ 1")
    cfg, params = bench_model()
    machine = ceilings()
    prefill = PrefillEngine(cfg, params, impl=IMPL, chunk_len=args.context)
    result = {"ceilings": machine, "options": vars(args), "batches": {}}
    for batch in args.batches:
        bandwidth = machine["read_bytes_s"]
        rows = profile(
            prefill, batch, args.context, args.calls, bandwidth, args.weight_dtype, args.cold
        )
        result["batches"][batch] = rows
        if args.json:
            continue
        print(
            f"decode B = {batch}, {args.context}-token context; read bandwidth "
            f"{machine['read_bytes_s'] / 1e9:.1f} GB/s"
            + ("; every call after a 400 MB read" if args.cold else "")
        )
        scale = {"time": 1.0, "digits": 0, "work": 1e6}
        headers = ["part", "µs", "MB to read", "bound µs", "of bound"]
        print(parts_table(rows, work="bytes", scale=scale, headers=headers))
        print()
    print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
