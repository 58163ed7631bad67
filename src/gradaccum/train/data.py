"""The training data stream: deterministic global batches, sharded contiguously across ranks.

Window ``w`` (the micro-batches of the ``w``-th optimizer boundary) is the global batch
``make_batch(global_batch, train_seed(seed, w))``. Rank ``r`` of ``dp`` takes its contiguous
``local_batch = micro_batch x accum_steps`` examples ``[r * local_batch, (r + 1) * local_batch)`` and
cuts them into ``accum_steps`` consecutive micro-batches. So:

* one process and ``dp`` processes at the same global batch see the same examples in every window,
  which is what makes their parameters equal;
* the data position is just ``(window, micro-batch)``; checkpoints are taken at boundaries, so it
  is ``(window, 0)``, and a resumed run draws exactly the next unseen window, with no sampler state
  and nothing to fast-forward;
* every rank can count the whole window's valid units locally (``count_fn`` of the global batch),
  which the tokens clock needs before the update, without an extra collective.

With a token budget (``max_tokens``) rank ``r`` instead takes its micro-batches of
:func:`gradaccum.split_by_tokens` of the global batch: rows sorted by length, cut within the budget
and balanced across ranks, the same on every rank, so the data position is still the window.

Each rank draws the whole global batch and keeps its shard: for workloads whose ``make_batch`` is
expensive, build a workload whose batches are cheap index lists and load inside ``loss_fn``.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import torch

from gradaccum.batch import Batch, batch_size, cast, split, take, to_device
from gradaccum.errors import PlanError
from gradaccum.plan import BatchPlan
from gradaccum.step.accumulator import CountFn
from gradaccum.tokens.cost import CostFn
from gradaccum.tokens.split import plan_batch, split_by_tokens
from gradaccum.train.config import TrainError

__all__ = [
    "SEED_SPACE",
    "DataPosition",
    "ShardedStream",
    "Window",
    "eval_seed",
    "shard_bounds",
    "train_seed",
]

SEED_SPACE = 2**32 - 1
"""Data seeds lie in ``[1, 2**32 - 1]``: torch's CPU generator (``torch.Generator().manual_seed``)
keeps only the low 32 bits of a seed and NumPy's legacy seeding refuses more, so a stream laid out
above bit 32 (an earlier ``seed * 2**32 + 1 + w``) gave every run seed the same examples."""
_SEED_MIX = 0x9E3779B9
"""Odd (2**32 / golden ratio): run seeds' streams start far apart on the 32-bit circle, seed 0 at 0.
For run seeds 0..1000 every training and evaluation stream starts at least 1.5 million seeds from
every other, so runs shorter than that never share a batch."""
_EVAL_OFFSET = 2**31 - 1


def _stream(seed: int) -> int:
    return (seed * _SEED_MIX) % SEED_SPACE


def train_seed(seed: int, window: int) -> int:
    """The ``make_batch`` seed of training window ``window``: ``1 + window`` for run seed 0, never 0
    (the verification seed); distinct windows of one run never share a seed (below 2**31 windows)."""
    return (_stream(seed) + window) % SEED_SPACE + 1


def eval_seed(seed: int, index: int) -> int:
    """The ``make_batch`` seed of evaluation batch ``index``: disjoint from the run's training windows
    (half the 32-bit circle away; ``2**31 + index`` for run seed 0)."""
    return (_stream(seed) + _EVAL_OFFSET + index) % SEED_SPACE + 1


def shard_bounds(plan: BatchPlan, rank: int) -> tuple[int, int]:
    """Examples ``[start, stop)`` of each global batch that data-parallel rank ``rank`` trains on."""
    if not 0 <= rank < plan.dp:
        raise TrainError(f"rank {rank} is outside the plan's dp={plan.dp} data-parallel ranks")
    return rank * plan.local_batch, (rank + 1) * plan.local_batch


@dataclass(frozen=True, kw_only=True, slots=True)
class DataPosition:
    """Where the stream stands: the next window to draw and the next micro-batch within it."""

    window: int
    """Windows fully consumed (applied or skipped); the next one drawn has this index."""
    micro_batch: int = 0
    """Micro-batches of that window already consumed; 0 at every optimizer boundary."""

    def to_dict(self) -> dict[str, int]:
        return {"window": self.window, "micro_batch": self.micro_batch}


@dataclass(frozen=True, kw_only=True, slots=True)
class Window:
    """One optimizer boundary's data on this rank."""

    index: int
    """The window's index in the stream."""
    micro_batches: list[Batch]
    """This rank's ``accum_steps`` micro-batches, on the training device."""
    global_count: int
    """Valid units in the whole global batch (all ranks): the window's N."""
    all_micro_batches: int | None = None
    """With a token budget: the window's micro-batches over every rank (they follow the lengths)."""
    computed_tokens: int | None = None
    """With a token budget: the token positions every rank's micro-batches compute (rows x longest
    row each, once trimmed), padding included."""
    present_tokens: int | None = None
    """With a token budget: the tokens of the window's rows (``attention_mask`` ones): what of
    ``computed_tokens`` is not padding."""


