"""A serving process's stop signals (serving/transport/lifecycle.py: `install_stop_handlers`):
SIGTERM sets the stop event even when it arrives while the main thread holds the event's lock —
as it does inside `Event.wait`, the loop every process main waits in — and a burst of them
(a killed launcher's children get one per thread of the launcher) stops the process once."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import os, signal, sys, time
from prfaas_jax.serving.transport.lifecycle import install_stop_handlers
stop = install_stop_handlers()
with stop._cond:  # what Event.wait holds between its checks
    for _ in range(int(sys.argv[1])):
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handlers run at once, in this thread
print("stopped" if stop.wait(10) else "still running", flush=True)
"""


def test_sigterm_while_the_main_thread_holds_the_stop_lock_stops_the_process():
    for burst in (1, 20):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(burst)], capture_output=True, text=True, timeout=30
        )
        assert out.stdout.strip() == "stopped", out.stderr[-2000:]
