"""The package tree: no two classes share a name, so a class name alone says which one is meant
(in docs, logs and tracebacks). Generated protobuf modules are left out."""

from __future__ import annotations

import ast
import collections
import pathlib

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
