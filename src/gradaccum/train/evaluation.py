"""Evaluation inside a run: no grad, eval mode, and no trace left on the training state."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from gradaccum.check.workload import Workload
from gradaccum.distributed import dist
from gradaccum.step.accumulator import CountFn, LossFn

__all__ = ["evaluate", "held_out_summary"]


def evaluate(
    model: nn.Module,
    micro_batches: list[Any],
    loss_fn: LossFn,
    count_fn: CountFn,
    *,
    device: torch.device,
) -> tuple[float | None, int]:
    """Mean loss per valid unit over every rank's ``micro_batches``, and that unit count.

    Leaves training state untouched: accumulated ``.grad`` (nothing is backpropagated), the
    train/eval mode (restored), and the RNG streams (forked), so evaluating mid-run changes
    neither the current window nor any later one. A DDP model is evaluated through its inner
    module (identical replicas, no collectives per forward); FSDP2 needs its wrapper, so every rank
    must pass the same number of micro-batches. Collective: one all-reduce of (loss sum, count).
    """
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    was_training = model.training
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    forked = [device] if device.type == "cuda" else []
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=forked, device_type=device.type):
            for micro_batch in micro_batches:
                totals[0] += loss_fn(inner, micro_batch).detach().to(torch.float64)
                totals[1] += torch.as_tensor(count_fn(micro_batch), device=device).to(torch.float64)
    finally:
        model.train(was_training)
    loss_sum, count = dist.all_reduce_sum_(totals).tolist()
    return (loss_sum / count if count else None), int(count)


def held_out_summary(workload: Workload) -> dict[str, Any]:
    """The rows a workload holds out of training for evaluation, when it says (an ``hf:``
    workload's ``extras``: ``train_rows`` and ``held_out_rows``), with one line in words
    (``summary``); empty for a workload that makes its own batches. A held-out loss is only worth
    reading if the run says that its rows were never trained on, and how many there are."""
    held, trained = workload.extras.get("held_out_rows"), workload.extras.get("train_rows")
    if not isinstance(held, int) or not isinstance(trained, int):
        return {}
    rows = held + trained
    if held:
        words = f"evaluation: {held:,} held-out rows of {rows:,}, never trained on"
    else:
        words = f"evaluation: none held out, {rows:,} rows are too few to split (evaluation is refused)"
    return {"held_out_rows": held, "rows": rows, "summary": words}
