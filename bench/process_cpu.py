"""``ProcessCpu``: the CPU time a server's processes use, read from ``/proc`` — per process (named
by its role), split into XLA's threads and the rest — so a serving run can say where its cores
went. ``process_tree`` lists a process and its descendants.

A process is named by its command line: a prfaas worker by its ``--role``, the router, the
process that runs `prfaas serve` (the launcher and the OpenAI front door) and anything else by
its program (a Python script or module by its own name). Threads whose name starts with
``tf_XLA`` are XLA's (its intra-op pool runs the compiled programs); the rest of a process's
time is the interpreter's, gRPC's, the compiler's and the libraries'.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: Path) -> tuple[str, list[str]]:
    """(the name in parentheses, the fields after it) of a ``stat`` file."""
    text = path.read_text()
    name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
    return name, rest.split()


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it (children of any session)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(_stat_fields(entry / "stat")[1][1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def process_name(pid: int) -> str:
    """The role of a prfaas process, or the program of another (module docstring)."""
    argv = (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    if "--role" in argv[:-1]:
        return argv[argv.index("--role") + 1]
    if "prfaas_jax.serving.router.main" in argv:
        return "router"
    if "prfaas_jax.cli" in argv and "serve" in argv:
        return "serve + front door"
    argv = [arg for arg in argv if arg]
    if argv and Path(argv[0]).name.startswith("python"):
        rest = argv[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest = rest[1:]  # the interpreter's own options
        if rest and rest[0] != "-c":  # a module's or a script's name; code inline stays python
            argv = rest[1:] if rest[0] == "-m" else rest
    return Path(argv[0]).name if argv else str(pid)


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) ``pid`` has used: ``total`` (every thread, ended ones too)
    and ``xla`` (its XLA threads, which live as long as the process)."""
    fields = _stat_fields(PROC / str(pid) / "stat")[1]
    total = (int(fields[11]) + int(fields[12])) / TICKS
    xla = 0.0
    for task in (PROC / str(pid) / "task").iterdir():
        try:
            name, fields = _stat_fields(task / "stat")
        except OSError:
            continue
        if name.startswith("tf_XLA"):
            xla += (int(fields[11]) + int(fields[12])) / TICKS
    return {"total": total, "xla": xla}


class ProcessCpu:
    """CPU seconds used by ``pids`` between `__init__` and `used` (a process that ended
    meanwhile is left out)."""

    def __init__(self, pids: Iterable[int]) -> None:
        self._start: dict[int, tuple[str, dict[str, float]]] = {}
        for pid in pids:
            try:
                self._start[pid] = (process_name(pid), cpu_seconds(pid))
            except OSError:
                continue

    def used(self) -> dict[str, dict[str, float]]:
        """``{process name: {"total": s, "xla": s}}``, summed over processes of one name."""
        out: dict[str, dict[str, float]] = {}
        for pid, (name, start) in self._start.items():
            try:
                now = cpu_seconds(pid)
            except OSError:
                continue
            row = out.setdefault(name, {"total": 0.0, "xla": 0.0})
            for key in row:
                row[key] += max(now[key] - start[key], 0.0)
        return out
