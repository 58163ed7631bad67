"""The exact accumulating optimizer step.

For a window of micro-batches B_1..B_k on each of W data-parallel ranks, with n_j counted units in
B_j and N = sum over all ranks and micro-batches of n_j, the full-batch mean loss is

    L = (1/N) sum_j sum_{t in B_j} l_t    so    grad L = sum_j grad( sum_{t in B_j} l_t ) / N.

Each micro-batch therefore backpropagates its *summed* loss times 1/N. DDP and FSDP then *average*
the W ranks' gradients, which divides by W once more, so each rank scales by W/N instead.
Everything that belongs to the optimizer step (zero_grad, unscale, clip, step, scheduler, hooks)
runs once per window; nothing runs per micro-batch except forward and backward.

A failure on one rank stops every rank at an agreement point instead of leaving the others in a
collective: :mod:`gradaccum.step.agreement` says where, and what that cannot cover.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from gradaccum.distributed import dist
from gradaccum.distributed.sync import SyncKind, check_sync_on, needs_every_parameter, no_grad_sync, sync_kind
from gradaccum.errors import CountError, SyncError, TooManySkipsError, WindowError
from gradaccum.step.agreement import (
    LocalFailure,
    agree_before_backward,
    back_off_scaler,
    check_buffer_broadcasts,
    check_ranks_agree,
    raise_agreed,
    raise_from_sync_backward,
)
from gradaccum.step.checks import as_count, check_loss, check_window_shapes, unmean
from gradaccum.step.config import AccumConfig, LossReduction, StepResult
from gradaccum.step.norms import clip_grads_, grad_norm

__all__ = ["AccumConfig", "Accumulator", "CountFn", "LossFn", "StepResult", "WindowCount"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch)``: the loss summed over the micro-batch's counted units."""
CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(micro_batch)``: how many units ``loss_fn`` sums over (valid tokens, examples)."""
Observer = Callable[[str, int], None]
"""Called with (event, micro-batch index) at phase boundaries; used by the benchmarks' timers."""


ZERO_COUNT = "the window holds zero valid units on every rank"


@dataclass(frozen=True, slots=True)
class WindowCount:
    """The counts of one window: per micro-batch, this rank's, and all ranks' (the N of W/N)."""

    counts: list[int | torch.Tensor]
    local_count: torch.Tensor
    global_count: torch.Tensor
    global_host: int | None
    """N on the host: known before the first backward under torch.distributed, else None."""
    min_count: torch.Tensor | None
    world: int
    """The W of W/N: ranks whose gradients the wrapper averages (1 for a plain module)."""


