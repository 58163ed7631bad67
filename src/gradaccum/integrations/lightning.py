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
drives the same window engine as :class:`gradaccum.Accumulator`, with
``LightningModule.manual_backward`` as its backward (so precision plugins and backward hooks run):
every micro-batch counted before the first backward and the counts summed over the ranks, each
micro-batch's summed loss times W/N backpropagated with DDP sync deferred to the last one, the rank
agreement, the finiteness check of the loss and the gradients (a window skipped on every rank), then
clipping, the optimizer and the schedulers once.

**Fabric.** ``fabric.setup(model, optimizer)`` returns a ``_FabricModule`` and a ``_FabricOptimizer``;
``gradaccum.Accumulator(model, optimizer)`` takes them as they are: the step forwards through
Fabric's wrapper (its autocast and input casting) and defers sync on the DDP inside it
(:func:`gradaccum.distributed.sync.sync_module`), and ``optimizer.step()`` goes through Fabric's
strategy. Fabric precisions whose plugin must run the backward itself (``"16-mixed"``,
``"bf16-mixed"``: Fabric's wrapper then refuses a plain ``backward()``) need ``fabric.backward``,
which the step does not call; full and ``-true`` precisions work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn

from gradaccum.distributed.sync import sync_kind
from gradaccum.errors import ConfigError
from gradaccum.step.accumulator import Accumulator
from gradaccum.step.config import AccumConfig, StepResult

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
    if max_grad_norm is not None and scaler is not None:
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
    accumulator = _accumulator(module, wrapper, optimizer, max_grad_norm, step_schedulers)
    result = accumulator.step(micro_batches, lambda _wrapper, mb: loss_fn(module, mb), count_fn)
    return dataclasses.replace(result, step=int(trainer.global_step))


def _accumulator(
    module: pl.LightningModule,
    wrapper: nn.Module,
    optimizer: Any,
    max_grad_norm: float | None,
    step_schedulers: bool,
) -> Accumulator:
    """The module's Accumulator for this strategy's wrapper and optimizer, built once.

    It is the engine every front end drives, with Lightning's ``manual_backward`` as its backward
    (precision plugins and backward hooks run, and under DDP it prepares the reducer itself, since
    ``training_step`` runs inside DDP's forward) and the optimizer Lightning handed out, whose
    ``step`` advances ``trainer.global_step``. So the window gets the rank agreement, the
    finiteness check of loss *and* gradients, and the skip on every rank of every other front end.
    """
    key = (id(wrapper), id(optimizer), max_grad_norm, step_schedulers)
    cached = module.__dict__.get(_CACHE)
    if cached is not None and cached[0] == key:
        return cached[1]
    hooks = [lambda _result: _step_schedulers(module)] if step_schedulers else []
    accumulator = Accumulator(
        wrapper,
        optimizer,
        config=AccumConfig(max_grad_norm=max_grad_norm),
        on_step=hooks,
        backward=module.manual_backward,
    )
    module.__dict__[_CACHE] = (key, accumulator)
    return accumulator


_CACHE = "_gradaccum_accumulator"
"""Where a module keeps its Accumulator between windows (outside nn.Module's attribute hooks)."""


def _step_schedulers(module: pl.LightningModule) -> None:
    schedulers = module.lr_schedulers()
    if schedulers is None:
        return
    for scheduler in schedulers if isinstance(schedulers, list) else [schedulers]:
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
