"""A serving process's own lifecycle: `die_with_parent` (exit with the launcher),
`install_stop_handlers` (SIGTERM / SIGINT set an event, from a thread of its own) and
`write_json` (the atomic address and ready files through which a process announces itself)."""

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


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install_stop_handlers() -> threading.Event:
    """An event set by SIGTERM or SIGINT (the launcher's shutdown, or Ctrl-C). Call it from the
    main thread.

    The Python handlers do nothing: the interpreter writes each signal's number to a wakeup pipe
    and a thread of this process sets the event. A handler that set it itself would run in the
    main thread between two bytecodes, perhaps while that thread holds the event's lock (in
    `Event.wait`, or in an earlier handler's `set`), and wait for it forever; a killed
    launcher's children get SIGTERMs in bursts (Linux sends the parent-death signal again as
    each thread of the dead parent exits), and such a process never stopped."""
    stop = threading.Event()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda *_: None)

    def watch() -> None:
        while data := os.read(read_fd, 64):
            if any(number in _STOP_SIGNALS for number in data):
                stop.set()

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()
    return stop
