"""A device mesh as the configs spell it: ``MeshSpec``, ``parse_mesh_spec``, ``MeshError``.

``"tensor=4,expert=2"`` names the sizes of the mesh's three axes ``(data, expert, tensor)``.
Kept free of JAX so the processes that only read a cluster config (the router, the launcher)
never import it; `prfaas_jax.model.sharding` builds the mesh and its shardings.
"""

from __future__ import annotations

import dataclasses

from prfaas_jax.errors import UserError

MESH_AXES = ("data", "expert", "tensor")


class MeshError(UserError, ValueError):
    """A mesh spec that is malformed or does not fit the visible devices."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    tensor: int = 1
    expert: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        for axis in MESH_AXES:
            if getattr(self, axis) < 1:
                raise MeshError(f"mesh axis {axis} must be ≥ 1, got {getattr(self, axis)}")

    @property
    def num_devices(self) -> int:
        return self.data * self.expert * self.tensor

    def __str__(self) -> str:
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in ("tensor", "expert", "data"))


def parse_mesh_spec(text: str) -> MeshSpec:
    """``"tensor=4,expert=2"`` → ``MeshSpec(tensor=4, expert=2)``; unknown or repeated axes,
    and sizes that are not positive integers, raise ``MeshError``."""
    sizes: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES:
            raise MeshError(
                f"bad mesh entry {item!r} in {text!r}: expected AXIS=N with AXIS one of "
                f"{', '.join(MESH_AXES)} (e.g. tensor=4,expert=2)"
            )
        if name in sizes:
            raise MeshError(f"mesh axis {name} given twice in {text!r}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise MeshError(f"mesh axis {name} needs an integer size, got {value!r}") from None
    if not sizes:
        raise MeshError(f"empty mesh spec {text!r}: expected e.g. tensor=4")
    return MeshSpec(**sizes)
