"""Where a compiled program's time goes, op by op, as it runs: `op_seconds_by_caller` traces
calls of a jitted function with ``jax.profiler`` and charges each op's time to the model code
that emitted it.

XLA names every op it runs (``ynn_fusion.4``, ``copy_bitcast_fusion``) and records, in the
compiled module's text, the Python stack that traced it (``FileNames`` … ``StackFrames``; a
fusion carries its root op's stack, so a fusion that ends in a caller's op is the caller's). A
trace of the calls gives each op's duration on whichever thread ran it. Each op is charged to
the outermost frame of its stack whose function ``callers`` names (e.g. ``"MoE.__call__"``), so
a shared expert's SwiGLU inside an MoE counts as the MoE; ops with no such frame go to
``"elsewhere"``. An op XLA rewrote without its stack (a dot it re-formed) is charged by the
weight it reads (``param_label``), and the rest of XLA's own ops (copies) to ``"XLA's own
ops"``. A loop's or a branch's own event is skipped: the ops inside it are recorded one by one.
Ops on the two threads of a 2-core machine overlap, so the charged time can exceed the calls'
wall time.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from collections.abc import Callable

import jax

_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# Ops whose time is their called computations' ops' time, which the trace also records.
_CONTAINERS = ("while", "conditional", "call")


def _tables(hlo_text: str) -> dict[str, dict[int, str]]:
    """The module text's stack tables, each ``{id: line}``."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in _SECTIONS:
            current = tables.setdefault(line, {})
        elif current is not None and re.match(r"^\d+ ", line):
            key, rest = line.split(" ", 1)
            current[int(key)] = rest
        elif current is not None:
            current = None
    return tables


def op_functions(hlo_text: str) -> dict[str, list[str]]:
    """Each op's name in the compiled module ``hlo_text`` → the functions on the stack that
    traced it, outermost first (``[]``: an op XLA added)."""
    tables = _tables(hlo_text)
    names = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    location_function = {
        k: int(re.search(r"function_name_id=(\d+)", v).group(1))
        for k, v in tables.get("FileLocations", {}).items()
    }
    frames = {
        k: tuple(int(x) for x in re.findall(r"=(\d+)", v))
        for k, v in tables.get("StackFrames", {}).items()
    }

    def stack(frame: int) -> list[str]:
        out = []
        while frame in frames and len(out) < 500:
            location, parent = frames[frame]  # the text prints a parent's id + 1 (0: a root)
            out.append(names.get(location_function.get(location, 0), "?"))
            frame = parent - 1
        return out[::-1]

    ops = {}
    for line in hlo_text.splitlines():
        match = re.match(r"^\s+(?:ROOT )?%([\w.\-]+) = (?:\S+|\(.*?\)) ([\w\-]+)\(", line)
        if match is None or match.group(2) in _CONTAINERS:
            continue
        frame = re.search(r"stack_frame_id=(\d+)", line)
        if frame is not None:
            ops[match.group(1)] = stack(int(frame.group(1)))
        else:  # an op XLA rewrote or added: known by the parameters it reads, if any
            read = re.findall(r"%(params__\w+?)(?:\.\d+)?[,)]", line)
            ops[match.group(1)] = [f"param:{name}" for name in read]
    return ops


def op_seconds_by_caller(
    functions: dict[str, list[str]],
    run: Callable[[], object],
    calls: int,
    callers: dict[str, str],
    param_label: Callable[[str], str | None] = lambda name: None,
) -> dict[str, float]:
    """Seconds per call of ``run`` charged to each label of ``callers`` (``{function name:
    label}``), plus ``"elsewhere"`` and ``"XLA's own ops"``, from a profiler trace of ``calls``
    calls after one untimed; ``functions`` is `op_functions` of the program ``run`` runs. An op
    with no stack goes to ``param_label`` of the first parameter it reads that has one."""
    from jax.profiler import ProfileData

    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(calls):
            jax.block_until_ready(run())
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        profile = ProfileData.from_file(path)
    charged: collections.Counter[str] = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name not in functions:
                    continue
                stack = functions[event.name]
                label = next((callers[f] for f in stack if f in callers), None)
                params = [f.removeprefix("param:") for f in stack if f.startswith("param:")]
                if label is None and params:
                    label = next(filter(None, map(param_label, params)), "XLA's own ops")
                elif label is None:
                    label = "elsewhere" if stack else "XLA's own ops"
                charged[label] += event.duration_ns
    return {label: ns / 1e9 / calls for label, ns in charged.items()}
