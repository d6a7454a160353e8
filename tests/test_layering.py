"""The package layering of DESIGN.md §2, enforced by walking every module's imports."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "prfaas_jax"

# Imports only go down this list: a module may import its own layer and the layers above it.
RANK = {
    "errors": 0,
    "config": 0,
    "ops": 1,
    "model": 2,
    "engine": 3,
    "policy": 4,
    "serving": 5,
    "planning": 6,
    "cli": 7,
}
# Third-party packages some layers must never import.
FORBIDDEN = {
    "config": {"jax", "grpc"},
    "ops": {"grpc"},
    "model": {"grpc"},
    "engine": {"grpc"},
    "policy": {"jax", "jaxlib", "flax", "grpc"},
    "planning": {"jax", "jaxlib", "flax", "grpc"},
}
# Pure layers may not reach JAX through the project either.
PURE_LAYERS = {"policy", "planning"}
JAX_LAYERS = {"ops", "model", "engine", "serving"}


def _layer(module_path: pathlib.Path) -> str:
    rel = module_path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    layer = _layer(path)
    if layer not in RANK:
        pytest.fail(f"{path.relative_to(PACKAGE)} is not in a known layer: add it to DESIGN.md §2")
    for name in _imports(path):
        top, _, rest = name.partition(".")
        if top == "prfaas_jax" and rest:
            target = rest.split(".")[0]
            assert RANK[target] <= RANK[layer], f"{layer} must not import {name}"
            if layer in PURE_LAYERS:
                assert target not in JAX_LAYERS, f"pure layer {layer} imports {name}"
        assert top not in FORBIDDEN.get(layer, set()), f"{layer} must not import {top}"


def test_the_walk_sees_the_package():
    assert len(MODULES) > 20
