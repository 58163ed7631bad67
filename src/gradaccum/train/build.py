"""Building what a run trains: the model (plain, DDP or FSDP2) in its parameters' dtype, and its
optimizer.

The parameters' dtype is a setting of its own (``TrainConfig.param_dtype``, ``--param-dtype``),
beside the compute precision: ``saved`` keeps what the workload builds (an ``hf:`` folder's saved
dtype, ``extras["saved_dtype"]``; float64 under precision float64), a dtype name casts to it. A
setting that would do nothing on these parameters is refused here, before the first window:
``accum_dtype`` with no parameter narrower than it, and float16's GradScaler on float16 gradients
it cannot unscale."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from gradaccum.check.workload import Workload
from gradaccum.distributed.wrap import wrap_model
from gradaccum.errors import SyncError, TrainError
from gradaccum.precision import accum_dtype_of, dtype_name, dtype_of
from gradaccum.tokens.cost import TransformerCost, model_dimensions
from gradaccum.train.config import TrainConfig

__all__ = [
    "build_cost",
    "build_model",
    "build_optimizer",
    "check_resumed_dtype",
    "param_dtype_of",
    "param_dtypes",
    "stored_dtype",
]


def param_dtype_of(workload: Workload, config: TrainConfig) -> torch.dtype | None:
    """The dtype the run stores the parameters in; ``None``: as the workload builds them."""
    if config.precision == "float64":
        return torch.float64  # TrainSpec refused another --param-dtype beside it
    if config.param_dtype != "saved":
        return dtype_of(config.param_dtype)
    saved = workload.extras.get("saved_dtype")  # an hf: folder's (its model is built in float32)
    return dtype_of(saved) if isinstance(saved, str) else None


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
    """The workload's model in the run's parameter dtype and on its device, compiled with
    ``config.compile``, wrapped for data parallelism (DDP, or FSDP2 with ``config.fsdp``; see
    :func:`gradaccum.distributed.wrap.wrap_model`)."""
    model = workload.build_model()
    dtype = param_dtype_of(workload, config)
    if dtype is not None:
        model = model.to(dtype)
    _check_dtypes(model, config)
    model = model.to(device)
    try:
        return wrap_model(model, device, fsdp=config.fsdp, compile=config.compile)
    except SyncError as exc:
        raise TrainError(f"--fsdp: {exc}") from exc


def stored_dtype(model: nn.Module) -> str:
    """The dtype most of ``model``'s trainable parameter elements are stored in, by name."""
    sizes: dict[str, int] = {}
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point():
            sizes[dtype_name(p.dtype)] = sizes.get(dtype_name(p.dtype), 0) + p.numel()
    return max(sizes, key=lambda name: sizes[name]) if sizes else "float32"


def check_resumed_dtype(meta: dict[str, Any], model: nn.Module) -> None:
    """Refuse resuming a checkpoint whose parameters were stored in another dtype (loading would cast
    them silently); a checkpoint written before the field is not checked."""
    saved, now = meta.get("param_dtype"), stored_dtype(model)
    if saved is not None and saved != now:
        raise TrainError(
            f"checkpoint {meta.get('path')} holds {saved} parameters, this run stores them in {now}; "
            f"resume with --param-dtype {saved}, or start a new run"
        )


def _stored(model: nn.Module) -> list[str]:
    return sorted(
        {dtype_name(p.dtype) for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    )


def _check_dtypes(model: nn.Module, config: TrainConfig) -> None:
    """Refuse an ``accum_dtype`` with nothing to widen, and float16's GradScaler on float16 gradients."""
    stored = _stored(model)
    words = ", ".join(stored) or "none"
    wide = config.accum.accum_dtype
    if wide is not None:
        target = accum_dtype_of(str(wide))  # AccumConfig holds it by name
        params = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
        if not any(p.dtype.itemsize < target.itemsize for p in params):
            raise TrainError(
                f"--accum-dtype {wide} widens the gradients of parameters narrower than {wide}, but the "
                f"parameters are {words} (--param-dtype {config.param_dtype}): it would do nothing. Train "
                "bfloat16 parameters (--param-dtype bfloat16, or a bfloat16 folder saved as it is), or "
                "leave out --accum-dtype"
            )
    if config.precision == "float16" and "float16" in stored and wide is None:
        raise TrainError(
            "--precision float16's GradScaler cannot unscale float16 gradients, and the parameters are "
            f"{words}: add --accum-dtype float32 (the gradients sum in float32), or store the parameters "
            "in float32 (--param-dtype float32)"
        )


def build_optimizer(config: TrainConfig, workload: Workload, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW or SGD at the peak learning rate, or the workload's own optimizer."""
    params = [p for p in model.parameters() if p.requires_grad]
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    return workload.optimizer_factory(params)


def param_dtypes(model: nn.Module) -> str:
    """The dtypes of ``model``'s trainable parameters, by share: ``bfloat16``, or ``float32 (90%),
    bfloat16 (10%)`` for a mixed model."""
    sizes: dict[str, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            name = str(p.dtype).removeprefix("torch.")
            sizes[name] = sizes.get(name, 0) + p.numel()
    total = sum(sizes.values())
    if len(sizes) <= 1:
        return next(iter(sizes), "none")
    ranked = sorted(sizes.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} ({100 * n / total:.0f}%)" for name, n in ranked)
