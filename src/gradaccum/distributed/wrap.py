"""Wrapping a model for data parallelism, the one way bench and train both do it.

Several processes: DDP by default, or FSDP2 ``fully_shard`` applied to each block of every
``nn.ModuleList`` (the transformer layers, so that each block's parameters are gathered on their
own) and then to the root. One process: the model as it is.

``compile=True`` compiles in place (``nn.Module.compile()``, torch's default backend), where
torchtitan does: the whole model before DDP wraps it (``DDP(compile(m))``), or under FSDP2 each
block after ``fully_shard`` (the root's hooks stay eager; each block's graph is its own, and
identical blocks share one). Parameter names do not change, so checkpoints stay compatible.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum.distributed import dist
from gradaccum.errors import SyncError

__all__ = ["fsdp2_units", "repeated_blocks", "wrap_model"]


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` wrapped (each gathers its own parameters);
    empty for a model that is not sharded with FSDP2 or a torch without it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 keeps it under _composable
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of every ``nn.ModuleList`` in ``model``: the blocks a transformer repeats."""
    return [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]


def wrap_model(
    model: nn.Module,
    device: torch.device,
    *,
    fsdp: bool = False,
    bucket_cap_mb: float | None = None,
    compile: bool = False,
) -> nn.Module:
    """``model`` (already on ``device``) wrapped for the initialized process group, if any.

    ``fsdp``: shard with FSDP2 instead of replicating with DDP (needs a process group, of one rank
    or more). ``bucket_cap_mb``: DDP's gradient bucket size (``None``: DDP's default, 25 MiB).
    ``compile``: compile in place, the whole model or (FSDP2) each block after sharding.
    """
    if compile and not fsdp:
        model.compile()
    if fsdp:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise SyncError(
                "FSDP2 sharding needs a process group: launch with torchrun (one process or more)"
            )
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.world_size(),))
        blocks = repeated_blocks(model)
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if compile:
            if not blocks:
                raise SyncError(
                    "compile under FSDP2 compiles each repeated block (an nn.ModuleList member) after "
                    f"fully_shard, and {type(model).__name__} has none; train it compiled under DDP"
                )
            for block in blocks:
                block.compile()
        return model
    if not dist.is_distributed():
        return model
    ids = [device.index] if device.type == "cuda" else None
    if bucket_cap_mb is None:
        return DistributedDataParallel(model, device_ids=ids)
    return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
