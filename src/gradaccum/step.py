"""The exact accumulating optimizer step.

For a window of micro-batches B_1..B_k on each of W data-parallel ranks, with n_j counted units in
B_j and N = sum over all ranks and micro-batches of n_j, the full-batch mean loss is

    L = (1/N) sum_j sum_{t in B_j} l_t    so    grad L = sum_j grad( sum_{t in B_j} l_t ) / N.

Each micro-batch therefore backpropagates its *summed* loss times 1/N. DDP and FSDP then *average*
the W ranks' gradients, which divides by W once more, so each rank scales by W/N instead.
Everything that belongs to the optimizer step (zero_grad, unscale, clip, step, scheduler, hooks)
runs once per window; nothing runs per micro-batch except forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from gradaccum import dist
from gradaccum.errors import (
    ConfigMismatchError,
    CountError,
    LossError,
    SyncError,
    TooManySkipsError,
    WindowError,
)
from gradaccum.sync import SyncKind, check_sync_on, no_grad_sync, sync_kind

__all__ = ["AccumConfig", "Accumulator", "CountFn", "LossFn", "StepResult", "grad_norm"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, micro_batch)``: the loss summed over the micro-batch's counted units."""
CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(micro_batch)``: how many units ``loss_fn`` sums over (valid tokens, examples)."""
Observer = Callable[[str, int], None]
"""Called with (event, micro-batch index) at phase boundaries; used by the benchmarks' timers."""

