"""The objects a step is handed, checked once when its engine is built.

A wrong object here (a scheduler that steps W times per update, a DDP that cannot defer sync, a
model that nothing averages across ranks) would not fail: it would train on a different batch than
the one planned. So each is refused before the first window, with the fix in the message.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError, SyncError
from gradaccum.step.config import AccumConfig

__all__ = ["check_objects", "refuse_accelerated_scheduler", "refuse_static_graph", "refuse_unwrapped"]


def check_objects(model: Any, optimizer: Any, config: Any, scheduler: Any, *, external: bool = False) -> None:
    """The types an engine needs, and no scheduler that would step too often. ``external``: an
    external step (:mod:`gradaccum.step.external`) takes the update, so ``optimizer`` may be its
    own (DeepSpeed's ZeRO optimizers are no ``torch.optim.Optimizer``)."""
    if not isinstance(config, AccumConfig):
        raise ConfigError(f"config must be a gradaccum.AccumConfig, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not external and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    refuse_accelerated_scheduler(scheduler)


def refuse_accelerated_scheduler(scheduler: Any) -> None:
    """Refuse Accelerate's ``AcceleratedScheduler`` handed to an accumulator directly.

    It steps the scheduler it wraps once per process per update (6 steps in 3 updates on 2 ranks),
    where the step advances a schedule once per update. No accelerate import: the class is looked
    up in ``sys.modules``, where it is whenever such a scheduler exists.
    """
    module = sys.modules.get("accelerate.scheduler")
    wrapper = getattr(module, "AcceleratedScheduler", None)
    if isinstance(wrapper, type) and isinstance(scheduler, wrapper):
        inner = type(getattr(scheduler, "scheduler", None)).__name__
        raise ConfigError(
            f"scheduler is Accelerate's AcceleratedScheduler (wrapping {inner}), which steps the scheduler "
            "it wraps once per process on every update, so the schedule would advance num_processes times "
            "too fast. Build the accumulator with gradaccum.integrations.accelerate.prepare_accumulator("
            "accelerator, model, optimizer, scheduler), which unwraps it (and the optimizer, and takes "
            "Accelerate's scaler), "
            "or pass the scheduler it wraps: scheduler=scheduler.scheduler"
        )


def refuse_static_graph(model: nn.Module, kind: str, defer_sync: bool) -> None:
    """DDP built with ``static_graph=True`` cannot defer sync: refuse it before the first window.

    Its reducer records the first iteration's hooks and expects every later backward to fire
    them all; a backward inside ``no_sync`` then trips an internal assert in PyTorch's reducer
    (``expect_autograd_hooks_``) on torch 2.4-2.13, for a hand-written ``no_sync`` loop too.
    """
    if defer_sync and kind == "ddp" and bool(getattr(model, "static_graph", False)):
        raise SyncError(
            "DistributedDataParallel was built with static_graph=True, and PyTorch's reducer cannot "
            "defer gradient sync in that mode: a backward inside no_sync() fails with an internal "
            "assert (expect_autograd_hooks_). Either build DDP without static_graph (the usual "
            "default; find_unused_parameters=True covers parameters that only some micro-batches "
            "use), or build the accumulator with defer_sync=False, which all-reduces the gradients "
            "on every micro-batch (k all-reduces per update instead of one)."
        )


def refuse_unwrapped(model: nn.Module, kind: str, data_ranks: int) -> None:
    """Several data ranks and a plain module: nothing would ever average their gradients."""
    if data_ranks > 1 and kind == "local":
        raise SyncError(
            f"the data-parallel group has {data_ranks} ranks but the model is a plain "
            f"{type(model).__name__}: its gradients would never be averaged across ranks. Wrap it "
            "in DistributedDataParallel or fully_shard (FSDP2) before building the Accumulator."
        )
