"""Learning-rate schedules with a declared clock: applied optimizer steps, or consumed valid tokens.

A schedule is a factor in [0, 1] that multiplies each parameter group's peak learning rate (the
``LambdaLR`` convention), evaluated at the clock value *after* the update it drives is counted:

    steps clock:   the n-th applied update (n = 1, 2, ...) uses factor(n)
    tokens clock:  an update uses factor(T), T = valid tokens consumed including its own window's

so the first update never runs at a zero learning rate, and warmup reaches the peak exactly at the
update whose clock value reaches ``warmup``. The learning rate is recomputed from the trainer's own
counters before every window, never by counting ``scheduler.step()`` calls, so it is a pure function
of the checkpointed counters and survives resume exactly.

Skipped updates (non-finite loss or gradients, zero-count windows) do not advance either clock: a
skipped window is not an applied step, and its tokens are not consumed (their data is not replayed
either; ``tokens_seen`` counts them). A recipe expressed in steps therefore exposes the model to
``global_batch`` times more examples per milestone as the batch grows; one expressed in tokens keeps
its milestones at the same amount of data whatever the batch, which is the difference the seeds
describe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gradaccum.errors import ScheduleError
from gradaccum.values import require_int

__all__ = [
    "SKIPPED_POLICY",
    "Clock",
    "Schedule",
    "ScheduleConfig",
    "ScheduleError",
    "ScheduleKind",
    "apply_lr",
    "resolve_schedule",
]

Clock = Literal["steps", "tokens"]
ScheduleKind = Literal["cosine", "constant"]

SKIPPED_POLICY = {
    "steps": "a skipped update does not advance the clock (it counts applied optimizer steps only)",
    "tokens": "a skipped window's valid tokens are not consumed (the clock counts applied tokens only)",
}
"""What a skipped update does to each clock; written in the run card."""

DEFAULT_WARMUP_FRACTION = 0.1
"""Warmup, when unset, is this fraction of the horizon."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    """The schedule as the user states it; ``None`` fields are derived from the run's length."""

    kind: ScheduleKind = "cosine"
    """``cosine``: linear warmup, then cosine decay to ``min_lr_ratio``. ``constant``: warmup, then flat."""
    clock: Clock = "steps"
    """What advances the schedule: applied optimizer steps, or consumed valid tokens."""
    warmup: int | None = None
    """Warmup length in clock units; ``None``: 10% of the horizon."""
    horizon: int | None = None
    """Clock value where the cosine reaches its floor; ``None``: the run's length in clock units."""
    min_lr_ratio: float = 0.1
    """The cosine's floor as a fraction of the peak learning rate."""

    def __post_init__(self) -> None:
        if self.kind not in ("cosine", "constant"):
            raise ScheduleError(f"schedule kind must be 'cosine' or 'constant', got {self.kind!r}")
        if self.clock not in ("steps", "tokens"):
            raise ScheduleError(f"schedule clock must be 'steps' or 'tokens', got {self.clock!r}")
        for name in ("warmup", "horizon"):
            value = getattr(self, name)
            require_int(f"schedule {name}", value, low=0, error=ScheduleError, none_ok=True)
        if not (isinstance(self.min_lr_ratio, (int, float)) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise ScheduleError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """A resolved schedule: every length concrete, in units of its clock."""

    kind: ScheduleKind
    """``cosine`` or ``constant``."""
    clock: Clock
    """``steps`` or ``tokens``."""
    warmup: int
    """Clock value where the factor first reaches 1."""
    horizon: int
    """Clock value where the cosine reaches its floor (and stays)."""
    min_lr_ratio: float
    """The cosine's floor."""

    def __post_init__(self) -> None:
        if self.kind == "cosine" and self.horizon < self.warmup:
            raise ScheduleError(
                f"schedule warmup={self.warmup} is longer than its horizon={self.horizon} "
                f"({self.clock}); shorten the warmup or lengthen the horizon"
            )

    def factor(self, clock_value: float) -> float:
        """The multiplier of the peak learning rate at ``clock_value`` (see the module docstring)."""
        if self.warmup > 0 and clock_value < self.warmup:
            return max(clock_value, 0.0) / self.warmup
        if self.kind == "constant" or self.horizon == self.warmup:
            return 1.0 if self.kind == "constant" or clock_value <= self.horizon else self.min_lr_ratio
        progress = min(1.0, (clock_value - self.warmup) / (self.horizon - self.warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, Any]:
        """The schedule and its skipped-update policy, as the run card records it."""
        return {
            "kind": self.kind,
            "clock": self.clock,
            "warmup": self.warmup,
            "horizon": self.horizon,
            "min_lr_ratio": self.min_lr_ratio,
            "evaluated_at": "the clock value after the update it drives is counted",
            "skipped_updates": SKIPPED_POLICY[self.clock],
        }


def resolve_schedule(
    config: ScheduleConfig,
    *,
    steps: int | None,
    tokens: int | None,
    tokens_per_step: int,
    grows: bool = False,
) -> Schedule:
    """Fill in a horizon and warmup from the run's length.

    The horizon defaults to the run's length in the schedule's clock. When the run is stated in
    the other unit, it is converted with ``tokens_per_step`` (valid tokens in the first window's
    global batch: an estimate, recorded in the run card beside the schedule). ``grows``: a
    batch-size schedule may change the tokens per step during the run, so no conversion holds
    (``--steps`` with the tokens clock reached the floor early, ``--tokens`` with the steps clock
    never); the schedule then advances on the clock the run's length is stated in, so the cosine
    ends where the run does, and a warmup given on the other clock is converted once.
    """
    clock: Clock = config.clock
    warmup, horizon = config.warmup, config.horizon
    per_step = max(tokens_per_step, 1)
    stated = steps if clock == "steps" else tokens
    if grows and horizon is None and stated is None:
        clock = "tokens" if clock == "steps" else "steps"
        if warmup is not None:
            warmup = warmup * per_step if clock == "tokens" else math.ceil(warmup / per_step)
    if horizon is None:
        if clock == "steps":
            horizon = steps if steps is not None else math.ceil((tokens or 0) / per_step)
        else:
            horizon = tokens if tokens is not None else (steps or 0) * per_step
    if warmup is None:
        warmup = round(DEFAULT_WARMUP_FRACTION * horizon)
    if config.kind == "constant":
        horizon = max(horizon, warmup)
    return Schedule(
        kind=config.kind,
        clock=clock,
        warmup=warmup,
        horizon=horizon,
        min_lr_ratio=float(config.min_lr_ratio),
    )


def apply_lr(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Set every group's lr to its peak (``initial_lr``) times ``factor``; returns the first group's.

    ``initial_lr`` is stored in the groups the first time, as torch's schedulers do, so it travels
    with the optimizer's state dict.
    """
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * factor
    return float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0
