"""The Accumulator's settings and what one step reports: plain frozen records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["AccumConfig", "LossReduction", "StepResult"]

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
