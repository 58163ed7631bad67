"""Exact accumulation with Lightning: ``window_step`` for the Trainer, ``Accumulator`` for Fabric.

**Lightning Trainer.** ``accumulate_grad_batches=k`` divides every micro-batch's loss by k, also in
the short final window of an epoch (Lightning #19987). Exact instead: one DataLoader batch is one
window (``batch_size`` = micro-batch x k, ``drop_last=False``), the module optimizes manually, and
its ``training_step`` hands the window to :func:`window_step`::

    class LitModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            result = window_step(self, gradaccum.split(batch, micro_batch=4), loss_fn, count_fn)
            self.log("train_loss", result.loss)

The last batch of an epoch is smaller, so it is a short window with its own count. ``window_step``
counts every micro-batch before the first backward, sums the counts over the ranks (one small
all-reduce), backpropagates each micro-batch's summed loss times W/N through
``LightningModule.manual_backward`` (so precision plugins and backward hooks run) with DDP sync
deferred to the last micro-batch, then clips, steps the optimizer and the schedulers once.

**Fabric.** ``fabric.setup(model, optimizer)`` returns a ``_FabricModule`` and a ``_FabricOptimizer``;
``gradaccum.Accumulator(model, optimizer)`` takes them as they are: the step forwards through
Fabric's wrapper (its autocast and input casting) and defers sync on the DDP inside it
(:func:`gradaccum.distributed.sync.sync_module`), and ``optimizer.step()`` goes through Fabric's
strategy. Fabric precisions whose plugin must run the backward itself (``"16-mixed"``,
``"bf16-mixed"``: Fabric's wrapper then refuses a plain ``backward()``) need ``fabric.backward``,
which the step does not call; full and ``-true`` precisions work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.distributed.sync import sync_deferred, sync_kind
from gradaccum.errors import ConfigError, CountError, LossError
from gradaccum.step.checks import as_count
from gradaccum.step.compiled import CompileCounter
from gradaccum.step.config import StepResult

__all__ = ["window_step"]

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(module, micro_batch)``: the micro-batch's loss summed over its counted units."""
CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(micro_batch)``: how many units ``loss_fn`` sums over."""


def window_step(
    module: pl.LightningModule,
    window: Sequence[Any],
    loss_fn: LossFn,
    count_fn: CountFn,
    *,
    max_grad_norm: float | None = None,
    step_schedulers: bool = True,
) -> StepResult:
    """One exact optimizer update over ``window`` (the micro-batches of one DataLoader batch).

    Call it from ``training_step`` of a module with ``automatic_optimization = False`` and one
    optimizer. ``max_grad_norm`` clips the accumulated gradient once (not with ``precision="16-mixed"``,
    whose scaler unscales inside Lightning's optimizer step, after any point this could clip).
    ``step_schedulers`` steps every scheduler from ``configure_optimizers`` once per applied update
    (``ReduceLROnPlateau`` excepted: it needs a metric). A window with zero units on every rank, or
    a non-finite loss on any rank, is skipped on every rank (gradients cleared, no step).
    """
    micro_batches = list(window)
    if not micro_batches:
        raise ConfigError("window_step got an empty window: it needs at least one micro-batch")
    trainer = module.trainer
    if module.automatic_optimization:
        raise ConfigError(
            f"window_step runs the whole update itself; {type(module).__name__} has "
            "automatic_optimization=True, so Lightning would step again. Set "
            "self.automatic_optimization = False in its __init__."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with window_step: one "
            "DataLoader batch is one window here; leave accumulate_grad_batches at 1 and make the batch "
            "size micro-batch x accumulation steps."
        )
    optimizer = module.optimizers()
    if isinstance(optimizer, list):
        raise ConfigError(
            f"window_step steps one optimizer; configure_optimizers returned {len(optimizer)}. Return one."
        )
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if max_grad_norm is not None:
        if not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
            raise ConfigError(
                f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}"
            )
        if scaler is not None:
            raise ConfigError(
                f"max_grad_norm={max_grad_norm} with precision={trainer.precision!r}: its GradScaler "
                "unscales the gradients inside Lightning's optimizer step, after the point where "
                "window_step could clip them. Use precision='bf16-mixed' or '32-true', or clip in "
                "on_before_optimizer_step."
            )
    wrapper = trainer.strategy.model  # DDP(module) under strategy="ddp", else the module
    if not isinstance(wrapper, nn.Module):
        raise ConfigError("window_step runs inside training_step, once the Trainer set the model up")
    kind = sync_kind(wrapper)
    if kind not in ("local", "ddp"):
        raise ConfigError(
            f"window_step defers sync for DDP only; the strategy wrapped the module as {kind}. Use "
            "strategy='ddp' (or one device)."
        )
    world = dist.world_size() if kind == "ddp" else 1
    device = module.device

    compiles = CompileCounter()  # StepResult.recompiles: graphs compiled during this window
    # 1. count the whole window before the first backward, and agree on N across the ranks
    counts = [as_count(count_fn(mb), i) for i, mb in enumerate(micro_batches)]
    stacked = torch.stack([torch.as_tensor(c, device=device) for c in counts]).to(torch.float64)
    local = stacked.sum()
    # [N, negative counts] summed over the ranks and read once, so every rank takes the same branch
    meta = torch.stack([local, (stacked < 0).any().to(torch.float64)])
    if world > 1:
        meta = dist.all_reduce_sum_(meta, what="the window's counts")
    global_host, negative = meta.tolist()
    if negative:
        raise CountError(f"count_fn returned a negative count on {int(negative)} rank(s): {counts}")
    total = meta[0]
    local_n, global_n = int(local.item()), int(global_host)
    optimizer.zero_grad(set_to_none=True)
    if global_n == 0:
        reason = "the window holds zero valid units"
        return _skipped(module, local_n, 0, len(micro_batches), None, reason, compiles.since())

    # 2. each micro-batch adds sum_t l_t / N; DDP then averages over W ranks, so scale by W / N
    scale64 = torch.reciprocal(total) * world
    summed = torch.zeros((), dtype=torch.float64, device=device)
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        with sync_deferred(wrapper, kind, enabled=i != last):  # forward and backward inside
            loss = loss_fn(module, mb)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.requires_grad:
                raise LossError(
                    f"loss_fn returned {type(loss).__name__} for micro-batch {i}; it must return a "
                    "scalar that requires grad: the loss summed over the micro-batch's counted units"
                )
            module.manual_backward(loss * scale64.to(loss.dtype))
        summed += loss.detach().to(torch.float64)

    # 3. one decision for every rank, then clip, step and schedule once
    if world > 1:
        summed = dist.all_reduce_sum_(summed, what="the window's loss")
    loss_value = float(summed.item())
    if not math.isfinite(loss_value):
        optimizer.zero_grad(set_to_none=True)
        reason = f"non-finite loss ({loss_value})"
        return _skipped(module, local_n, global_n, len(micro_batches), None, reason, compiles.since())
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), max_grad_norm))
    optimizer.step()
    if step_schedulers:
        _step_schedulers(module)
    return StepResult(
        loss=loss_value / global_n,
        local_count=local_n,
        global_count=global_n,
        micro_batches=len(micro_batches),
        grad_norm=grad_norm,
        applied=True,
        step=int(trainer.global_step),
        recompiles=compiles.since(),
    )


def _step_schedulers(module: pl.LightningModule) -> None:
    schedulers = module.lr_schedulers()
    if schedulers is None:
        return
    for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()


def _skipped(
    module: pl.LightningModule,
    local_n: int,
    global_n: int,
    k: int,
    loss: float | None,
    reason: str,
    recompiles: int,
) -> StepResult:
    return StepResult(
        loss=loss,
        local_count=local_n,
        global_count=global_n,
        micro_batches=k,
        grad_norm=None,
        applied=False,
        skip_reason=reason,
        step=int(module.trainer.global_step),
        recompiles=recompiles,
    )
