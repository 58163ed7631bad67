"""The exception hierarchy: every error (and the one warning) gradaccum raises on purpose.

Every error derives from :class:`GradAccumError`, names the setting and the values involved, and
says how to fix it. The ``ValueError``/``TypeError``/``RuntimeError`` bases let callers that
already catch those keep working. The tree::

    GradAccumError
      ConfigError          a setting of the wrong type or out of range (also a TypeError)
      PlanError            batch arithmetic that does not add up
      WindowError          a window that cannot be stepped (empty here or on another rank)
      CountError           count_fn returned something that is not a count
        CountTypeError     counting met labels of the wrong dtype
      LossError            loss_fn returned something that is not a summed scalar loss
      SyncError            gradient sync cannot be deferred as asked
        ConfigMismatchError  ranks disagree on settings or model
        UnusedParameterError DDP would wait for gradients a backward never produces
        CollectiveError      a collective failed: another rank stopped taking part
      RankFailedError      a rank failed in this window; every rank stopped with it
        WindowOutOfMemoryError  ... of memory, on every rank alike (also a torch.OutOfMemoryError)
      TooManySkipsError    too many updates in a row were skipped
      EquivalenceError     the accumulated update does not match the full batch
      WorkloadError        a workload that cannot be loaded or run
      RunCardError         a run card that is missing, truncated or inconsistent
      CacheError           representations that cannot be cached and replayed exactly
      GuardError           the guard found a misuse (mode="raise")
      GuardSetupError      the guard's own arguments are invalid
      BenchError           a measurement that cannot be set up or summarized
      TrainError           a training run that cannot start or continue
        CheckpointError    a checkpoint that is missing, corrupt or for another run
      CheckpointWriteError a checkpoint that could not be written (disk full); the previous one stands
      ScheduleError        a learning-rate schedule that cannot be honoured
    GuardWarning (a UserWarning)  the guard found a misuse (mode="warn")
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BenchError",
    "CacheError",
    "CheckpointError",
    "CheckpointWriteError",
    "CollectiveError",
    "ConfigError",
    "ConfigMismatchError",
    "CountError",
    "CountTypeError",
    "EquivalenceError",
    "GradAccumError",
    "GuardError",
    "GuardFinding",
    "GuardSetupError",
    "GuardWarning",
    "LossError",
    "PlanError",
    "RankFailedError",
    "RankFailure",
    "RunCardError",
    "ScheduleError",
    "SyncError",
    "TooManySkipsError",
    "TrainError",
    "UnusedParameterError",
    "WindowError",
    "WindowOutOfMemoryError",
    "WorkloadError",
]


class GradAccumError(Exception):
    """Base class of every error gradaccum raises deliberately."""


class ConfigError(GradAccumError, TypeError, ValueError):
    """A setting of the wrong type or out of range; names the setting, the value and what it takes."""


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


class UnusedParameterError(SyncError):
    """Under DDP without ``find_unused_parameters``, a synchronizing backward would miss parameters."""


class CollectiveError(SyncError):
    """A collective failed: another rank stopped taking part (it failed, died, or hangs)."""


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What one rank reported about its failure in a window (carried by :class:`RankFailedError`)."""

    rank: int
    """The rank that failed."""
    phase: str
    """Where: ``reading the window``, ``count_fn``, ``forward`` (loss_fn) or ``backward``."""
    micro_batch: int | None
    """Index of the micro-batch in that rank's window (None before any micro-batch ran)."""
    error_type: str
    """Class name of the exception the rank raised."""
    message: str
    """Its text, cut to a few hundred characters."""
    oom: bool
    """True for an out-of-memory error, which a smaller micro-batch may avoid."""

    def describe(self) -> str:
        where = self.phase if self.micro_batch is None else f"{self.phase} of micro-batch {self.micro_batch}"
        return f"rank {self.rank} failed in {where}: {self.error_type}: {self.message}"


