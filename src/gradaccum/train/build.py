"""Building what a run trains: the model (plain, DDP or FSDP2), its optimizer, and its precision."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum.check.workload import Workload
from gradaccum.distributed import dist
from gradaccum.train.config import TrainConfig, TrainError

__all__ = ["build_model", "build_optimizer"]


def build_model(workload: Workload, config: TrainConfig, device: torch.device) -> nn.Module:
    """The workload's model in the run's dtype and device, wrapped for data parallelism.

    Several processes: DDP, or with ``config.fsdp`` FSDP2 ``fully_shard`` applied to each block of
    every ``nn.ModuleList`` (the transformer layers) and then to the root.
    """
    model = workload.build_model()
    if config.precision == "float64":
        model = model.to(torch.float64)
    model = model.to(device)
    if config.fsdp:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise TrainError("fsdp=True needs a process group: launch with torchrun (one process or more)")
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.world_size(),))
        for module in list(model.modules()):
            if isinstance(module, nn.ModuleList):
                for block in module:
                    fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if dist.is_distributed():
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def build_optimizer(config: TrainConfig, workload: Workload, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW or SGD at the peak learning rate, or the workload's own optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    return workload.optimizer_factory(params)
