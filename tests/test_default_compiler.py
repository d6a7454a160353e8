"""The compiler users get: a representative subset of the model, engine and serving tests run
again, in a pytest process of its own, with JAX's and XLA:CPU's default flags.

The suite compiles with fewer optimisations (tests/conftest.py): `jax_disable_most_optimizations`
and XLA:CPU's older loop emitters. Users run what JAX compiles by default, whose fusions and
reassociations change the floating-point results the suite's tolerances and token equalities
are held to. `SUBSET` runs with ``JAX_DISABLE_MOST_OPTIMIZATIONS=0`` and
``XLA_FLAGS=--xla_cpu_use_fusion_emitters=true`` (conftest.py then adds none of its own flags)
and a compilation cache of its own, so every program is compiled there with the default flags:

- the `tiny` model (KDA + MLA): its prefill on the chunked operators equals the token-by-token
  reference operators, logits and states (an oracle compiled from other code);
- the serving path on the JAX engines of `tiny`, in process: router, PrfaaS and PD prefill
  workers, the state encoded on the link at a lossy wire precision and natively, the decode
  engine; tokens equal prefill, encode, decode and decode steps done here, bytes the formula.

The child's header line names the compiler it ran with (`pytest_report_header`), so a run that
silently fell back to the suite's flags fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUBSET = (
    "tests/model/test_hybrid_invariants.py::test_chunked_ops_match_reference_ops[tiny]",
    "tests/serving/test_wire_precision_serving.py::test_the_link_carries_the_configured_precision",
)
DEFAULT_COMPILER = {
    "JAX_DISABLE_MOST_OPTIMIZATIONS": "0",
    "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true",
}


@pytest.mark.slow  # every program compiled afresh with full optimisation: 30-50 s on 2 cores
def test_a_subset_passes_with_the_default_compiler(tmp_path):
    # Nothing of this run's compiler settings, caches or pytest-xdist worker identity reaches
    # the child: it starts as a user's `python -m pytest` would, with the default flags.
    inherited = ("JAX_", "XLA_", "PYTEST_", "XDG_CACHE_HOME")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    command = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-rfE"]
    command += ["--basetemp", str(tmp_path / "run"), *SUBSET]
    run = subprocess.run(
        command, cwd=ROOT, env={**env, **DEFAULT_COMPILER}, capture_output=True, text=True
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    header = "compiler: jax_disable_most_optimizations=False, XLA_FLAGS="
    assert f"{header}{DEFAULT_COMPILER['XLA_FLAGS']}\n" in out, out[:3000]
    summary = out.strip().splitlines()[-1]  # "=== N passed in …s ===": nothing else
    passed = re.fullmatch(r"=+ (\d+) passed in .*", summary)
    assert passed and int(passed[1]) >= len(SUBSET), summary
