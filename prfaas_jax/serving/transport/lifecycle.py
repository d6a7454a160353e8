"""A serving process's own lifecycle: `die_with_parent` (exit with the launcher),
`install_stop_handlers` (SIGTERM / SIGINT set an event) and `write_json` (the atomic address and
ready files through which a process announces itself)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGTERM this process when its parent (the launcher) dies; exit at once if
    it already has. Called by each child at startup rather than in a fork hook, so spawning
    runs no Python between fork and exec (a hazard once JAX has started its threads)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        raise SystemExit(f"the launcher (pid {parent_pid}) is gone")


def write_json(path: str | os.PathLike[str], payload: dict) -> None:
    """Write JSON atomically (a rename), so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def install_stop_handlers() -> threading.Event:
    """An event set by SIGTERM or SIGINT (the launcher's shutdown, or Ctrl-C)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop
