"""TPU check and timing of every Pallas kernel against its jnp path: compiled natively by
Mosaic on one TPU (a v5e or v6e: a few minutes), checked by relative RMS and timed beside the jnp
path; the cases, the checks and the output are ``bench/kernel_check.py``'s.

    python bench/kernels_tpu.py [--json] [--repeats 5] [--quick] [--interpret] [--max-seconds 480]

Without a TPU it says so and exits with status 2; ``--interpret --quick`` runs the whole script
on CPU with tiny shapes, the kernels interpreted with the TPU's block sizes.
"""

from __future__ import annotations

import sys

from kernel_check import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], "tpu", __doc__.splitlines()[0]))
