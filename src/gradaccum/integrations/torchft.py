"""Exact accumulation across torchft replica groups that come and go: ``FaultTolerantAccumulator``.

torchft (``pip install gradaccum[torchft]``) keeps a job training while replica groups die and
return: a lighthouse forms a quorum of the live groups each step, a ``Manager`` all-reduces over
that quorum, ``should_commit`` says whether the step's collectives all succeeded, and a group that
returns heals from a live peer's state (sent over HTTP at the quorum, no disk). What torchft alone
does with the data is lossy: each group trains on its own shard, so a step taken while a group is
down averages fewer examples (its ``DistributedSampler`` says a down group's examples "will never
be used"), and a step whose collective failed is simply dropped.

This module keeps the *global* batch of every applied update whole. Each try of optimizer step s:

1. ``manager.start_quorum()``; the participants are the quorum's W groups, this one has rank r;
2. one small all-reduce (``SUM``, rows + 1 float64 values) of the rows of ``global_batch(s)`` (the
   same rows on every group) that each group already holds from a broken try of s, and their
   count: all zeros on a step's first try;
3. the rows no one holds are cut into W contiguous shares, share r into micro-batches of at most
   ``micro_batch`` rows; N, the whole batch's count, is the held rows' count plus every free row's
   count, which each group counts itself (it has the whole batch), so N is the same everywhere;
4. each micro-batch backpropagates its summed loss / N into ``p.grad``, which then holds this
   group's rows' part of ``grad(sum_t l_t) / N``; the gradients are summed (not averaged: torchft's
   default ``AVG`` would divide by W again) over the quorum into flat copies, so that ``p.grad``
   keeps this group's part alone until the commit;
5. ``manager.should_commit()``: when every collective of the try succeeded, the sums go into
   ``p.grad``, then clip and step the optimizer (and the schedule) once. When the quorum changed
   under the try (a group died during it), nothing is applied and s is tried again over the new
   quorum: the survivors keep what they accumulated (step 2 tells everyone which rows those are)
   and only the lost group's rows are re-split among the new quorum. A group that healed, or
   holdings that overlap, start the step afresh. An update is applied only over the whole batch.

So the trajectory is that of one process taking the whole global batch each step, up to float
regrouping (<= 1e-10 in float64 here), whatever groups come and go; a returning group heals from a
peer (the model, optimizer and schedule states, registered with the Manager under ``"gradaccum"``)
and goes on from the peer's step. A global batch with fewer rows than participants leaves some
shares empty, which is exact too (those groups count 0).

The Manager is the caller's (its process group, lighthouse, timeouts, ``min_replica_size``); build it
without state-dict functions (``load_state_dict=None, state_dict=None``), as this class registers
its own. One process per replica group (``torchrun --nproc_per_node 1`` per group, or any process
with the Manager's store): the groups' own intra-group parallelism (DDP/FSDP inside a group) is not
composed here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed import ReduceOp

from gradaccum.batch import Batch, batch_size, select, split, take
from gradaccum.errors import ConfigError, SyncError
from gradaccum.step.checks import as_count, check_loss
from gradaccum.step.config import StepResult
from gradaccum.step.window import ZERO_COUNT

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["FaultTolerantAccumulator", "share_bounds"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch)``: the loss summed over the micro-batch's counted units."""
CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(micro_batch)``: how many units ``loss_fn`` sums over."""
GlobalBatch = Callable[[int], Batch]
"""``global_batch(step)``: step ``step``'s whole global batch, the same rows on every group."""

STATE_KEY = "gradaccum"
"""The key this class registers its state-dict functions under in the Manager."""


