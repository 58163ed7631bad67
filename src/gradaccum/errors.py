"""The exception hierarchy.

Every error gradaccum raises on purpose derives from :class:`GradAccumError`, names the setting and
the values involved, and says how to fix it. The ``ValueError``/``TypeError`` bases let callers that
already catch those keep working.
"""

from __future__ import annotations

__all__ = [
    "ConfigMismatchError",
    "CountError",
    "CountTypeError",
    "EquivalenceError",
    "GradAccumError",
    "LossError",
    "PlanError",
    "RunCardError",
    "SyncError",
    "TooManySkipsError",
    "WindowError",
    "WorkloadError",
]


class GradAccumError(Exception):
    """Base class of every error gradaccum raises deliberately."""


class PlanError(GradAccumError, ValueError):
    """Batch arithmetic that does not add up (sizes, divisibility, mismatched plans)."""


class WindowError(GradAccumError, ValueError):
    """A window of micro-batches that cannot be stepped (empty here or on another rank)."""


class CountError(GradAccumError, ValueError):
    """``count_fn`` returned something that is not a non-negative integer count."""


class CountTypeError(CountError, TypeError):
    """Counting met a tensor of the wrong dtype (float labels, say); also a ``TypeError``."""


class LossError(GradAccumError, ValueError):
    """``loss_fn`` returned something that cannot be backpropagated as a summed loss."""


class SyncError(GradAccumError, RuntimeError):
    """Gradient synchronization cannot be deferred as asked (wrong wrapper, nested no_sync)."""


class ConfigMismatchError(SyncError):
    """Data-parallel ranks disagree on a setting that must be identical on every rank."""


class TooManySkipsError(GradAccumError, RuntimeError):
    """Too many consecutive optimizer updates were skipped (non-finite loss or gradients)."""


class EquivalenceError(GradAccumError):
    """An accumulated update does not match the full-batch update within tolerance."""


class WorkloadError(GradAccumError, ValueError):
    """A workload path or workload object is malformed."""


class RunCardError(GradAccumError, ValueError):
    """A run card is missing, truncated or inconsistent."""
