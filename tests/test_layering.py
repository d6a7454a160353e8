"""The package layering of docs/design.md §2, enforced by walking every module's imports.

Two levels: the top-level packages of ``prfaas_jax`` (``RANK``), and inside ``serving`` its
sub-layers by process role (``SERVING_RANK``). A module may import its own layer and the layers
below it; the worker and the router, two processes that meet only on the wire, may not import
each other.
Relative imports are resolved against the importing module's package.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "prfaas_jax"

# Imports only go down this list: a module may import its own layer and the layers above it.
RANK = {
    "errors": 0,
    "config": 0,
    "toml_config": 0,
    "tables": 0,
    "mesh_spec": 0,
    "state_bytes": 0,
    "wire_precision": 0,
    "prefix_events": 0,
    "ops": 1,
    "model": 2,
    "train": 3,
    "engine": 3,
    "policy": 4,
    "planning": 5,
    "sim": 6,
    "serving": 7,
    "cli": 8,
}
# Inside serving: what every process reads (the cluster config, the generated stubs), then the
# wire, then the state transfer over it, then the three process kinds side by side (worker,
# router, HTTP front door), then the launcher, then load generators.
SERVING_RANK = {
    "cluster_config": 0,
    "cluster_sections": 0,
    "bind_rule": 0,
    "proto": 0,
    "transport": 1,
    "transfer": 2,
    "worker": 3,
    "router": 3,
    "frontdoor": 3,
    "cluster": 4,
    "loadgen": 5,
}
# Processes that talk only over the wire: none imports another.
SEPARATE_PROCESSES = {"worker", "router", "frontdoor"}
# Control processes that never hold a state: they route transfers, never make or take one.
NO_TRANSFER = {"router", "frontdoor"}
# Third-party packages some layers must never import.
FORBIDDEN = {
    "errors": {"jax", "grpc"},
    "config": {"jax", "grpc"},
    "toml_config": {"jax", "grpc"},
    "tables": {"jax", "grpc"},
    "mesh_spec": {"jax", "grpc"},
    "state_bytes": {"jax", "grpc"},
    "wire_precision": {"jax", "grpc", "numpy"},
    "prefix_events": {"jax", "grpc", "numpy"},
    "ops": {"grpc"},
    "model": {"grpc"},
    "train": {"grpc"},
    "engine": {"grpc"},
    "policy": {"jax", "jaxlib", "flax", "grpc"},
    "planning": {"jax", "jaxlib", "flax", "grpc"},
    "sim": {"jax", "jaxlib", "flax", "grpc"},
}
# Pure layers may not reach JAX through the project either.
PURE_LAYERS = {"policy", "planning", "sim"}
JAX_LAYERS = {"ops", "model", "train", "engine", "serving"}


def _module_parts(path: pathlib.Path) -> list[str]:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _imports(path: pathlib.Path) -> list[str]:
    """Every project-absolute module name ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["prfaas_jax", *_module_parts(path)]
    if path.name != "__init__.py":
        package = package[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            names.append(base)
            # `from pkg import module` imports a module too.
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def _layer(parts: list[str]) -> str:
    return parts[0]


def _serving_layer(parts: list[str]) -> str | None:
    return parts[1] if parts[0] == "serving" and len(parts) > 1 else None


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def _project_targets(name: str) -> list[str] | None:
    top, _, rest = name.partition(".")
    if top != "prfaas_jax" or not rest:
        return None
    return rest.split(".")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    parts = _module_parts(path)
    layer = _layer(parts)
    if layer not in RANK:
        pytest.fail(f"{path.relative_to(PACKAGE)}: no known layer; add it to docs/design.md §2")
    sub = _serving_layer(parts)
    if layer == "serving" and sub is not None and sub not in SERVING_RANK:
        pytest.fail(f"{path.relative_to(PACKAGE)} is not in a known serving layer")
    for name in _imports(path):
        target = _project_targets(name)
        if target is None:
            top = name.partition(".")[0]
            assert top not in FORBIDDEN.get(layer, set()), f"{layer} must not import {top}"
            continue
        if target[0] not in RANK:  # `from prfaas_jax import x` names a module x, checked above
            continue
        assert RANK[target[0]] <= RANK[layer], f"{layer} must not import {name}"
        if layer in PURE_LAYERS:
            assert target[0] not in JAX_LAYERS, f"pure layer {layer} imports {name}"
        if layer == "serving" and target[0] == "serving" and sub and len(target) > 1:
            there = target[1]
            if there not in SERVING_RANK:
                continue  # a name imported from the serving package itself
            assert SERVING_RANK[there] <= SERVING_RANK[sub], f"serving.{sub} imports {name}"
            if there != sub and {there, sub} <= SEPARATE_PROCESSES:
                pytest.fail(f"serving.{sub} imports its peer {name}")
            if sub in NO_TRANSFER and there == "transfer":
                pytest.fail(f"serving.{sub} holds no state, yet imports {name}")


def test_the_walk_sees_the_package():
    assert len(MODULES) > 20
    names = {".".join(_module_parts(p)) for p in MODULES}
    assert {"serving.router.core", "serving.worker.decode", "sim.simulator"} <= names
    assert {"serving.transfer.api", "serving.transfer.sender", "serving.transfer.receiver"} <= names


def test_the_package_docstring_lists_the_layers_in_rank_order():
    """`prfaas_jax/__init__.py` lists the layers as RANK has them: the numbered list's items,
    each with its rank, name every layer once."""
    import prfaas_jax

    items = re.findall(r"^(\d+)\. (.+?)(?=^\d+\. |\Z)", prfaas_jax.__doc__, re.M | re.S)
    listed = {name: int(rank) for rank, text in items for name in re.findall(r"``(\w+)``", text)}
    assert listed == RANK
    assert [int(rank) for rank, _ in items] == sorted(set(RANK.values()))


def test_relative_imports_are_resolved():
    """A relative import is checked like an absolute one (a hole a layering guard must not have)."""
    probe = PACKAGE / "serving" / "router" / "core.py"
    tree_names = _imports(probe)
    assert all(not n.startswith(".") for n in tree_names)


# What `prfaas serve` runs besides the JAX workers, and what a fake-engine worker loads: the
# packages each may not import.
JAX_STACK = ("jax", "jaxlib", "flax", "optax", "orbax", "einops", "ml_dtypes")
LEAN_ENTRY_POINTS = {
    "prfaas_jax.serving.router.main": JAX_STACK,
    "prfaas_jax.serving.cluster.launcher": JAX_STACK,
    "prfaas_jax.serving.frontdoor.app": JAX_STACK,
    # A fake-engine worker needs JAX for its state pytrees, never the model's Flax modules.
    "prfaas_jax.serving.worker.main": ("flax", "optax", "orbax"),
    "prfaas_jax.engine.fake": ("flax", "optax", "orbax"),
}


@pytest.mark.parametrize("module", sorted(LEAN_ENTRY_POINTS))
def test_the_control_processes_import_only_what_they_run(module):
    """The router, the launcher and the HTTP front door import with JAX made unimportable, a
    fake-engine worker with Flax made unimportable: a cluster's control processes start in a
    fraction of a second, and the fake clusters of the tests pay for JAX's import only."""
    probe = (
        "import importlib, sys\n"
        f"for name in {LEAN_ENTRY_POINTS[module]!r}: sys.modules[name] = None\n"
        f"importlib.import_module({module!r})\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_model_package_loads_every_name_it_exports():
    """`prfaas_jax.model` resolves its names on first use: each exported name has a home module
    and resolves there, and nothing else does."""
    import prfaas_jax.model as model

    assert sorted(model.__all__) == sorted(model._HOME)
    for name in model.__all__:
        assert getattr(model, name) is not None  # its home module defines it
    with pytest.raises(AttributeError):
        model.no_such_name  # noqa: B018
