"""The machine's own ceilings, measured in the run that reports against them: `ceilings`.

- matmul peak: a jitted fp32 ``[n, n] @ [n, n]`` (n = 2048 by default), 2n³ FLOPs, best of
  ``repeats`` after a warm-up;
- read bandwidth: a jitted ``jnp.sum`` over a 400 MB fp32 array (one pass, no writes), best of
  ``repeats``.

A bench divides its achieved FLOP/s and bytes/s by these (`fraction`), and calls a row FLOP-bound
or byte-bound by its arithmetic intensity against the ridge point, peak FLOP/s ÷ bandwidth
(`bound`). Both ceilings are what JAX reaches on this machine, not a datasheet's numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from timing import best_s  # bench/ is the scripts' own directory


def ceilings(*, n: int = 2048, read_bytes: int = 400_000_000, repeats: int = 5) -> dict:
    """``{"matmul_flops", "read_bytes_s", "ridge_flops_per_byte"}`` of this machine."""
    matmul, total = jax.jit(jnp.matmul), jax.jit(jnp.sum)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    matmul_s = best_s(lambda: matmul(a, a), repeats)
    x = jnp.ones(read_bytes // 4, jnp.float32)
    read_s = best_s(lambda: total(x), repeats)
    peak, bandwidth = 2 * n**3 / matmul_s, read_bytes / read_s
    return {
        "matmul_flops": peak,
        "read_bytes_s": bandwidth,
        "ridge_flops_per_byte": peak / bandwidth,
        "matmul_n": n,
        "read_array_bytes": read_bytes,
    }


def bound(flops: float, nbytes: float, machine: dict) -> str:
    """ "flops" or "bytes": which ceiling a step of ``flops`` over ``nbytes`` runs into."""
    return "flops" if flops / nbytes >= machine["ridge_flops_per_byte"] else "bytes"


def fraction(flops: float, nbytes: float, seconds: float, machine: dict) -> float:
    """The achieved share of the binding ceiling."""
    if bound(flops, nbytes, machine) == "flops":
        return flops / seconds / machine["matmul_flops"]
    return nbytes / seconds / machine["read_bytes_s"]