class Accumulator:
    """Runs one exact optimizer step over a window of micro-batches.

    >>> acc = Accumulator(model, optimizer, scheduler=None, max_grad_norm=1.0)
    >>> result = acc.step(window, loss_fn, count_fn)

    Under ``torch.distributed`` the model must be wrapped in DDP, FSDP or FSDP2 (``fully_shard``),
    whose averaging over ranks the step compensates for. The counts are summed across the
    data-parallel group in one small all-reduce before the first backward and read on the host
    once, so that every rank refuses an empty window or skips a zero-count window together
    instead of hanging; on one process nothing leaves the device until the end-of-step check.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        scaler: Any = None,
        *,
        loss_reduction: LossReduction = "sum",
        defer_sync: bool = True,
        track_grad_norm: bool = False,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int | None = None,
        dp_group: Any = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
    ) -> None:
        self.config = AccumConfig(
            max_grad_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            defer_sync=defer_sync,
            track_grad_norm=track_grad_norm,
            skip_nonfinite=skip_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
        )
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.dp_group = dp_group
        self.on_step = list(on_step)
        self.observer = observer
        self.kind: SyncKind = sync_kind(model)
        self.steps_applied = 0
        self.steps_skipped = 0
        self.consecutive_skips = 0
        self._checked_ranks = False
        self._failure: LocalFailure | None = None  # held until the window's next agreement point
        self._resync = False  # after an agreed failure under DDP: a synchronizing first micro-batch
        # DDP fixes the parameters it reduces when it is built; the Accumulator is built right after
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._reduced_params = trainable if needs_every_parameter(model) else []
        self._params = list(model.parameters())
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._params_outside_optimizer = [p for p in self._params if id(p) not in in_optimizer]
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._zero = torch.zeros((), dtype=torch.float64, device=self._device)
        if dist.is_distributed(dp_group) and self.kind == "local":
            raise SyncError(
                f"the data-parallel group has {dist.world_size(dp_group)} ranks but the model is a plain "
                f"{type(model).__name__}: its gradients would never be averaged across ranks. Wrap it "
                "in DistributedDataParallel or fully_shard (FSDP2) before building the Accumulator."
            )

    @classmethod
    def from_config(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: AccumConfig,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        dp_group: Any = None,
        on_step: Sequence[Callable[[StepResult], None]] = (),
        observer: Observer | None = None,
    ) -> Accumulator:
        """An Accumulator with the settings a run card recorded."""
        return cls(
            model,
            optimizer,
            scheduler,
            config.max_grad_norm,
            scaler,
            loss_reduction=config.loss_reduction,
            defer_sync=config.defer_sync,
            track_grad_norm=config.track_grad_norm,
            skip_nonfinite=config.skip_nonfinite,
            max_consecutive_skips=config.max_consecutive_skips,
            dp_group=dp_group,
            on_step=on_step,
            observer=observer,
        )

    # -- the step ---------------------------------------------------------------------------

    def step(self, window: Iterable[Any], loss_fn: LossFn, count_fn: CountFn) -> StepResult:
        """Accumulate the window's gradients exactly and apply one optimizer update."""
        micro_batches = self._begin(window)
        counted = self._count(micro_batches, count_fn)
        self._zero_grad()
        if counted.global_host == 0:
            return self._skip(0, 0, len(micro_batches), None, ZERO_COUNT)

        # each micro-batch adds sum_t l_t / N; DDP then averages over W ranks, so scale by W / N.
        scale64 = counted.world / counted.global_count.clamp(min=1)
        scales: dict[torch.dtype, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        last = len(micro_batches) - 1
        resync = self._resync
        for i, mb in enumerate(micro_batches):
            self._emit("micro_start", i)
            syncs = i == last or not self.config.defer_sync or (i == 0 and resync)
            contribution: torch.Tensor | None = None
            with no_grad_sync(self.model, enabled=not syncs):
                phase = "forward"
                try:
                    loss = check_loss(loss_fn(self.model, mb), i)
                    if self.config.loss_reduction == "mean":
                        loss = unmean(loss, counted.counts[i], i)
                    losses.append(loss.detach())
                    if loss.dtype not in scales:
                        scales[loss.dtype] = scale64.to(loss.dtype)
                    contribution = loss * scales[loss.dtype]
                    if self.scaler is not None:
                        contribution = self.scaler.scale(contribution)
                    if not syncs:
                        phase = "backward"
                        contribution.backward()
                except Exception as exc:
                    self._failure = LocalFailure(exc, phase, i)
                if syncs or self._failure is not None:
                    # all ranks meet before a synchronizing backward; a failed rank skips ahead to it
                    self._agree(i, contribution)
                if syncs and contribution is not None:
                    self._sync_backward(contribution, i)
            self._emit("micro_end", i)
        return self._conclude(torch.stack(losses).to(torch.float64).sum(), counted, len(micro_batches))

    # -- the phases, shared with CachedAccumulator -------------------------------------------

    def _begin(self, window: Iterable[Any]) -> list[Any]:
        """Check, once, that every rank runs the same configuration; then materialize the window.

        Under torch.distributed a failure here is held for the counts all-reduce (the first
        agreement point), so that the other ranks stop with this one instead of waiting in it.
        """
        self._failure = None
        distributed = dist.is_distributed(self.dp_group)
        if not self._checked_ranks and distributed:
            self._check_ranks_agree()
        try:
            micro_batches = list(window)
            check_sync_on(self.model)
        except Exception as exc:
            if not distributed:
                raise
            self._failure = LocalFailure(exc, "reading the window", None)
            micro_batches = []
        self._emit("window_start", len(micro_batches))
        return micro_batches

    def _count(self, micro_batches: list[Any], count_fn: CountFn) -> WindowCount:
        """Count the whole window before the first backward, and agree on N across ranks.

        Counts travel as float64 (exact below 2**53) so that the scale W/N is full precision.
        """
        device = self._device
        distributed = dist.is_distributed(self.dp_group)
        counts: list[int | torch.Tensor] = []
        if self._failure is None:
            try:
                for i, mb in enumerate(micro_batches):
                    counts.append(as_count(count_fn(mb), i))
            except Exception as exc:
                if not distributed:
                    raise
                self._failure = LocalFailure(exc, "count_fn", len(counts))
                counts = []
        host_counts = sum(c for c in counts if isinstance(c, int))
        device_counts = [c.reshape(()) for c in counts if isinstance(c, torch.Tensor)]
        min_count: torch.Tensor | None = None
        if device_counts:
            stacked = torch.stack(device_counts).to(device=device, dtype=torch.float64, non_blocking=True)
            local_count = stacked.sum() + host_counts if host_counts else stacked.sum()
            min_count = stacked.min()
        else:
            local_count = torch.tensor(float(host_counts), dtype=torch.float64, device=device)
        world = dist.world_size(self.dp_group) if self.kind != "local" else 1
        k = len(micro_batches)
        if not distributed:
            if not micro_batches:
                raise WindowError("the window is empty: step needs at least one micro-batch")
            return WindowCount(counts, local_count, local_count, None, min_count, world)

        # [N, empty windows, negative counts, k, k^2, failed, out of memory] summed over ranks and
        # read once, so that every rank takes the same branch. All ranks hold the same k iff
        # W*sum(k^2) == sum(k)^2.
        failure = self._failure
        failed, oom = (1, int(failure.oom)) if failure is not None else (0, 0)
        broadcasts = int(self.kind == "ddp" and self.model.will_sync_module_buffers())  # type: ignore[operator]
        flags = torch.tensor(
            [int(k == 0), 0.0, k, k * k, failed, oom, broadcasts], dtype=torch.float64, device=device
        )
        if min_count is not None:
            flags[1] = (min_count < 0).to(torch.float64)
        meta = dist.all_reduce_sum_(
            torch.cat([local_count.reshape(1), flags]), self.dp_group, what="the window's counts"
        )
        global_host, empty_ranks, negative_ranks, k_sum, k_sq, failed_ranks, oom_ranks, broadcasting = (
            int(v) for v in meta.tolist()
        )
        if failed_ranks:
            self._zero_grad()
            self._failure = None
            raise_agreed(failure, failed_ranks, oom_ranks, self.dp_group)
        check_buffer_broadcasts(broadcasting, world)
        check_window_shapes(
            world, k, empty_ranks, k_sum, k_sq, defer_sync=self.config.defer_sync, kind=self.kind
        )
        if negative_ranks:
            raise CountError(f"count_fn returned a negative count on {negative_ranks} rank(s)")
        return WindowCount(counts, local_count, meta[0], global_host, min_count, world)

    def _conclude(
        self, loss_value: torch.Tensor, counted: WindowCount, k: int, *, loss_is_global: bool = False
    ) -> StepResult:
        """One decision for all ranks (count, finiteness), then unscale, clip and step once.

        ``loss_value`` is this rank's summed loss (reduced here), or with ``loss_is_global`` the
        window's objective already computed identically on every rank.
        """
        self._emit("optimizer_start", 0)
        params = [p for p in self._params if p.grad is not None]
        norm = self._grad_norm(params) if (self.config.skip_nonfinite or self._wants_norm()) else None
        zero = self._zero
        summary = torch.stack(
            [
                loss_value.detach().to(torch.float64),
                zero if norm is None else norm.detach().to(torch.float64),
                counted.global_count,
                counted.local_count,
                zero if counted.min_count is None else counted.min_count,
            ]
        )
        if dist.is_distributed(self.dp_group) and not loss_is_global:
            # the count is already global, and so is the norm (gradients are synchronized, and
            # sharded norms are reduced by _grad_norm); only the loss is still local
            summary[:1] = dist.all_reduce_sum_(summary[:1].clone(), self.dp_group, what="the window's loss")
        # the step's one host read on a single process; a NaN or inf on any rank makes the
        # reduced loss or the global norm non-finite, so every rank reaches the same verdict
        loss_sum, norm_host, n_total, n_local, smallest = summary.tolist()
        n_global, local_n = int(n_total), int(n_local)
        if smallest < 0:
            self._zero_grad()
            raise CountError("count_fn returned a negative count; no update was applied")
        if loss_is_global:
            mean_loss: float | None = loss_sum
        else:
            mean_loss = loss_sum / n_global if n_global else None
        if n_global == 0:
            return self._skip(local_n, 0, k, None, ZERO_COUNT)
        if self.config.skip_nonfinite and not (math.isfinite(loss_sum) and math.isfinite(norm_host)):
            back_off_scaler(self.scaler, self.optimizer, params)
            reason = f"non-finite loss or gradient (loss sum {loss_sum}, gradient norm {norm_host})"
            return self._skip(local_n, n_global, k, mean_loss, reason)

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            if self._wants_norm():
                norm = self._grad_norm(params)
        if self.config.max_grad_norm is not None and norm is not None:
            clip_grads_(params, self.config.max_grad_norm, norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps_applied += 1
        self.consecutive_skips = 0
        result = StepResult(
            loss=mean_loss,
            local_count=local_n,
            global_count=n_global,
            micro_batches=k,
            grad_norm=float(norm.item()) if (norm is not None and self._wants_norm()) else None,
            applied=True,
            step=self.steps_applied,
        )
        for hook in self.on_step:
            hook(result)
        self._emit("optimizer_end", 0)
        return result

    # -- helpers ----------------------------------------------------------------------------

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self._params_outside_optimizer:  # e.g. frozen or separately optimized parameters
            for p in self._params_outside_optimizer:
                p.grad = None

    def _emit(self, event: str, index: int) -> None:
        if self.observer is not None:
            self.observer(event, index)

    def _grad_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The global gradient norm: what every rank's clipping and skip decision must see."""
        if self.kind == "fsdp":
            # FSDP1 shards flat gradients; its own method reduces the norm across ranks. With an
            # infinite max_norm it multiplies by exactly 1 (the clip coefficient is clamped to 1).
            return self.model.clip_grad_norm_(float("inf"))  # type: ignore[operator]
        return grad_norm(params)

    def _wants_norm(self) -> bool:
        return self.config.max_grad_norm is not None or self.config.track_grad_norm

    def _skip(self, local_n: int, global_n: int, k: int, loss: float | None, reason: str) -> StepResult:
        self._zero_grad()
        self.steps_skipped += 1
        self.consecutive_skips += 1
        limit = self.config.max_consecutive_skips
        if limit is not None and self.consecutive_skips > limit:
            raise TooManySkipsError(
                f"{self.consecutive_skips} consecutive updates were skipped (limit "
                f"max_consecutive_skips={limit}); last reason: {reason}. Check the data for windows "
                "without valid units, the loss for overflow, or lower the learning rate."
            )
        self._emit("optimizer_end", 0)
        return StepResult(
            loss=loss,
            local_count=local_n,
            global_count=global_n,
            micro_batches=k,
            grad_norm=None,
            applied=False,
            skip_reason=reason,
            step=self.steps_applied,
        )

    def _check_ranks_agree(self) -> None:
        """Before any gradient moves, every rank must run the same configuration and model."""
        settings: dict[str, Any] = dataclasses.asdict(self.config)
        settings["sync"] = self.kind
        settings["scaler"] = type(self.scaler).__name__ if self.scaler is not None else None
        self._checked_ranks = True
        check_ranks_agree(settings, self.model, self.dp_group)

    # -- agreement points (gradaccum.step.agreement) ------------------------------------------------

    def _agree(self, index: int, contribution: torch.Tensor | None) -> None:
        """Before a synchronizing backward: all ranks go on, or all clear their gradients and raise."""
        try:
            agree_before_backward(
                self._failure,
                contribution,
                index,
                self.model,
                self.kind,
                check_parameters=self._reduced_params,
                group=self.dp_group,
                resynchronizing=index == 0 and self._resync,
            )
        except BaseException:
            self._zero_grad()
            self._failure = None  # the raised error carries it; its traceback holds activations
            # DDP expects the backward of a synchronizing forward that completed, even in no_sync
            # later; a synchronizing first micro-batch on every rank resets that bookkeeping
            self._resync = self.kind == "ddp"
            raise

    def _sync_backward(self, contribution: torch.Tensor, index: int) -> None:
        try:
            contribution.backward()
        except Exception as exc:
            self._zero_grad()
            raise_from_sync_backward(exc, index, self.dp_group)
        self._resync = False