@dataclass(eq=False)
class ShardedStream:
    """Draws windows for one rank; stateless, so any window can be drawn in any order."""

    make_batch: Any
    """The workload's ``make_batch(n_examples, seed)``; window ``w`` draws ``train_seed(seed, w)``."""
    count_fn: CountFn
    """Valid units of a batch: of the whole global batch, the window's N."""
    plan: BatchPlan
    """The run's plan (a batch-size schedule hands each window its own)."""
    _: KW_ONLY
    rank: int
    """This process's data-parallel rank: which contiguous shard of each global batch it trains on."""
    seed: int
    """The run's data seed."""
    device: torch.device
    """Where the micro-batches are moved."""
    float_dtype: torch.dtype | None = None
    """Floating tensors are cast to it; ``None``: as drawn."""
    max_tokens: int | None = None
    """Token budget per micro-batch (:func:`gradaccum.split_by_tokens`); ``None``: fixed micro-batches."""
    equal_count: bool = False
    """With ``max_tokens``: the same number of micro-batches on every rank."""
    cost: CostFn | None = None
    """With ``max_tokens``: balance the ranks by this compute cost instead of valid tokens."""
    start: int = field(init=False)
    """First example of each global batch that this rank trains on (``shard_bounds``)."""
    stop: int = field(init=False)
    """One past this rank's last example."""

    def __post_init__(self) -> None:
        self.start, self.stop = shard_bounds(self.plan, self.rank)

    def window(self, index: int, plan: BatchPlan | None = None) -> Window:
        """Window ``index``: this rank's micro-batches and the global batch's valid count.

        ``plan``: this window's plan when the global batch changes during the run (a batch-size
        schedule); the stream's own plan otherwise. Window ``index`` is then the first
        ``plan.global_batch`` examples of its seed, so it depends on the plan as well as the index.
        """
        plan = self.plan if plan is None else plan
        start, stop = (self.start, self.stop) if plan == self.plan else shard_bounds(plan, self.rank)
        full = self.make_batch(plan.global_batch, train_seed(self.seed, index))
        drawn = batch_size(full)
        if drawn != plan.global_batch:
            raise TrainError(
                f"make_batch({plan.global_batch}, seed) returned {drawn} examples; the workload "
                "must return exactly the number of examples asked for"
            )
        global_count = int(torch.as_tensor(self.count_fn(full)))
        if self.max_tokens is not None:
            parts = self._by_tokens(full, index, self.max_tokens)
            # every rank's cut, as split_by_tokens made it (deterministic): what the window computes
            cut = plan_batch(
                full, self.max_tokens, world=self.plan.dp, equal_count=self.equal_count, cost=self.cost
            )
            return Window(
                index=index,
                micro_batches=parts,
                global_count=global_count,
                all_micro_batches=cut.micro_batches,
                computed_tokens=sum(cut.rank_computed_tokens),
                present_tokens=sum(cut.valid),
            )
        local = self._prepare(take(full, start, stop))
        return Window(
            index=index,
            micro_batches=split(local, micro_batch=plan.micro_batch),
            global_count=global_count,
        )

    def _by_tokens(self, full: Batch, index: int, max_tokens: int) -> list[Batch]:
        """This rank's micro-batches of the global batch by the token budget (every rank cuts the
        same batch the same way, so the rows are dealt once, with no collective)."""
        try:
            parts = split_by_tokens(
                full,
                max_tokens,
                rank=self.rank,
                world=self.plan.dp,
                equal_count=self.equal_count,
                cost=self.cost,
            )
        except PlanError as exc:
            raise PlanError(f"--max-tokens {max_tokens} cannot cut window {index}: {exc}") from exc
        return [self._prepare(part) for part in parts]

    def eval_batches(self, examples: int) -> list[Batch]:
        """This rank's share of the held-out batch, cut into micro-batches: from
        ``make_batch.held_out(n, seed)`` when the workload's ``make_batch`` has one (rows it never
        trains on), else ``make_batch`` with an evaluation seed (fresh examples for generated data).

        ``examples`` is rounded up to a multiple of ``dp`` so that every rank runs the same number
        of forwards (FSDP2 gathers parameters in each one; unequal counts would hang).
        """
        per_rank = -(-examples // self.plan.dp)
        # a workload that holds rows out (hf: files) draws the evaluation from them alone
        draw = getattr(self.make_batch, "held_out", self.make_batch)
        full = draw(per_rank * self.plan.dp, eval_seed(self.seed, 0))
        local = self._prepare(take(full, self.rank * per_rank, (self.rank + 1) * per_rank))
        step = self.plan.micro_batch
        return [take(local, i, min(i + step, per_rank)) for i in range(0, per_rank, step)]

    def _prepare(self, batch: Batch) -> Batch:
        batch = to_device(batch, self.device)
        return cast(batch, self.float_dtype) if self.float_dtype is not None else batch
