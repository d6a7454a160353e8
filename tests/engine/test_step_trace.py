"""bench/step_trace.py reads the Python stack XLA records for each op of a compiled program
(outermost first) and charges a profiler trace's op times to the functions that emitted them."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp

_PATH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "step_trace.py"
_SPEC = importlib.util.spec_from_file_location("step_trace", _PATH)
step_trace = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(step_trace)


def big_product(x, w):
    return x @ w


def small_sum(x):
    return jnp.sin(x[:4]).sum()


def program(x, w):
    return big_product(x, w), small_sum(x)


def test_each_op_knows_the_functions_that_traced_it_and_its_time_goes_to_them():
    x, w = jnp.ones((256, 256)), jnp.full((256, 256), 0.01)
    run = jax.jit(program)
    functions = step_trace.op_functions(run.lower(x, w).compile().as_text())
    dots = [stack for name, stack in functions.items() if "dot" in name or "ynn" in name]
    assert dots and all(s.index("program") < s.index("big_product") for s in dots), dots
    charged = step_trace.op_seconds_by_caller(
        functions, lambda: run(x, w), 5, {"big_product": "product", "small_sum": "sum"}
    )
    assert charged["product"] > charged["sum"] > 0, charged