class RankFailedError(GradAccumError, RuntimeError):
    """A data-parallel rank failed in this window; every rank stopped with it, no update applied."""

    def __init__(self, message: str, failures: Sequence[RankFailure] = ()) -> None:
        super().__init__(message)
        self.failures: tuple[RankFailure, ...] = tuple(failures)
        """Every failing rank's report, in rank order."""


# WindowOutOfMemoryError is also torch's OutOfMemoryError, so that code catching torch's error catches
# it too; naming that base imports torch, which nothing else here needs. The class is built on first
# use (PEP 562 module __getattr__), so that the command line's parsers, the plan arithmetic and
# everything that only raises or catches the other errors load without torch (gradaccum --help).
if TYPE_CHECKING:

    class WindowOutOfMemoryError(RankFailedError, torch.OutOfMemoryError):
        """Out of memory in this window (on any rank); raised on every rank, so all may retry together."""

else:
    _lazy_lock = threading.Lock()

    def __getattr__(name: str) -> Any:
        if name != "WindowOutOfMemoryError":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        with _lazy_lock:
            if name not in globals():
                import torch

                class WindowOutOfMemoryError(RankFailedError, torch.OutOfMemoryError):
                    """Out of memory in this window (on any rank); raised on every rank, so all may
                    retry together."""

                WindowOutOfMemoryError.__qualname__ = name  # pickled by name, as if defined here
                globals()[name] = WindowOutOfMemoryError
        return globals()[name]

    def __dir__() -> list[str]:
        return sorted(set(globals()) | {"WindowOutOfMemoryError"})


class TooManySkipsError(GradAccumError, RuntimeError):
    """Too many consecutive optimizer updates were skipped (non-finite loss or gradients)."""


class EquivalenceError(GradAccumError):
    """An accumulated update does not match the full-batch update within tolerance."""


class WorkloadError(GradAccumError, ValueError):
    """A workload path or workload object is malformed, or the workload's own code failed."""


class RunCardError(GradAccumError, ValueError):
    """A run card is missing, truncated or inconsistent."""


class CacheError(GradAccumError, ValueError):
    """Representations that cannot be cached and replayed exactly (wrong type, not reproducible)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardFinding:
    """One misuse: the rule, the user's line that did it, the figures, and the fix."""

    code: str
    """The rule's code, a key of ``GUARD_RULES``."""
    message: str
    """What happened, with the counts involved."""
    fix: str
    """What to change in the loop."""
    filename: str
    """The user's file: the first frame outside gradaccum and torch."""
    lineno: int
    """The line in ``filename``."""
    window: int
    """Optimizer steps completed before the window where it happened (0-based window index)."""

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def __str__(self) -> str:
        return f"{self.location}: [{self.code}] {self.message} Fix: {self.fix}"


class GuardError(GradAccumError, RuntimeError):
    """A misuse the guard found in ``mode="raise"``; ``finding`` says what, where and the fix."""

    def __init__(self, finding: GuardFinding) -> None:
        super().__init__(str(finding))
        self.finding = finding

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.finding,))


class GuardSetupError(GradAccumError, ValueError):
    """The guard's own arguments are invalid."""


class GuardWarning(UserWarning):
    """A misuse the guard found in ``mode="warn"``; it points at the user's line."""


class BenchError(GradAccumError, ValueError):
    """A measurement that cannot be set up or summarized as asked."""


class TrainError(GradAccumError, ValueError):
    """A training run that cannot start or continue as configured."""


class CheckpointError(TrainError):
    """A checkpoint that is missing, incomplete, corrupt, or written for a different run."""


class CheckpointWriteError(GradAccumError, OSError):
    """A checkpoint could not be written (no space left, a file-size limit, permissions). The run
    failed rather than its input: the previous checkpoint is intact and resumes the run."""


class ScheduleError(GradAccumError, ValueError):
    """A schedule whose warmup, horizon or floor cannot be honoured."""
