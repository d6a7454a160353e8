"""No import cycle among the modules of ``prfaas_jax``, found from the source alone.

The graph has an edge for every import statement anywhere in a module: at the top, inside a
function, under ``if TYPE_CHECKING:`` (a cycle that only the type checker follows is still two
modules that cannot be read, tested or moved apart). Relative imports are resolved against the
importing module's package; ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module and to ``pkg`` otherwise. The generated gRPC stubs (``serving/proto/*_pb2*``) are left
out. Every strongly connected component of more than one module, or a module importing itself,
is a cycle; the test names each with one loop through it.
"""

from __future__ import annotations

import ast
import collections
import pathlib
from collections.abc import Iterable, Mapping

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "prfaas_jax"

Graph = Mapping[str, Iterable[str]]


def _is_stub(module: str) -> bool:
    """A generated gRPC stub (``proto/*_pb2*``), left out of the graph."""
    package, _, name = module.rpartition(".")
    return package.endswith("proto") and "_pb2" in name


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _known(name: str, modules: set[str]) -> str | None:
    """``name`` if it is a module, else the longest module it names an attribute of."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: set[str]) -> list[str]:
    """The names an import statement reaches: modules, or modules' attributes."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*anchor, node.module] if node.module else anchor)
    else:
        base = node.module or ""
    named = [f"{base}.{alias.name}" for alias in node.names]
    return [name if name in modules or _is_stub(name) else base for name in named]


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package at ``root`` (module docstring)."""
    files = {
        _module_name(root, path): path
        for path in sorted(root.rglob("*.py"))
        if not _is_stub(_module_name(root, path))
    }
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, package, modules):
                    known = None if _is_stub(target) else _known(target, modules)
                    if known is not None:
                        edges.add(known)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit to meet)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _loop_through(graph: Graph, component: list[str]) -> list[str]:
    """One cycle inside ``component``, from its first module back to it (breadth first)."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    queue = collections.deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph.get(node, ())):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if succ in members and succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
    raise AssertionError(f"{component} holds no cycle")


def cycles(graph: Graph) -> list[list[str]]:
    """Every cycle of ``graph``, one loop per strongly connected component (sorted)."""
    return sorted(_loop_through(graph, c) for c in _tangled(graph))


def _tangled(graph: Graph) -> list[list[str]]:
    """The strongly connected components that hold a cycle."""
    return [c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph.get(c[0], ())]


def test_no_import_cycle_in_the_package():
    graph = import_graph(PACKAGE)
    found = [
        f"{', '.join(component)} (e.g. {' → '.join(_loop_through(graph, component))})"
        for component in _tangled(graph)
    ]
    assert not found, "modules that import each other:\n" + "\n".join(found)


def test_the_graph_sees_the_package():
    graph = import_graph(PACKAGE)
    assert len(graph) > 100
    assert not any("_pb2" in name for name in graph)
    assert "prfaas_jax.sim.events" in graph["prfaas_jax.sim.simulator"]


def test_cycles_are_found_in_a_synthetic_graph():
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a → b → c → a
        "d": {"e"},
        "e": {"d"},  # d ↔ e, reached from the first cycle
        "f": {"f"},  # a module importing itself
        "g": {"a", "h"},  # into a cycle, but on none
        "h": set(),
    }
    assert cycles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"], ["f", "f"]]
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"], ["f"], ["g"], ["h"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []


def test_a_cycle_through_a_long_chain_is_found():
    """A chain longer than Python's recursion limit, closed into one cycle."""
    n = 5000
    graph = {f"m{i}": {f"m{(i + 1) % n}"} for i in range(n)}
    (loop,) = cycles(graph)
    assert len(loop) == n + 1 and loop[0] == loop[-1] == "m0"


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_every_import_statement_counts(tmp_path):
    """Imports under TYPE_CHECKING and inside functions are edges; relative imports are resolved;
    `from pkg import name` is an edge to the module `pkg.name`, or to `pkg` for a name in it;
    generated stubs are not in the graph."""
    root = tmp_path / "pkg"
    _write(
        root,
        {
            "__init__.py": "",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
            "b.py": "def f():\n    from . import a\n",
            "c.py": "from .sub import THING\nfrom .sub import leaf\nimport pkg.sub.leaf\n",
            "sub/__init__.py": "THING = 1\n",
            "sub/leaf.py": "from .. import c\nfrom ..proto import x_pb2\n",
            "proto/__init__.py": "",
            "proto/x_pb2.py": "from pkg import a\n",
        },
    )
    graph = import_graph(root)
    assert graph == {
        "pkg": set(),
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.a"},
        "pkg.c": {"pkg.sub", "pkg.sub.leaf"},
        "pkg.sub": set(),
        "pkg.sub.leaf": {"pkg.c"},
        "pkg.proto": set(),
    }
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub.leaf", "pkg.c"]]