LossReduction = Literal["sum", "mean"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AccumConfig:
    """The settings of an :class:`Accumulator` that a run card records and replays."""

    max_grad_norm: float | None = None
    """Clip the accumulated gradient to this total L2 norm, once per step; ``None`` disables."""
    loss_reduction: LossReduction = "sum"
    """``sum``: loss_fn returns the sum over counted units (exact, recommended). ``mean``: it returns
    the mean over exactly ``count_fn`` units; the step multiplies it back by that count. A mean over
    zero units is undefined, so ``mean`` refuses micro-batches whose count is zero."""
    defer_sync: bool = True
    """Synchronize gradients once per window (on the last micro-batch). Turn off to trade
    communication for memory, e.g. FSDP, whose deferred gradients stay unsharded."""
    track_grad_norm: bool = False
    """Report the pre-clip gradient norm even when not clipping."""
    skip_nonfinite: bool = True
    """Skip the update on every rank when the loss or a gradient is NaN or infinite."""
    max_consecutive_skips: int | None = None
    """Raise :class:`TooManySkipsError` after this many skipped updates in a row; ``None``: never."""

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not (
            isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm > 0
        ):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {self.max_grad_norm!r}")
        if self.loss_reduction not in ("sum", "mean"):
            raise ValueError(f"loss_reduction must be 'sum' or 'mean', got {self.loss_reduction!r}")
        if self.max_consecutive_skips is not None and (
            isinstance(self.max_consecutive_skips, bool)
            or not isinstance(self.max_consecutive_skips, int)
            or self.max_consecutive_skips < 1
        ):
            raise ValueError(
                "max_consecutive_skips must be a positive integer or None, "
                f"got {self.max_consecutive_skips!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one call of :meth:`Accumulator.step` did."""

    loss: float | None
    """The window's mean loss over the global count (all ranks); ``None`` when that count is 0."""
    local_count: int
    """Units counted on this rank."""
    global_count: int
    """Units counted on all data-parallel ranks: the denominator N."""
    micro_batches: int
    """Micro-batches in this rank's window."""
    grad_norm: float | None
    """Total gradient norm before clipping (when clipping or ``track_grad_norm``)."""
    applied: bool
    """True when the optimizer stepped."""
    skip_reason: str | None = None
    """Why the update was skipped, on every rank alike."""
    step: int = 0
    """Optimizer updates applied so far, this one included."""

    @property
    def skipped(self) -> bool:
        return not self.applied


def grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """Total L2 norm of the gradients of ``parameters`` (None when none has a gradient).

    Stays on the device; for sharded (DTensor) gradients the norm is the full, global one.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        norm = get_total_norm(grads, 2.0)
    else:  # torch < 2.6
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    full_tensor = getattr(norm, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else norm


def _clip_(parameters: Sequence[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    clip_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip_with_norm is not None:
        clip_with_norm(parameters, max_norm, total_norm)
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)  # torch < 2.6
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))


def _as_count(value: object, index: int) -> int | torch.Tensor:
    """Validate one ``count_fn`` result: a non-negative int, or a one-element integer tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not (
            value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool
        ):
            return value
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise CountError(_count_problem(value, index))


def _count_problem(value: object, index: int) -> str:
    # built only on failure: formatting a tensor costs more than the whole check
    where = f"count_fn returned {value!r} for micro-batch {index}"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"{where}: a count must be a single number, got shape {tuple(value.shape)}"
        return f"{where}: a count must be an integer tensor, got dtype {value.dtype}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{where}: a count cannot be negative"
    return (
        f"{where}: a count must be a non-negative int or integer tensor "
        f"(valid tokens or examples), got {type(value).__name__}"
    )


def _local_grads_finite(params: Sequence[torch.Tensor]) -> bool:
    """Whether this rank's own gradients (its shards, for DTensors) are all finite."""
    for p in params:
        local = _local(p.grad)
        if local is not None and not bool(torch.isfinite(local).all()):
            return False
    return True


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a gradient: the local shard of a DTensor, else the tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def _check_loss(loss: object, index: int) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise LossError(
            f"loss_fn returned {type(loss).__name__} for micro-batch {index}; it must return a Tensor"
        )
    if loss.ndim != 0:
        raise LossError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)} for micro-batch {index}; it must "
            "return a scalar: the loss summed over the counted units (reduction='sum')"
        )
    if not loss.requires_grad:
        raise LossError(
            f"loss_fn returned a scalar that does not require grad for micro-batch {index}; was it "
            "computed under torch.no_grad() or detached?"
        )
    return loss


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
        micro_batches = list(window)
        distributed = dist.is_distributed(self.dp_group)
        if distributed and not self._checked_ranks:
            self._check_ranks_agree()
        check_sync_on(self.model)
        device = self._device
        emit = self._emit
        emit("window_start", len(micro_batches))

        # 1. Count the whole window before the first backward. Counts travel as float64 (exact
        # below 2**53) so that the scale W/N is computed in full precision.
        counts = [_as_count(count_fn(mb), i) for i, mb in enumerate(micro_batches)]
        host_counts = sum(c for c in counts if isinstance(c, int))
        device_counts = [c.reshape(()) for c in counts if isinstance(c, torch.Tensor)]
        if device_counts:
            stacked = torch.stack(device_counts).to(device=device, dtype=torch.float64, non_blocking=True)
            local_count = stacked.sum() + host_counts if host_counts else stacked.sum()
            min_count = stacked.min()
        else:
            local_count = torch.tensor(float(host_counts), dtype=torch.float64, device=device)
            min_count = None
        world = dist.world_size(self.dp_group) if self.kind != "local" else 1

        global_count_host: int | None = None
        if distributed:
            # [N, empty windows, negative counts, k, k^2] summed over ranks and read once, so that
            # every rank takes the same branch below. All ranks hold the same k iff W*sum(k^2) == sum(k)^2.
            k = len(micro_batches)
            flags = torch.tensor([int(k == 0), 0.0, k, k * k], dtype=torch.float64, device=device)
            if min_count is not None:
                flags[1] = (min_count < 0).to(torch.float64)
            meta = dist.all_reduce_sum_(torch.cat([local_count.reshape(1), flags]), self.dp_group)
            global_count_host, empty_ranks, negative_ranks, k_sum, k_sq = (int(v) for v in meta.tolist())
            global_count = meta[0]
            if empty_ranks:
                raise WindowError(
                    f"{empty_ranks} of {world} data-parallel ranks have an empty window (no "
                    f"micro-batches) and this rank has {len(micro_batches)}: every rank must run at "
                    "least one micro-batch, or the synchronizing backward would hang. Give each rank "
                    "at least one micro-batch (an all-padding one contributes zero)."
                )
            if not self.config.defer_sync and world * k_sq != k_sum * k_sum:
                raise WindowError(
                    f"ranks hold different numbers of micro-batches ({k_sum} in all over {world} ranks, "
                    f"{k} here) and defer_sync=False synchronizes on every backward, so the ranks would "
                    "wait on each other forever. Give every rank the same number of micro-batches, or "
                    "keep defer_sync=True (one synchronizing backward per window on every rank)."
                )
            if negative_ranks:
                raise CountError(f"count_fn returned a negative count on {negative_ranks} rank(s)")
        else:
            if not micro_batches:
                raise WindowError("the window is empty: step needs at least one micro-batch")
            global_count = local_count

        self._zero_grad()
        if global_count_host == 0:
            return self._skip(
                0, 0, len(micro_batches), None, "the window holds zero valid units on every rank"
            )

        # 2. Forward and backward each micro-batch; sync only on the last.
        # each micro-batch adds sum_t l_t / N; DDP then averages over W ranks, so scale by W / N.
        scale64 = world / global_count.clamp(min=1)
        scales: dict[torch.dtype, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            emit("micro_start", i)
            with no_grad_sync(self.model, enabled=self.config.defer_sync and i != last):
                loss = _check_loss(loss_fn(self.model, mb), i)
                if self.config.loss_reduction == "mean":
                    loss = self._unmean(loss, counts[i], i)
                losses.append(loss.detach())
                if loss.dtype not in scales:
                    scales[loss.dtype] = scale64.to(loss.dtype)
                contribution = loss * scales[loss.dtype]
                if self.scaler is not None:
                    contribution = self.scaler.scale(contribution)
                contribution.backward()
            emit("micro_end", i)

        # 3. One decision for all ranks: count, finiteness, then clip/step once.
        emit("optimizer_start", 0)
        params = [p for p in self._params if p.grad is not None]
        norm = self._grad_norm(params) if (self.config.skip_nonfinite or self._wants_norm()) else None
        loss_total = torch.stack(losses).to(torch.float64).sum()
        zero = self._zero
        summary = torch.stack(
            [
                loss_total,
                zero if norm is None else norm.detach().to(torch.float64),
                global_count,
                local_count,
                zero if min_count is None else min_count,
            ]
        )
        if distributed:
            # the count is already global, and so is the norm (gradients are synchronized, and
            # sharded norms are reduced by _grad_norm); only the loss is still local
            summary[:1] = dist.all_reduce_sum_(summary[:1].clone(), self.dp_group)
        # the step's one host read on a single process; a NaN or inf on any rank makes the
        # reduced loss or the global norm non-finite, so every rank reaches the same verdict
        loss_sum, norm_host, n_total, n_local, smallest = summary.tolist()
        n_global, local_n = int(n_total), int(n_local)
        if smallest < 0:
            self._zero_grad()
            raise CountError("count_fn returned a negative count; no update was applied")
        mean_loss = loss_sum / n_global if n_global else None
        if n_global == 0:
            return self._skip(
                local_n, 0, len(micro_batches), None, "the window holds zero valid units on every rank"
            )
        if self.config.skip_nonfinite and not (math.isfinite(loss_sum) and math.isfinite(norm_host)):
            self._back_off_scaler(params)
            return self._skip(
                local_n,
                n_global,
                len(micro_batches),
                mean_loss,
                f"non-finite loss or gradient (loss sum {loss_sum}, gradient norm {norm_host})",
            )

        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
            if self._wants_norm():
                norm = self._grad_norm(params)
        if self.config.max_grad_norm is not None and norm is not None:
            _clip_(params, self.config.max_grad_norm, norm)
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
            micro_batches=len(micro_batches),
            grad_norm=float(norm.item()) if (norm is not None and self._wants_norm()) else None,
            applied=True,
            step=self.steps_applied,
        )
        for hook in self.on_step:
            hook(result)
        emit("optimizer_end", 0)
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

    def _unmean(self, loss: torch.Tensor, count: int | torch.Tensor, index: int) -> torch.Tensor:
        # loss_reduction="mean": the mean over n_j units times n_j is the sum. A mean over zero
        # units has no defined gradient (0/0), so refuse it rather than backpropagate a NaN.
        n = int(count)
        if n == 0:
            raise CountError(
                f"micro-batch {index} counts zero units, and loss_reduction='mean' cannot express its "
                "zero contribution (a mean over nothing is NaN). Return summed losses "
                "(loss_reduction='sum'), which handle all-padding micro-batches exactly."
            )
        return loss * n

    def _back_off_scaler(self, params: Sequence[torch.Tensor]) -> None:
        """Make a GradScaler skip and back off exactly as on the ranks that saw the overflow.

        The scaler only sees this rank's gradients. When another rank (or a non-finite loss with
        finite gradients) caused the skip, one gradient element is set to inf so that the scaler's
        own unscale/step/update path runs: it skips the step and backs the scale off once, and the
        scale stays identical on every rank.
        """
        if self.scaler is None:
            return
        if _local_grads_finite(params):
            for p in params:
                local = _local(p.grad)
                if local is not None and local.numel():
                    local.view(-1)[0] = float("inf")
                    break
        self.scaler.unscale_(self.optimizer)
        self.scaler.step(self.optimizer)
        self.scaler.update()

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
        params = self._params
        mine = {
            "config": repr(self.config),
            "sync": self.kind,
            "parameters": len(params),
            "parameter elements": sum(p.numel() for p in params),
            "parameter shapes": format(hash(tuple(tuple(p.shape) for p in params)) & 0xFFFFFFFF, "08x"),
            "scaler": type(self.scaler).__name__ if self.scaler is not None else None,
        }
        everyone = dist.all_gather_objects(mine, self.dp_group)
        differing = [key for key in mine if len({repr(r[key]) for r in everyone}) > 1]
        self._checked_ranks = True
        if differing:
            lines = [
                f"  {key}: " + ", ".join(f"rank {r}={v[key]!r}" for r, v in enumerate(everyone))
                for key in differing
            ]
            raise ConfigMismatchError(
                "data-parallel ranks disagree before the first step; no gradient was exchanged:\n"
                + "\n".join(lines)
            )
