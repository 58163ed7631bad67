"""A ``DeviceMesh`` read by role: which dimensions split the data, which split the model.

Large models train on a mesh of data-parallel replicas and shards, context-parallel (CP),
tensor-parallel (TP) and pipeline-parallel (PP) ranks. For the exact step only two questions matter:

- which ranks hold *different tokens* (the data dimensions ``dp_replicate`` x ``dp_shard`` x ``cp``:
  their counts add up to the window's N), and
- which ranks hold *the same tokens* (``tp``: the counts must agree, and are counted once; ``pp``:
  every stage of one pipeline sees the same micro-batches).

Dimension names default to torchtitan's; ``mesh_dims={"dp_shard": "fsdp"}`` maps a role to another
name. A mesh must name every dimension, and every name must be a role, so that no dimension is
silently treated as data or as model parallel.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradaccum.errors import ConfigError

if TYPE_CHECKING:  # this module imports no torch: the plan reads mesh shapes without it
    import torch.nn as nn

__all__ = ["DATA_ROLES", "ROLES", "MeshLayout", "parse_mesh", "role_sizes"]

ROLES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
"""Every role a mesh dimension can play, named as torchtitan names them."""
DATA_ROLES = ("dp_replicate", "dp_shard", "cp")
"""The roles whose ranks hold different tokens: N is summed over them."""


@dataclass(frozen=True, slots=True)
class MeshLayout:
    """This rank's place in the mesh, by role (a role the mesh lacks has size 1, index 0)."""

    names: dict[str, str]
    """Role -> the mesh's name for it, for the roles the mesh has."""
    sizes: dict[str, int]
    """Role -> ranks along it (1 for a role the mesh lacks)."""
    coordinate: dict[str, int]
    """Role -> this rank's index along it."""
    world: int
    """Ranks in the mesh."""

    @property
    def data_size(self) -> int:
        """Ranks that hold different tokens: dp_replicate x dp_shard x cp."""
        return math.prod(self.sizes[r] for r in DATA_ROLES)

    @property
    def data_index(self) -> int:
        """This rank's index among them (row-major over dp_replicate, dp_shard, cp)."""
        index = 0
        for role in DATA_ROLES:
            index = index * self.sizes[role] + self.coordinate[role]
        return index

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    @property
    def pp(self) -> int:
        return self.sizes["pp"]

    def describe(self) -> str:
        """``dp_shard=2 x tp=2`` in the mesh's own names."""
        return " x ".join(f"{self.names[r]}={self.sizes[r]}" for r in ROLES if r in self.names)

    @classmethod
    def read(cls, mesh: Any, mesh_dims: Mapping[str, str] | None = None) -> MeshLayout:
        """Validate ``mesh`` against the roles (``mesh_dims`` maps role -> the mesh's name)."""
        names = _role_names(mesh_dims)
        dim_names = _mesh_dim_names(mesh)
        role_of = {name: role for role, name in names.items()}
        unknown = [n for n in dim_names if n not in role_of]
        if unknown:
            raise ConfigError(
                f"the mesh has dimension(s) {unknown} that play no known role; the roles are "
                f"{list(ROLES)} (named {[names[r] for r in ROLES]}). Name the mesh's dimensions so, or "
                f"map them with mesh_dims={{role: name}}, e.g. mesh_dims={{'dp_shard': {unknown[0]!r}}}."
            )
        present = {role_of[n]: n for n in dim_names}
        sizes = {r: int(mesh.size(dim_names.index(present[r]))) if r in present else 1 for r in ROLES}
        coordinate_list = mesh.get_coordinate()
        if coordinate_list is None:
            raise ConfigError("this rank is not part of the mesh given to the accumulator")
        coordinate = {
            r: int(coordinate_list[dim_names.index(present[r])]) if r in present else 0 for r in ROLES
        }
        return cls(names=present, sizes=sizes, coordinate=coordinate, world=int(mesh.size()))

    def check_model(self, model: nn.Module, mesh: Any) -> None:
        """Refuse a model whose DTensor parameters live on a mesh that is not part of ``mesh``.

        A parameter parallelized on another mesh would be reduced over ranks the step does not
        count. Each of its mesh's dimensions must be a dimension of ``mesh`` (by name and size),
        or a flattening of data dimensions of ``mesh`` (torchtitan shards FSDP2 over
        ``dp_shard_cp``, ``dp_shard`` x ``cp`` flattened): recognized by the ranks this rank
        meets along it, which must be exactly those along those dimensions of ``mesh``.
        """
        mine = {name: int(mesh.size(i)) for i, name in enumerate(mesh.mesh_dim_names)}
        ranks = set(mesh.mesh.flatten().tolist())
        roles = {name: role for role, name in self.names.items()}
        known: dict[tuple[int, int], bool] = {}
        for name, p in model.named_parameters():
            param_mesh = getattr(p, "device_mesh", None)
            if param_mesh is None:
                continue
            dims = param_mesh.mesh_dim_names
            other = set(param_mesh.mesh.flatten().tolist())
            same = dims is not None
            for i, d in enumerate(dims or ()):
                if d in mine and mine[d] == param_mesh.size(i):
                    continue
                key = (id(param_mesh), i)
                if key not in known:
                    spanned = _spanned_dims(mesh, param_mesh, i)
                    known[key] = spanned is not None and all(roles.get(s) in DATA_ROLES for s in spanned)
                same = same and known[key]
            if not same or not other <= ranks:
                raise ConfigError(
                    f"parameter {name!r} is parallelized on a mesh with dimensions {dims} over ranks "
                    f"{sorted(other)}, which is not part of the mesh given to the accumulator "
                    f"({dict(mine)} over ranks {sorted(ranks)}). Pass the mesh the model was "
                    "parallelized with (the one whose sub-meshes, or data dimensions flattened with "
                    "_flatten, went to parallelize_module and fully_shard)."
                )


