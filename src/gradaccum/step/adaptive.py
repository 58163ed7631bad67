"""Out-of-memory retry: the same examples again, in smaller micro-batches, on every rank together.

Exact accumulation does not depend on how a window is cut, so a window that ran out of memory
can be re-run at a smaller micro-batch with the same global batch and the same result. What makes
that safe under data parallelism is agreement: an OOM on one rank is reported at the window's
agreement point (see :mod:`gradaccum.step.agreement`), every rank discards the partial window and raises
:class:`~gradaccum.step.agreement.WindowOutOfMemoryError`, and every rank halves and retries (Composer's
all-reduced OOM flag, without its per-module hooks). The retry restores the random generators to
where the failed attempt began, so dropout draws what an uninterrupted run would.

Limits: an OOM inside the *synchronizing* backward under DDP comes after the agreement; that rank
raises ``torch.OutOfMemoryError`` and the others fail at the process-group timeout. Under FSDP the
forwards communicate, so only a single process, or DDP, retries.

Both scalings retry alike: with ``scaling="post"`` a failed attempt leaves neither gradients nor
its count behind (the constant the next window takes from this one's N is set only by a window that
finished), so the retry gives the update pre-scaling gives (tests/faults/test_oom.py).
"""

from __future__ import annotations

from typing import Any

import torch

from gradaccum.batch import Batch, batch_size, split
from gradaccum.distributed import dist
from gradaccum.errors import PlanError, WindowOutOfMemoryError
from gradaccum.rng import capture_rng, restore_rng
from gradaccum.step.accumulator import Accumulator, CountFn, LossFn
from gradaccum.step.config import StepResult
from gradaccum.values import require_int

__all__ = ["AdaptiveMicroBatch", "step_adaptive"]


def _positive(name: str, value: object) -> int:
    return require_int(name, value, error=PlanError)


def _sizes(total: int, micro_batch: int) -> list[int]:
    """Micro-batches of ``micro_batch`` examples and, if it does not divide, one shorter last one."""
    full, rest = divmod(total, micro_batch)
    return [micro_batch] * full + ([rest] if rest else [])


def step_adaptive(
    acc: Accumulator,
    local_batch: Batch,
    micro_batch: int,
    loss_fn: LossFn,
    count_fn: CountFn,
    *,
    min_micro_batch: int = 1,
) -> tuple[StepResult, int]:
    """One exact optimizer step over ``local_batch``, cut into micro-batches of ``micro_batch``.

    On an out-of-memory error anywhere in the window, on any rank, every rank halves its
    micro-batch (not below ``min_micro_batch``) and runs the same examples again; the final update
    equals an uninterrupted run at the micro-batch that fit. Returns the step's result and that
    micro-batch. Raises :class:`WindowOutOfMemoryError` on every rank when even
    ``min_micro_batch`` does not fit.
    """
    _check_drivable(acc)
    size = _positive("micro_batch", micro_batch)
    floor = _positive("min_micro_batch", min_micro_batch)
    if floor > size:
        raise PlanError(f"min_micro_batch={floor} is larger than micro_batch={size}")
    total = batch_size(local_batch)
    rng = capture_rng()
    while True:
        window = split(local_batch, sizes=_sizes(total, size)) if total else []
        try:
            return acc.step(window, loss_fn, count_fn), size
        except WindowOutOfMemoryError as exc:
            # every rank is here together; give up on all of them if any one cannot shrink further
            at_floor = torch.tensor([float(size <= floor)], dtype=torch.float64, device=acc.device)
            if dist.all_reduce_sum_(at_floor, acc.dp_group, what="whether each rank can shrink").item():
                raise WindowOutOfMemoryError(
                    f"{exc} Even micro_batch={size} (min_micro_batch={floor}) on this rank, or the "
                    "smallest allowed on another, does not fit; reduce memory another way "
                    "(activation checkpointing, sharding, a shorter sequence).",
                    exc.failures,
                ) from None
        # outside the except block: the failed attempt's traceback, and with it its activations,
        # are released before the retry allocates again
        _release_cached_memory(acc)
        restore_rng(rng)
        size = max(floor, size // 2)


def _check_drivable(acc: object) -> None:
    """Only :class:`Accumulator` steps with ``(window, loss_fn, count_fn)``; refuse anything else."""
    if isinstance(acc, Accumulator):
        return
    from gradaccum.cache.accumulator import CachedAccumulator

    if isinstance(acc, CachedAccumulator):
        raise TypeError(
            "step_adaptive and AdaptiveMicroBatch drive Accumulator.step(window, loss_fn, count_fn); a "
            "CachedAccumulator steps with (window, encode_fn, loss_fn) instead and holds only one "
            "micro-batch's activations at a time already. Retry its window yourself on "
            "WindowOutOfMemoryError (every rank raises it together): split the same examples into "
            "smaller micro-batches and call CachedAccumulator.step again; the objective is the same."
        )
    raise TypeError(f"step_adaptive needs a gradaccum.Accumulator, got {type(acc).__name__}")


def _release_cached_memory(acc: Accumulator) -> None:
    if acc.device.type == "cuda":
        torch.cuda.empty_cache()


class AdaptiveMicroBatch:
    """:func:`step_adaptive` that remembers the micro-batch that fit, for the steps after it.

    >>> adaptive = AdaptiveMicroBatch(acc, micro_batch=8)
    >>> result = adaptive.step(local_batch, loss_fn, count_fn)   # adaptive.micro_batch may now be 4
    """

    def __init__(self, acc: Accumulator, micro_batch: int, *, min_micro_batch: int = 1) -> None:
        _check_drivable(acc)
        self.acc = acc
        self.micro_batch = _positive("micro_batch", micro_batch)
        """The micro-batch the next step starts from: the last one that fit."""
        self.min_micro_batch = _positive("min_micro_batch", min_micro_batch)
        self.reductions: list[tuple[int, int, int]] = []
        """(optimizer step, micro-batch before, micro-batch after) for every step that had to shrink."""

    def step(self, local_batch: Any, loss_fn: LossFn, count_fn: CountFn) -> StepResult:
        before = self.micro_batch
        result, used = step_adaptive(
            self.acc, local_batch, before, loss_fn, count_fn, min_micro_batch=self.min_micro_batch
        )
        if used != before:
            self.reductions.append((result.step, before, used))
            self.micro_batch = used
        return result
