"""The Accumulator's settings and what one step reports: plain frozen records.

:class:`AccumConfig` is the one place the settings of an accumulator are listed: the accumulators
hold one, run cards record one (``to_dict``/``from_dict``), and every field's type is checked when
it is built, because a hand-edited run card with ``"defer_sync": "no"`` would otherwise mean the
opposite of what it says (``bool("no")`` is true).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from gradaccum.errors import ConfigError
from gradaccum.fielddocs import document_fields
from gradaccum.names import accum_dtype_name
from gradaccum.values import require_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "BATCHNORM_STATS",
    "SCALINGS",
    "SYNC_POLICIES",
    "AccumConfig",
    "BatchNormStats",
    "LossReduction",
    "Scaling",
    "StepResult",
    "SyncPolicy",
]

LossReduction = Literal["sum", "mean"]
_REDUCTIONS = ("sum", "mean")
SyncPolicy = Literal["defer", "defer_replicate", "every"]
SYNC_POLICIES = ("defer", "defer_replicate", "every")
Scaling = Literal["pre", "post"]
SCALINGS = ("pre", "post")
BatchNormStats = Literal["micro-batch", "window"]
BATCHNORM_STATS = ("micro-batch", "window")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"AccumConfig.{name} must be True or False, got {value!r} ({type(value).__name__}); "
            "a string such as 'false' is not a boolean (in JSON write true/false without quotes)"
        )


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class AccumConfig:
    """The settings of an accumulator: what a run card records and replays."""

    max_grad_norm: float | None = None
    """Clip the accumulated gradient to this total L2 norm, once per step; ``None`` disables."""
    loss_reduction: LossReduction = "sum"
    """``sum``: loss_fn returns the sum over counted units (exact, recommended). ``mean``: it returns
    the mean over exactly ``count_fn`` units; the step multiplies it back by that count. A mean over
    zero units is undefined, so ``mean`` refuses micro-batches whose count is zero."""
    check_loss_reduction: bool = True
    """With ``loss_reduction="sum"``, read the autograd graph of each loss of the first window and
    refuse, with :class:`LossError` on every rank before any update, one that is a mean over its
    units (``F.cross_entropy``'s default ``reduction="mean"``, ``.mean()``, ``sum() / count``),
    which the step would otherwise divide by the count a second time. ``False`` declares a loss
    that is not a sum over ``count_fn``'s units on purpose (a per-micro-batch loss, ``count_fn``
    returning 1). Later windows are not read. See :mod:`gradaccum.step.reduction`."""
    defer_sync: bool = True
    """Synchronize gradients once per window (on the last micro-batch). Turn off to trade
    communication for memory, e.g. FSDP, whose deferred gradients stay unsharded."""
    track_grad_norm: bool = False
    """Report the pre-clip gradient norm even when not clipping."""
    skip_nonfinite: bool = True
    """Skip the update on every rank when the loss or a gradient is NaN or infinite."""
    max_consecutive_skips: int | None = None
    """Raise :class:`TooManySkipsError` after this many skipped updates in a row; ``None``: never."""
    agree_on_failure: bool = True
    """Under DDP, all ranks meet in one small all-reduce after the last forward, before the
    synchronizing backward, so that a failure on one rank (an exception, an out-of-memory error, a
    backward that would miss parameters) stops every rank at once with :class:`RankFailedError`.
    The window's loss travels in the same all-reduce. Turning it off saves that meeting's host read
    (the CPU waits for the last forward before it queues the backward), not a collective: the loss
    is then reduced after the backward instead. The cost: a rank that fails mid-window leaves the
    others waiting in the gradient all-reduce until the process-group timeout."""
    sync_policy: SyncPolicy = "defer"
    """When gradients are reduced within a window. ``defer``: every reduction once, after the last
    micro-batch (least communication, the most gradient memory under FSDP2: unsharded gradients are
    held until then). ``defer_replicate`` (FSDP2 on a ``dp_replicate`` x ``dp_shard`` mesh, HSDP):
    reduce-scatter over the shards every micro-batch, the all-reduce over the replicas once
    (``set_requires_all_reduce``). ``every``: reduce every micro-batch (the same as
    ``defer_sync=False``)."""
    noise_scale: bool = False
    """Estimate the gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018),
    the critical batch, from each micro-batch's gradient and the window's, read by
    ``Accumulator.noise_scale`` (see :mod:`gradaccum.step.noise`). The update does not change; it
    costs a norm per parameter per micro-batch and, under DDP with ``agree_on_failure=True``, one
    small all-reduce per update. One process and DDP only (not FSDP, not gradient caching)."""
    scaling: Scaling = "pre"
    """When the gradient is divided by the global count N. ``pre``: every micro-batch is counted
    before the first forward and backpropagates its summed loss times W/N (the window is held in
    full). ``post``: the micro-batches are consumed one at a time from any iterable (memory
    independent of k), each backpropagates its summed loss times a fixed power of two, the count
    accumulates on the device, and the gradients are multiplied once by W/(N c) after the last
    backward; under DDP one small all-reduce, before the synchronizing backward, carries the count.
    See :mod:`gradaccum.step.stream`."""
    batchnorm_stats: BatchNormStats = "micro-batch"
    """How BatchNorm layers update ``running_mean``, ``running_var`` and ``num_batches_tracked``.
    ``micro-batch``: PyTorch's behaviour, once per forward (k times per optimizer step, an
    effective momentum of ``1 - (1 - m)^k``). ``window``: once per applied optimizer step, from the
    pooled moments of what each BatchNorm saw over the window (every micro-batch's input to it, on
    every data-parallel rank); for a BatchNorm whose input no other BatchNorm normalized, what one
    forward over the window's rows would leave. A skipped or abandoned window leaves them as they
    were. Each forward still normalizes with its own micro-batch's statistics. See
    :mod:`gradaccum.step.batchnorm`."""
    accum_dtype: str | torch.dtype | None = None
    """Accumulate the gradients of narrower (bfloat16/float16) parameters across the window's
    micro-batches in this dtype (``torch.float32`` or ``"float32"``; ``"float64"`` too), rounding
    the sum once into the parameter's dtype just before the optimizer step; clipping and the
    non-finite check read the wide sum. ``None``: accumulate in the parameter's dtype, as torch
    does. Costs 4 bytes per low-precision parameter while accumulating (the bf16 ``.grad`` it
    replaces freed 2) and, under DDP, a float32 all-reduce instead of a bf16 one. Stored as the
    dtype's name. See :mod:`gradaccum.step.accum_dtype`."""

    def __post_init__(self) -> None:
        norm = self.max_grad_norm
        if norm is not None and (
            isinstance(norm, bool) or not isinstance(norm, (int, float)) or not (0 < norm < math.inf)
        ):
            raise ConfigError(
                f"AccumConfig.max_grad_norm must be a positive finite number or None (no clipping), "
                f"got {norm!r}"
            )
        if self.loss_reduction not in _REDUCTIONS:
            raise ConfigError(
                f"AccumConfig.loss_reduction must be 'sum' or 'mean', got {self.loss_reduction!r}"
            )
        if self.sync_policy not in SYNC_POLICIES:
            raise ConfigError(
                f"AccumConfig.sync_policy must be one of {list(SYNC_POLICIES)}, got {self.sync_policy!r}"
            )
        if self.defer_sync is False and self.sync_policy != "defer" and self.sync_policy != "every":
            raise ConfigError(
                f"AccumConfig(defer_sync=False, sync_policy={self.sync_policy!r}) contradict each other: "
                "defer_sync=False reduces every micro-batch; leave defer_sync at True to defer"
            )
        if self.scaling not in SCALINGS:
            raise ConfigError(
                f"AccumConfig.scaling must be 'pre' (count the window first) or 'post' (stream it, "
                f"scale the gradients once after it), got {self.scaling!r}"
            )
        if self.batchnorm_stats not in BATCHNORM_STATS:
            raise ConfigError(
                f"AccumConfig.batchnorm_stats must be one of {list(BATCHNORM_STATS)} ('micro-batch': "
                f"PyTorch's update per forward; 'window': once per optimizer step over the window's "
                f"rows), got {self.batchnorm_stats!r}"
            )
        for name in (
            "check_loss_reduction",
            "defer_sync",
            "track_grad_norm",
            "skip_nonfinite",
            "agree_on_failure",
            "noise_scale",
        ):
            _bool(name, getattr(self, name))
        require_int(
            "AccumConfig.max_consecutive_skips", self.max_consecutive_skips, error=ConfigError, none_ok=True
        )
        # a torch dtype is kept by its name, so run cards and the ranks' fingerprint read it alike
        object.__setattr__(self, "accum_dtype", accum_dtype_name(self.accum_dtype))

    @property
    def policy(self) -> SyncPolicy:
        """The sync policy in force: ``every`` when ``defer_sync=False``."""
        return "every" if not self.defer_sync else self.sync_policy

    @property
    def wants_norm(self) -> bool:
        """Whether each step computes the pre-clip norm for clipping or the report."""
        return self.max_grad_norm is not None or self.track_grad_norm

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, as a run card records them."""
        return asdict(self)

    @classmethod
    def resolve(cls, config: AccumConfig | None, settings: Mapping[str, Any]) -> AccumConfig:
        """``config`` as given, or one built from an accumulator's keyword settings; not both.

        The one place the accumulators turn ``Accumulator(..., max_grad_norm=1.0)`` into a config,
        so that their signatures do not list the fields again. ``settings`` holds only what the
        caller passed (an accumulator's ``**settings``), so ``loss_reduction=None`` is refused like
        any wrong value, not mistaken for "not given".
        """
        given = dict(settings)
        if config is None:
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(given) - known)
            if unknown:
                raise ConfigError(
                    f"unknown accumulator settings {unknown}; the settings are AccumConfig's fields: "
                    f"{sorted(known)}"
                )
            return cls(**given)
        if not isinstance(config, AccumConfig):
            raise ConfigError(f"config must be a gradaccum.AccumConfig, got {type(config).__name__}")
        if given:
            raise ConfigError(
                f"pass the settings as config=AccumConfig(...) or as keywords, not both; got config and "
                f"{', '.join(sorted(given))}. Use dataclasses.replace(config, ...) to change a few."
            )
        return config

    @classmethod
    def from_dict(cls, data: object) -> AccumConfig:
        """Rebuild from :meth:`to_dict`'s output, refusing unknown keys and wrong types."""
        if not isinstance(data, dict):
            raise ConfigError(f"accumulator settings must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"accumulator settings: unknown settings {unknown}; known: {sorted(known)}")
        return cls(**data)


@document_fields
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
    recompiles: int = 0
    """Graphs ``torch.compile`` compiled in this process during the window (0 when nothing
    compiled): the first windows of a compiled model compile; later ones should not (see
    :mod:`gradaccum.step.compiled` for the bound and for padding varying lengths)."""

    @property
    def skipped(self) -> bool:
        return not self.applied