def share_bounds(rows: int, participants: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row global batch that participant ``rank`` of
    ``participants`` takes: contiguous shares whose sizes differ by at most one."""
    if participants < 1 or not 0 <= rank < participants:
        raise ConfigError(f"participant rank {rank} of {participants}: need 0 <= rank < participants >= 1")
    return rank * rows // participants, (rank + 1) * rows // participants


class FaultTolerantAccumulator:
    """One exact optimizer step over the global batch, shared among a torchft quorum.

    >>> manager = torchft.Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None,
    ...                           min_replica_size=1, use_async_quorum=False, ...)
    >>> acc = FaultTolerantAccumulator(model, optimizer, manager, micro_batch=4)
    >>> while acc.current_step < steps:
    ...     result = acc.step(lambda s: batches[s], loss_fn, count_fn)

    ``step`` returns once an update over the whole global batch is applied, or skipped alike on every
    group (the global batch counted zero units, or its summed loss or gradient is not finite: every
    group holds the same sums, so no collective decides it); a step the quorum changed under is done again,
    at most ``max_attempts`` times in all, then a :class:`SyncError`. ``global_batch`` is a function
    of the step index because a group that heals mid-run jumps to its peer's step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        manager: Manager,
        *,
        micro_batch: int,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        max_attempts: int = 10,
    ) -> None:
        if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
            raise ConfigError(f"micro_batch={micro_batch!r}: the rows per micro-batch must be an int >= 1")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts={max_attempts!r}: the tries per step must be an int >= 1")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(
                f"max_grad_norm={max_grad_norm!r}: clip to a positive norm, or None for no clipping"
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ConfigError(
                "model is wrapped in DistributedDataParallel: FaultTolerantAccumulator sums the gradients "
                "over the replica groups itself (one process per group); pass the bare module"
            )
        self.model, self.optimizer, self.manager = model, optimizer, manager
        self.micro_batch, self.scheduler = micro_batch, scheduler
        self.max_grad_norm, self.max_attempts = max_grad_norm, max_attempts
        self.participants = 0
        """W of the last step applied (or skipped): the groups whose shares made its global batch."""
        self.attempts = 0
        """How many tries the last step took (1 when its quorum held)."""
        self._held: _Held | None = None
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    @property
    def current_step(self) -> int:
        """Updates committed so far, by the Manager's count (a healed group takes its peer's)."""
        return int(self.manager.current_step())

    def state_dict(self) -> dict[str, Any]:
        """What a healing peer receives: the model, optimizer and schedule states."""
        state: dict[str, Any] = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a live peer's state (torchft calls this when this group heals)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def step(self, global_batch: GlobalBatch, loss_fn: LossFn, count_fn: CountFn) -> StepResult:
        """Apply one update over ``global_batch(step)``, trying the step again while its quorum changes."""
        for attempt in range(1, self.max_attempts + 1):
            self.attempts = attempt
            result = self._attempt(global_batch, loss_fn, count_fn)
            if result is not None:
                return result
        raise SyncError(
            f"step {self.current_step}: the quorum changed under each of max_attempts={self.max_attempts} "
            "tries, so no update over the whole global batch was applied; check the replica groups' logs "
            "and the lighthouse, or raise max_attempts"
        )

    def _drop(self) -> None:
        """Forget what this group holds of a step: its gradients and its rows."""
        self.optimizer.zero_grad(set_to_none=True)
        self._held = None

    def _attempt(self, global_batch: GlobalBatch, loss_fn: LossFn, count_fn: CountFn) -> StepResult | None:
        """One try of the step; ``None`` when it must be tried again over a new quorum."""
        manager = self.manager
        manager.start_quorum()
        participants, rank = manager.num_participants(), manager.participating_rank()
        if rank is not None and not manager.is_participating():
            # async quorum: a healing group counts in W but its sums are zeroed, so a share is lost
            raise ConfigError(
                "the torchft Manager heals this replica group during the step (use_async_quorum=True): "
                "the quorum counts it among the participants while torchft zeroes its part of every "
                "sum, so its share of the global batch would be lost. Build the Manager with "
                "use_async_quorum=False (the group then heals before the forward and takes its share)"
            )
        step = self.current_step  # after the quorum: a healed group is at its peer's step
        batch = global_batch(step)
        rows = batch_size(batch)
        if rows < 1:
            raise ConfigError(f"global_batch returned a batch of {rows} rows at step {step}")
        held = self._held
        if held is None or held.step != step or held.rows.numel() != rows:
            self._drop()  # a new step, or one this group no longer takes (it healed): start afresh
            held = _Held(step, torch.zeros(rows, dtype=torch.bool))
        # the one small collective before any forward: which rows each group already holds, and
        # their count (zeros from a group that joined, healed or broke nothing)
        cover = torch.zeros(rows + 1, dtype=torch.float64)
        cover[:rows], cover[rows] = held.rows.to(torch.float64), float(held.count)
        manager.allreduce(cover, reduce_op=ReduceOp.SUM).wait()
        if manager.errored() is not None:  # the sums may be garbage: this try is over
            manager.should_commit()  # false here: the group's error is in it
            return None
        covered, held_total = cover[:rows], round(cover[rows].item())
        if bool((covered > 1).any()):  # the same on every group
            self._drop()  # holdings that overlap cannot be summed: everyone starts the step afresh
            held = _Held(step, torch.zeros(rows, dtype=torch.bool))
            covered, held_total = torch.zeros(rows, dtype=torch.float64), 0
        free = torch.nonzero(covered == 0).flatten()  # rows no one holds, in order
        mine = self._rows_of(free, participants, rank)
        micro_batches = self._micro_batches(batch, mine)
        # N = the held rows' count + every free row's count: each group counts the free rows itself
        # (it holds the whole global batch), so N is the same everywhere with no second collective
        total = held_total + self._count(self._micro_batches(batch, free), count_fn)
        local = self._count(micro_batches, count_fn)
        finite, flats = True, list[torch.Tensor]()
        loss_sum = held.loss.clone()
        if total > 0:
            for i, mb in enumerate(micro_batches):
                loss = check_loss(loss_fn(self.model, mb), i)
                (loss / total).backward()  # adds this share's part of grad(sum_t l_t) / N to p.grad
                loss_sum += loss.detach().to(torch.float64)
            self._held = _Held(
                step, held.rows.index_fill(0, mine, True), held.count + local, loss_sum.clone()
            )
            finite, flats = self._sum_gradients()
            manager.allreduce(loss_sum, reduce_op=ReduceOp.SUM).wait()
        if not manager.should_commit():  # a collective failed: the quorum changed under the step
            return None  # p.grad still holds this group's rows alone (the sums went to copies)
        self.participants = participants
        self._install(flats)
        local = self._held.count if self._held is not None and self._held.step == step else local
        self._held = None
        mean = float(loss_sum.item()) / total if total else None
        # every group holds the same sums, so every group decides a skip alike, with no collective
        reason = None
        if mean is None:
            reason = ZERO_COUNT
        elif not (finite and math.isfinite(mean)):
            reason = f"non-finite loss or gradient (loss {mean}) summed over the quorum"
        if reason is not None:  # the step's index is used up all the same (torchft committed it)
            self._drop()
            return StepResult(
                loss=mean, local_count=local, global_count=total, micro_batches=len(micro_batches),
                grad_norm=None, applied=False, skip_reason=reason, step=self.current_step,
            )  # fmt: skip
        grad_norm = None
        if self.max_grad_norm is not None:  # the same summed gradient on every group: the same clip
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm))
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self._drop()
        return StepResult(
            loss=mean, local_count=local, global_count=total, micro_batches=len(micro_batches),
            grad_norm=grad_norm, applied=True, step=self.current_step,
        )  # fmt: skip

    @staticmethod
    def _rows_of(free: torch.Tensor, participants: int, rank: int | None) -> torch.Tensor:
        """This group's part of the rows no one holds (none when it does not participate)."""
        if rank is None or participants < 1:  # a spare: its share is empty
            return free[:0]
        start, stop = share_bounds(free.numel(), participants, rank)
        return free[start:stop]

    def _micro_batches(self, batch: Batch, rows: torch.Tensor) -> list[Batch]:
        """``rows`` of the global batch cut into micro-batches of at most ``micro_batch`` rows."""
        if rows.numel() == 0:
            return []
        full, rest = divmod(rows.numel(), self.micro_batch)
        sizes = [self.micro_batch] * full + ([rest] if rest else [])
        contiguous = bool((rows[1:] - rows[:-1] == 1).all())
        first = int(rows[0])
        part = take(batch, first, first + rows.numel()) if contiguous else select(batch, rows)
        return split(part, sizes=sizes)

    @staticmethod
    def _count(micro_batches: list[Batch], count_fn: CountFn) -> int:
        # one host read per micro-batch; ints are free
        return sum(int(as_count(count_fn(mb), i)) for i, mb in enumerate(micro_batches))

    def _sum_gradients(self) -> tuple[bool, list[torch.Tensor]]:
        """Sum every parameter's gradient over the quorum into flat copies (one all-reduce per
        gradient dtype), leaving ``p.grad`` as it is until the step commits; whether the sums are
        all finite (the same answer on every group)."""
        finite, flats = True, []
        for params in self._by_dtype():
            flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            finite = finite and bool(torch.isfinite(flat).all())
            flats.append(flat)
        return finite, flats

    def _install(self, flats: list[torch.Tensor]) -> None:
        """Copy the committed sums into ``p.grad``."""
        for params, flat in zip(self._by_dtype(), flats, strict=False):
            offset = 0
            for p in params:
                if p.grad is not None:
                    n = p.grad.numel()
                    p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                    offset += n

    def _by_dtype(self) -> list[list[nn.Parameter]]:
        """The trainable parameters grouped by gradient dtype, each with a gradient (zeros for one
        this share did not use: it still takes part in the sum)."""
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                groups.setdefault(p.grad.dtype, []).append(p)
        return list(groups.values())


@dataclass(frozen=True, slots=True)
class _Held:
    """What one group holds of a step between tries: the rows its ``p.grad`` covers, their count
    and their summed loss."""

    step: int
    rows: torch.Tensor
    count: int = 0
    loss: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.float64))