def _spanned_dims(mesh: Any, sub: Any, dim: int) -> tuple[str, ...] | None:
    """The dimensions of ``mesh`` that dimension ``dim`` of the mesh ``sub`` runs along (several
    for a flattened one), found by the ranks this rank meets along it; None if no set matches."""
    here, root_here = sub.get_coordinate(), mesh.get_coordinate()
    if here is None or root_here is None:
        return None
    line = tuple(slice(None) if j == dim else c for j, c in enumerate(here))
    along = set(sub.mesh[line].flatten().tolist())
    names = mesh.mesh_dim_names
    for size in range(1, len(names) + 1):
        for combo in itertools.combinations(range(len(names)), size):
            index = tuple(slice(None) if j in combo else c for j, c in enumerate(root_here))
            if set(mesh.mesh[index].flatten().tolist()) == along:
                return tuple(names[j] for j in combo)
    return None


def role_sizes(mesh: Any, mesh_dims: Mapping[str, str] | None = None) -> dict[str, int]:
    """Ranks along each role (1 where absent), of a DeviceMesh or of ``{name: size}``."""
    names = _role_names(mesh_dims)
    role_of = {name: role for role, name in names.items()}
    if isinstance(mesh, Mapping):
        shape = dict(mesh)
    else:
        dim_names = _mesh_dim_names(mesh)
        shape = {name: int(mesh.size(i)) for i, name in enumerate(dim_names)}
    unknown = [n for n in shape if n not in role_of]
    if unknown:
        raise ConfigError(
            f"the mesh has dimension(s) {unknown} that play no known role; the roles are {list(ROLES)}"
        )
    for name, size in shape.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"mesh dimension {name!r} must have a positive integer size, got {size!r}")
    return {role: shape.get(names[role], 1) for role in ROLES}


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp_shard=2,tp=2"`` -> ``{"dp_shard": 2, "tp": 2}`` (the CLI's ``--mesh``)."""
    shape: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        if not sep or not name or not size.strip().isdigit() or int(size) < 1:
            raise ConfigError(
                f"--mesh takes NAME=SIZE pairs separated by commas, e.g. dp_shard=2,tp=2; got {part!r}"
            )
        if name in shape:
            raise ConfigError(f"--mesh names dimension {name!r} twice")
        shape[name] = int(size)
    role_sizes(shape)
    return shape


def _role_names(mesh_dims: Mapping[str, str] | None) -> dict[str, str]:
    names = {role: role for role in ROLES}
    if mesh_dims is None:
        return names
    if not isinstance(mesh_dims, Mapping):
        raise ConfigError(f"mesh_dims must map roles to mesh dimension names, got {type(mesh_dims).__name__}")
    for role, name in mesh_dims.items():
        if role not in ROLES:
            raise ConfigError(f"mesh_dims: unknown role {role!r}; the roles are {list(ROLES)}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"mesh_dims[{role!r}] must be a dimension name (a string), got {name!r}")
        names[role] = name
    seen: dict[str, str] = {}
    for role, name in names.items():
        if name in seen:
            raise ConfigError(
                f"mesh_dims names dimension {name!r} twice: for {seen[name]!r} and for {role!r}; "
                "each mesh dimension plays one role"
            )
        seen[name] = role
    return names


def _mesh_dim_names(mesh: Any) -> list[str]:
    dim_names = getattr(mesh, "mesh_dim_names", None)
    if not callable(getattr(mesh, "get_coordinate", None)):
        raise ConfigError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if dim_names is None or any(not n for n in dim_names):
        raise ConfigError(
            f"the mesh's dimensions are not named (mesh_dim_names={dim_names}); build it with "
            "init_device_mesh(..., mesh_dim_names=('dp_shard', 'tp')) so that the step knows which "
            "dimensions hold different tokens"
        )
    names = list(dim_names)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"the mesh names dimension(s) {twice} twice; each dimension needs its own name")
    return names
