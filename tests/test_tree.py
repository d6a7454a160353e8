"""The package tree: no two classes share a name, so a class name alone says which one is meant
(in docs, logs and tracebacks); a module over `LONG_MODULE_LINES` lines says in its docstring why
it stays whole. Generated protobuf modules are left out."""

from __future__ import annotations

import ast
import collections
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "prfaas_jax"


def _is_generated(path: pathlib.Path) -> bool:
    return path.parent.name == "proto" and "_pb2" in path.name


def _classes() -> dict[str, list[str]]:
    """Every class name in the package, with the modules that define it."""
    where: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        if _is_generated(path):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(PACKAGE)))
    return where


def test_the_walk_sees_the_package_and_skips_the_generated_modules():
    assert {"ModelConfig", "ClusterConfig", "SimConfig", "Where"} <= set(_classes())
    assert any(_is_generated(path) for path in PACKAGE.rglob("*.py"))


def test_no_two_classes_share_a_name():
    shared = {name: paths for name, paths in _classes().items() if len(paths) > 1}
    assert not shared, "; ".join(f"{name} in {', '.join(paths)}" for name, paths in shared.items())


LONG_MODULE_LINES = 450
# "The module is over 500 lines because …", "Over 450 lines: …", "longer than most because …"
SAYS_WHY_LONG = re.compile(r"\b(?:over\s+\d+\s+lines|longer\s+than\s+most)\b", re.IGNORECASE)


def _long_modules() -> dict[str, str]:
    """Every module over LONG_MODULE_LINES lines, with its docstring."""
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if not _is_generated(path) and len(text.splitlines()) > LONG_MODULE_LINES:
            long[str(path.relative_to(PACKAGE))] = ast.get_docstring(ast.parse(text)) or ""
    return long


def test_a_long_module_says_why_it_is_long():
    assert "serving/router/core.py" in _long_modules()
    unexplained = [name for name, doc in _long_modules().items() if not SAYS_WHY_LONG.search(doc)]
    assert not unexplained, f"over {LONG_MODULE_LINES} lines, and no word why: {unexplained}"


def test_the_reason_is_recognised():
    assert SAYS_WHY_LONG.search("…in one place.\n\nThe module is over 500\nlines because")
    assert SAYS_WHY_LONG.search("The module is over 500 lines: the services share a lock")
    assert SAYS_WHY_LONG.search("The module is longer than most because one request's life")
    assert not SAYS_WHY_LONG.search("Over the link, 450 lines of state")
