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
from gradaccum.distributed.sync import SyncKind, sync_module
from gradaccum.errors import ConfigError, WindowError
from gradaccum.mesh.layout import DATA_ROLES, MeshLayout
from gradaccum.step.config import AccumConfig, SyncPolicy

__all__ = [
    "check_ddp_group",
    "check_sync_policy",
    "layout_for_step",
    "raise_length_mismatch",
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
    if not pipeline:  # a pipeline checks each stage's module itself
        check_ddp_group(sync_module(model), mesh, layout, "the model's")
    if config.noise_scale:
        raise ConfigError(
            "noise_scale=True is not supported with mesh=: the estimate reads whole per-micro-batch "
            "gradients, which a mesh spreads over shards. Measure it on a data-parallel run."
        )
    return layout


def check_ddp_group(module: nn.Module, mesh: Any, layout: MeshLayout, whose: str) -> None:
    """Refuse a DistributedDataParallel that does not reduce over exactly this rank's data ranks.

    F in F/N is the number of ranks DDP averages over, and N counts each token once. A DDP over
    the default group on a mesh with TP (or pipeline) ranks also averages the ranks that hold the
    same tokens: on ``dp_replicate=2 x tp=2`` every data rank's gradient enters the sum twice and
    the update is exactly twice the full batch's. The ranks are compared, not the group objects.
    """
    from torch.distributed import get_process_group_ranks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return
    names = [layout.names[r] for r in DATA_ROLES if r in layout.names]
    data = mesh[tuple(names)] if len(names) > 1 else mesh[names[0]] if names else None
    want = sorted(data.mesh.flatten().tolist()) if data is not None else [dist.rank()]
    got = sorted(get_process_group_ranks(module.process_group))
    if got != want:
        raise ConfigError(
            f"{whose} DistributedDataParallel reduces over ranks {got}, but this rank's data-parallel "
            f"ranks on the mesh ({layout.describe()}) are {want}: it would also average the ranks "
            "that hold the same tokens, a silent factor in the update. Build it with "
            "process_group=mesh[<data dimension>].get_group() (a flattened submesh's group where "
            "there are several data dimensions)."
        )


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


def raise_length_mismatch(k: int, group: Any) -> None:
    """Name, on every rank, the pipeline ranks whose windows hold different numbers of micro-batches.

    The plain step lets DDP ranks run uneven windows (the sync waits for the last backward); a
    pipeline schedule cannot: its stages exchange activations micro-batch by micro-batch, and a
    DDP stage reduces after its k-th backward, so the replicas would wait on each other forever.
    Called where the count all-reduce showed the lengths differ (every rank sees that alike)."""
    everyone = dist.all_gather_objects((dist.rank(), k), group, what="the windows' lengths")
    lengths = ", ".join(f"rank {rank}: {micro}" for rank, micro in everyone)
    raise WindowError(
        f"the pipeline's data replicas hold windows of different lengths (micro-batches per rank: "
        f"{lengths}): the schedule runs every replica's stages in step, micro-batch by micro-batch, "
        "so uneven windows would hang. Give every data-parallel rank the same number of "
        "micro-batches (uneven token counts are fine; pad with an all-padding micro-batch)."
    )
