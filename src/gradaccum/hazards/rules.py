"""The guard's vocabulary: its rules, its findings, its settings and its errors (the finding and the
errors are defined in :mod:`gradaccum.errors`, which carries a finding in :class:`GuardError`).

Kept apart from :mod:`gradaccum.hazards.sanitizer` (the watching machinery) so that the rules read
as one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gradaccum.errors import GuardError, GuardFinding, GuardSetupError, GuardWarning

__all__ = [
    "GUARD_RULES",
    "RULE_TEXT",
    "GuardConfig",
    "GuardError",
    "GuardFinding",
    "GuardMode",
    "GuardSetupError",
    "GuardWarning",
]

GuardMode = Literal["raise", "warn"]

RULE_TEXT: dict[str, tuple[str, str, str]] = {
    "zero-grad-mid-window": (
        "zero_grad erased gradients of fewer than accum_steps backward passes",
        "{label}() after {n} of accum_steps={k} backward passes erases the gradients accumulated so far: "
        "the update sees only the micro-batches after it.",
        "Call zero_grad once per window, after optimizer.step() (or before the window's first backward).",
    ),
    "step-mid-window": (
        "optimizer stepped after fewer than accum_steps backward passes",
        "{label}() after {n} backward pass(es), accum_steps={k}: the optimizer updates per micro-batch "
        "instead of once per window.",
        "Step once every accum_steps backward passes. Declare a short last window with "
        "guard(..., micro_batches_per_epoch=N) or g.final_window().",
    ),
    "window-overrun": (
        "optimizer stepped after more than accum_steps backward passes",
        "{label}() after {n} backward passes, more than accum_steps={k}: {n} micro-batches were summed "
        "into one update (a missed step or zero_grad, or accum_steps is not the loop's).",
        "Step (or zero_grad to discard) every accum_steps backward passes, or fix accum_steps.",
    ),
    "scheduler-mid-window": (
        "scheduler stepped inside a window or twice per optimizer step",
        "{label}() ran {where}: the schedule advances per micro-batch, not once per optimizer step.",
        "Call scheduler.step() once per optimizer step, after optimizer.step().",
    ),
    "clip-mid-window": (
        "gradients clipped before the window's last backward",
        "{label} clipped after {n} of accum_steps={k} backward passes: it clips a partial sum, and the "
        "later micro-batches add unclipped.",
        "Clip once per window, after the last backward (and after scaler.unscale_), before stepping.",
    ),
    "clip-before-unscale": (
        "gradients clipped while still multiplied by the GradScaler's scale",
        "{label} clipped gradients still multiplied by the GradScaler's scale: the threshold is "
        "compared with the scaled norm.",
        "Call scaler.unscale_(optimizer) after the window's last backward, before clipping.",
    ),
    "unscale-mid-window": (
        "GradScaler.unscale_ before the window's last backward",
        "{label} after {n} of accum_steps={k} backward passes: later backwards add scaled gradients "
        "onto unscaled ones.",
        "Call scaler.unscale_(optimizer) once per window, after the last backward.",
    ),
    "scaler-update-mid-window": (
        "GradScaler.update inside a window",
        "{label}() after {n} of accum_steps={k} backward passes: the loss scale can change inside the "
        "window, so its micro-batches are summed with different scales.",
        "Call scaler.update() once per window, after scaler.step(optimizer).",
    ),
    "no-sync-backward-only": (
        "DDP no_sync entered around backward but not forward",
        "backward ran inside DistributedDataParallel.no_sync() but its forward ran outside: DDP decides "
        "in forward whether backward all-reduces, so this backward synchronized anyway.",
        "Run the forward and the backward of every micro-batch but the last inside model.no_sync().",
    ),
    "sync-per-micro-batch": (
        "DDP gradients synchronized more than once per window",
        "backward {n} of accum_steps={k} all-reduced the gradients a second time in this window: DDP "
        "averages per micro-batch instead of once per window, multiplying gradient traffic.",
        "Run forward and backward of all micro-batches but the last inside model.no_sync(), or pass "
        "ignore={{'sync-per-micro-batch'}} to trade communication for memory on purpose.",
    ),
    "unsynced-step": (
        "optimizer stepped after a last backward that did not synchronize (DDP)",
        "{label}() after a window whose last backward ran inside no_sync() ({syncs} of {n} backward "
        "passes synchronized): ranks step on different gradients.",
        "Run the window's last micro-batch, forward and backward, outside no_sync().",
    ),
    "mean-of-means": (
        "micro-batch losses weighted unequally per unit (mean losses, unequal counts)",
        "the {m} micro-batch losses of this window {what}: a mean of means.",
        "Sum each micro-batch's loss over its units (reduction='sum') and multiply by 1/N, N counted "
        "over the whole window before the first backward (times the world size under DDP), as "
        "gradaccum.Accumulator does.",
    ),
    "short-window-scale": (
        "a short final window's mean losses divided by the planned accum_steps",
        "this short final window has {n} of accum_steps={k} micro-batches but each mean loss was "
        "divided by {k}: its gradient is {n}/{k} of the window's mean.",
        "Divide by the units (or micro-batches) the window really has, not the planned accum_steps.",
    ),
}
GUARD_RULES: dict[str, str] = {code: summary for code, (summary, _, _) in RULE_TEXT.items()}
"""Every rule the guard checks, by code: what ``ignore`` accepts and what findings carry."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """What the guard expects of the loop."""

    accum_steps: int
    """Backward passes (micro-batches) per optimizer step, on each rank."""
    mode: GuardMode = "raise"
    """``raise``: raise :class:`GuardError` at the misuse; ``warn``: emit :class:`GuardWarning`."""
    micro_batches_per_epoch: int | None = None
    """Backward passes per pass over the data: the window that ends a pass may be short. ``None``:
    every window is full unless :meth:`Guard.final_window` marks it."""
    ignore: frozenset[str] = frozenset()
    """Rule codes (keys of ``GUARD_RULES``) not to check, e.g. a deliberate sync per micro-batch."""
    inspect_loss: bool = True
    """Read each backward's loss graph for the mean-of-means rules (a few host reads per window)."""

    def __post_init__(self) -> None:
        for name in ("accum_steps", "micro_batches_per_epoch"):
            value = getattr(self, name)
            if (value is not None or name == "accum_steps") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise GuardSetupError(f"{name} must be a positive integer, got {value!r}")
        if self.mode not in ("raise", "warn"):
            raise GuardSetupError(f"mode must be 'raise' or 'warn', got {self.mode!r}")
        unknown = sorted(set(self.ignore) - set(GUARD_RULES))
        if unknown:
            raise GuardSetupError(
                f"ignore names unknown rules {unknown}; the rules are {sorted(GUARD_RULES)}"
            )
