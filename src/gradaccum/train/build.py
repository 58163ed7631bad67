"""Building what a run trains: the model (plain, DDP or FSDP2) and its optimizer."""

from __future__ import annotations

import torch
import torch.nn as nn

from gradaccum.check.workload import Workload
from gradaccum.distributed.wrap import wrap_model
from gradaccum.errors import SyncError, TrainError
from gradaccum.tokens.cost import TransformerCost, model_dimensions
from gradaccum.train.config import TrainConfig

__all__ = ["build_cost", "build_model", "build_optimizer"]


def build_cost(config: TrainConfig, model: nn.Module) -> TransformerCost | None:
    """With ``config.balance_cost``: :func:`gradaccum.tokens.transformer_cost` with the d_model and
    layers the model declares (:func:`gradaccum.tokens.cost.model_dimensions`); refused by name when
    it declares none. ``None`` otherwise (the ranks balanced by valid tokens)."""
    if not config.balance_cost:
        return None
    dims = model_dimensions(model)
    if dims is None:
        raise TrainError(
            f"--balance-cost prices each row by the model's width and depth, and the workload "
            f"{config.workload}'s model ({type(model).__name__}) declares neither: no config or cfg "
            "with d_model/hidden_size/n_embd and n_layer/num_hidden_layers/num_layers. Give the model "
            "such a config, or balance by tokens (drop --balance-cost)"
        )
    return TransformerCost(*dims)


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
