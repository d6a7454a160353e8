"""`reuse_freed_memory`: a process that frees a state's worth of large blocks gets the same,
already mapped pages back for the next one (page faults counted by the kernel), where glibc's
defaults map and fault them in again each time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CYCLES = """
import json, resource, sys
import numpy as np
from prfaas_jax.engine.host_memory import reuse_freed_memory
took = reuse_freed_memory() if sys.argv[1] == "reuse" else None

def cycle():  # ten 16 MiB blocks, each page touched, then all freed: one state's arrival
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.empty(16 * 2**20, np.uint8) for _ in range(10)]
    for block in blocks:
        block[::4096] = 1
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(json.dumps({"took": took, "faults": [cycle() for _ in range(4)]}))
"""


def faults(mode: str) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_come_back_without_page_faults():
    reused, default = faults("reuse"), faults("default")
    assert reused["took"] is True
    # The first cycle maps its memory either way; 160 MiB of 4 KiB pages is 40,960 pages, fewer
    # faults where the kernel maps a huge page at once.
    assert reused["faults"][0] > 1000 and default["faults"][0] > 1000
    assert max(reused["faults"][1:]) < 100  # the same pages again (a stray few: Python's own)
    # The control: with glibc's defaults every later cycle faults its pages in again.
    assert min(default["faults"][1:]) > 1000
