"""Gradient caching as the candidate of the equivalence check (``verify --cached``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from gradaccum.cache.accumulator import CachedAccumulator, EncodeFn, RepLossFn
from gradaccum.check.workload import Workload
from gradaccum.errors import WorkloadError
from gradaccum.loss import count_examples
from gradaccum.step.window import CountFn

__all__ = ["CandidateStep", "cached_candidate", "cached_candidate_for"]

CandidateStep = Callable[[nn.Module, torch.optim.Optimizer, list[Any]], None]
"""``candidate_step(model, optimizer, micro_batches)``: one accumulated update, for ``verify``
(the same shape as :data:`gradaccum.check.equivalence.CandidateStep`)."""


def cached_candidate(
    encode_fn: EncodeFn, loss_fn: RepLossFn, *, count_fn: CountFn | None = None
) -> CandidateStep:
    """A ``candidate_step`` for :func:`gradaccum.verify` that updates through a CachedAccumulator.

    ``loss_fn(reps)`` is the objective; with ``count_fn`` it is instead summed over the units
    ``count_fn`` counts (a Workload's convention) and the objective is it divided by the window's
    count. The window is one process's, as in ``verify``.
    """

    def candidate_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Any]) -> None:
        objective = loss_fn
        if count_fn is not None:
            n = sum(int(count_fn(mb)) for mb in micro_batches)

            def objective(reps: Any) -> torch.Tensor:
                return loss_fn(reps) / n

        CachedAccumulator(model, optimizer).step(
            micro_batches, encode_fn, objective, count_fn=count_fn or count_examples
        )

    candidate_step.__qualname__ = f"CachedAccumulator.step({_name(encode_fn)}, {_name(loss_fn)})"
    return candidate_step


def cached_candidate_for(workload: Workload) -> CandidateStep:
    """The cached candidate of a workload whose ``extras`` hold ``encode_fn`` and ``rep_loss_fn``.

    ``rep_loss_fn`` follows the workload's ``loss_fn``: summed over the units ``count_fn`` counts.
    """
    missing = [key for key in ("encode_fn", "rep_loss_fn") if not callable(workload.extras.get(key))]
    if missing:
        raise WorkloadError(
            f"workload {workload.name!r} cannot run through a gradient cache: its extras lack "
            f"{' and '.join(missing)}. Add extras={{'encode_fn': encode_fn(model, micro_batch) -> reps, "
            "'rep_loss_fn': rep_loss_fn(reps) -> loss summed over the counted units}."
        )
    return cached_candidate(
        workload.extras["encode_fn"], workload.extras["rep_loss_fn"], count_fn=workload.count_fn
    )


def _name(fn: object) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)
