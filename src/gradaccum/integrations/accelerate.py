"""Exact accumulation with Hugging Face Accelerate: an ``Accumulator`` over ``accelerator.prepare``'s objects.

Accelerate's ``accumulate()`` divides every micro-batch's loss by a fixed k, and the exact recipe in
its documentation is a hand-written loop (prefetch the window, gather the counts, ``no_sync`` by
hand). With gradaccum the loop is

    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    acc = prepare_accumulator(accelerator, model, optimizer, scheduler, config=AccumConfig(max_grad_norm=1.0))
    for window in gradaccum.windows(loader, accum_steps=8):
        result = acc.step(window, loss_fn, count_fn)   # summed loss, count of its units

What the prepared objects need, and get here:

* the model: the DDP (or FSDP) module ``prepare`` returns is what the step forwards through and
  defers sync on; Accelerate's mixed precision (``autocast`` patched into its ``forward``) applies;
* the optimizer: ``AcceleratedOptimizer`` steps through Accelerate's GradScaler itself, so the step
  is given the optimizer it wraps and ``accelerator.scaler``: the loss is scaled once per
  micro-batch, unscaled once before clipping, and the scaler steps and updates once per window;
* the scheduler: ``AcceleratedScheduler`` steps the scheduler it wraps ``num_processes`` times per
  update (unless ``split_batches``), so a schedule in updates advances W times too fast (Accelerate
  #2926); the step is given the wrapped scheduler and advances it exactly once per applied update,
  on every rank. Build the schedule in optimizer updates.

A plain ``Accumulator`` given an ``AcceleratedScheduler`` would step it, and so the scheduler it
wraps W times per update: :func:`~gradaccum.step.objects.refuse_accelerated_scheduler` (exported
here too) refuses that when any accumulator is built, naming ``prepare_accumulator``. It finds the
class through ``sys.modules`` (a scheduler of that class means accelerate is imported already), so
the step never imports accelerate; this module imports it only inside the functions that need it.

``accelerator.optimizer_step_was_skipped`` is not updated (the step's ``StepResult.applied`` says
whether it stepped). DeepSpeed and Megatron-LM own backward and step, and XLA its own reduction:
those are refused, as is ``Accelerator(gradient_accumulation_steps>1)``, which would divide again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from gradaccum.errors import ConfigError
from gradaccum.step.config import AccumConfig, StepResult
from gradaccum.step.objects import refuse_accelerated_scheduler

if TYPE_CHECKING:
    from accelerate import Accelerator

    from gradaccum.step.accumulator import Accumulator

__all__ = ["prepare_accumulator", "refuse_accelerated_scheduler", "unwrap_optimizer", "unwrap_scheduler"]

_REFUSED = {
    "DEEPSPEED": "DeepSpeed's engine runs backward, loss scaling and the step itself",
    "MEGATRON_LM": "Megatron-LM runs backward and the step itself",
    "XLA": "XLA reduces gradients inside the optimizer step, not in backward",
}


def prepare_accumulator(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    config: AccumConfig | None = None,
    dp_group: Any = None,
    on_step: Sequence[Callable[[StepResult], None]] = (),
) -> Accumulator:
    """An :class:`~gradaccum.Accumulator` over objects ``accelerator.prepare`` returned.

    ``model`` is the prepared model; ``optimizer`` and ``scheduler`` may be the prepared wrappers
    or what they wrap. Settings are one :class:`~gradaccum.AccumConfig` (default: no clipping).
    """
    from accelerate import Accelerator

    from gradaccum.step.accumulator import Accumulator

    if not isinstance(accelerator, Accelerator):
        raise ConfigError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    reason = _REFUSED.get(accelerator.distributed_type.name)
    if reason is not None:
        raise ConfigError(
            f"prepare_accumulator does not run with distributed_type={accelerator.distributed_type.value}: "
            f"{reason}, where the exact weights cannot be set. Use DDP (MULTI_GPU/MULTI_CPU) or FSDP."
        )
    steps = accelerator.gradient_accumulation_steps
    if steps != 1:
        raise ConfigError(
            f"the Accelerator was built with gradient_accumulation_steps={steps}; its backward would "
            "divide every loss by it and its optimizer would skip steps, on top of gradaccum's own "
            "accumulation. Build it with gradient_accumulation_steps=1 and pass windows of "
            f"{steps} micro-batches to Accumulator.step instead."
        )
    return Accumulator(
        model,
        unwrap_optimizer(optimizer),
        unwrap_scheduler(scheduler),
        scaler=accelerator.scaler,
        config=config or AccumConfig(),
        dp_group=dp_group,
        on_step=on_step,
    )


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer an ``AcceleratedOptimizer`` wraps (its public ``optimizer``); others as given."""
    from accelerate.optimizer import AcceleratedOptimizer

    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def unwrap_scheduler(scheduler: Any) -> Any:
    """The scheduler an ``AcceleratedScheduler`` wraps (its public ``scheduler``); others as given."""
    from accelerate.scheduler import AcceleratedScheduler

    return scheduler.scheduler if isinstance(scheduler, AcceleratedScheduler) else scheduler
