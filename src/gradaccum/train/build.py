"""Building what a run trains: the model (plain, DDP or FSDP2) and its optimizer."""

from __future__ import annotations

import torch
import torch.nn as nn

from gradaccum.check.workload import Workload
from gradaccum.distributed.wrap import wrap_model
from gradaccum.errors import SyncError, TrainError
from gradaccum.train.config import TrainConfig

__all__ = ["build_model", "build_optimizer"]


def build_model(workload: Workload, config: TrainConfig, device: torch.device) -> nn.Module:
    """The workload's model in the run's dtype and device, compiled with ``config.compile``, wrapped
    for data parallelism (DDP, or FSDP2 with ``config.fsdp``; see
    :func:`gradaccum.distributed.wrap.wrap_model`)."""
    model = workload.build_model()
    if config.precision == "float64":
        model = model.to(torch.float64)
    model = model.to(device)
    try:
        return wrap_model(model, device, fsdp=config.fsdp, compile=config.compile)
    except SyncError as exc:
        raise TrainError(f"--fsdp: {exc}") from exc


def build_optimizer(config: TrainConfig, workload: Workload, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW or SGD at the peak learning rate, or the workload's own optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    return workload.optimizer_factory(params)
