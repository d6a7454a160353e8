"""The process helpers of the cluster: `ChildProcess` (one child of the launcher: its own
session, a log file, an address file) and what each child process does for itself —
`die_with_parent`, `install_stop_handlers` and `write_json` (atomic address and ready files).

Separate from serving/launcher.py, which decides what to start and when: the worker and
router processes (serving/worker.py, serving/router_control.py) need these helpers and none
of the launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
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


class ChildProcess:
    """One process the launcher started, in its own session (so `signal_group` reaches
    anything it forked), its output in `log_path`; `info` holds its address file once read."""

    def __init__(self, name: str, role: str, argv: list[str], log_path: Path) -> None:
        self.name, self.role, self.log_path = name, role, log_path
        self.address_file = log_path.with_suffix(".json")
        self.address_file.unlink(missing_ok=True)  # a reused log dir must not feed stale ports
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.info: dict = {}

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)


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
