"""What the window engine asks of a mesh: validation when it is built, the replicas' count check.

Kept beside :mod:`gradaccum.mesh.layout` so that :mod:`gradaccum.step.engine` reads as the step
itself; each function here is called from one place there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.distributed.sync import SyncKind
from gradaccum.errors import ConfigError
from gradaccum.mesh.layout import DATA_ROLES, MeshLayout
from gradaccum.step.config import AccumConfig, SyncPolicy

__all__ = [
    "check_sync_policy",
    "layout_for_step",
    "raise_replica_mismatch",
    "replica_slots",
    "replicas_agree",
]


def layout_for_step(
    mesh: Any,
    mesh_dims: Mapping[str, str] | None,
    *,
    model: nn.Module,
    config: AccumConfig,
    dp_group: Any,
    pipeline: bool,
) -> MeshLayout | None:
    """The mesh by role, checked against the model, the process group and the settings."""
    if mesh is None:
        if mesh_dims is not None:
            raise ConfigError("mesh_dims was given without a mesh; pass mesh=<the DeviceMesh> too")
        return None
    if dp_group is not None:
        raise ConfigError(
            "pass mesh= or dp_group=, not both: on a mesh the step derives its groups from the "
            "mesh's named dimensions"
        )
    layout = MeshLayout.read(mesh, mesh_dims)
    if layout.world != dist.world_size():
        raise ConfigError(
            f"the mesh spans {layout.world} ranks but the default process group has "
            f"{dist.world_size()}: build the mesh over every rank of the job"
        )
    if layout.pp > 1 and not pipeline:
        raise ConfigError(
            f"the mesh has {layout.names['pp']}={layout.pp} pipeline stages; a pipeline-parallel "
            "model steps with gradaccum.pipeline.PipelineAccumulator, whose schedule runs the "
            "micro-batches"
        )
    layout.check_model(model, mesh)
    if config.noise_scale:
        raise ConfigError(
            "noise_scale=True is not supported with mesh=: the estimate reads whole per-micro-batch "
            "gradients, which a mesh spreads over shards. Measure it on a data-parallel run."
        )
    return layout


def check_sync_policy(config: AccumConfig, kind: SyncKind, layout: MeshLayout | None) -> SyncPolicy:
    """The config's sync policy, refused where the model cannot follow it."""
    policy = config.policy
    if policy == "defer_replicate":
        replicated = layout is not None and layout.sizes["dp_replicate"] > 1
        if kind != "fsdp2" or not replicated:
            where = "without a mesh" if layout is None else "on " + layout.describe()
            raise ConfigError(
                "sync_policy='defer_replicate' reduce-scatters over the shards every micro-batch and "
                "all-reduces over the replicas once: it needs a model under FSDP2 on a mesh with "
                f"dp_replicate > 1 (HSDP), passed as mesh=; this model is {kind} {where}. "
                "Use 'defer' or 'every'."
            )
    return policy


def replica_slots(layout: MeshLayout, local_count: torch.Tensor, k: int) -> torch.Tensor:
    """[c, c^2, k, k^2] at this rank's data index, zeros elsewhere: summed over every rank, the R
    ranks holding the same tokens at index d agree iff R * sum(c^2) == (sum c)^2 (and so for k)."""
    slots = torch.zeros(layout.data_size, 4, dtype=torch.float64, device=local_count.device)
    count = local_count.to(torch.float64)
    row = [count, count * count, count.new_tensor(k), count.new_tensor(k * k)]
    slots[layout.data_index] = torch.stack(row)
    return slots.reshape(-1)


def replicas_agree(sums: list[float], replicas: int) -> bool:
    """Whether every data index's R ranks counted the same units and micro-batches."""
    rows = [sums[i : i + 4] for i in range(0, len(sums), 4)]
    return all(replicas * sq == c * c and replicas * ksq == kk * kk for c, sq, kk, ksq in rows)


def raise_replica_mismatch(layout: MeshLayout, local_count: torch.Tensor, k: int, group: Any) -> None:
    """Name, on every rank, the ranks holding the same tokens whose windows differ (one gather)."""
    mine = (dist.rank(), layout.coordinate, int(local_count.item()), k)
    everyone = dist.all_gather_objects(mine, group, what="the ranks' counts")
    by_index: dict[tuple[int, ...], list[str]] = {}
    for rank, coordinate, count, micro in everyone:
        key = tuple(coordinate[r] for r in DATA_ROLES)
        by_index.setdefault(key, []).append(f"rank {rank}: {count} units in {micro} micro-batches")
    differ = [f"[{'; '.join(v)}]" for v in by_index.values() if len({x.split(": ")[1] for x in v}) > 1]
    raise ConfigError(
        "ranks that hold the same tokens (tensor-parallel ranks, pipeline stages) counted different "
        f"windows: {', '.join(differ)}. Give every TP rank and every stage of a pipeline the same "
        "micro-batches (the data loader must shard by the data dimensions only)."
    )
