"""gradaccum: exact, verified and measured gradient accumulation for PyTorch.

The core (:class:`Accumulator`, :class:`BatchPlan`) needs torch alone; the command line adds
``rich`` and ``matplotlib``.
"""

from __future__ import annotations

from gradaccum.batching import batch_size, split
from gradaccum.errors import (
    ConfigMismatchError,
    CountError,
    EquivalenceError,
    GradAccumError,
    LossError,
    PlanError,
    RunCardError,
    SyncError,
    TooManySkipsError,
    WindowError,
    WorkloadError,
)
from gradaccum.loss import IGNORE_INDEX, count_examples, count_tokens, summed_cross_entropy, valid_tokens
from gradaccum.norms import grad_norm
from gradaccum.plan import BatchPlan, PlanComparison, compare_plans, factorizations, windows
from gradaccum.step import AccumConfig, Accumulator, StepResult
from gradaccum.sync import no_grad_sync, sync_kind
from gradaccum.workload import Workload, load_workload

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "AccumConfig",
    "Accumulator",
    "BatchPlan",
    "ConfigMismatchError",
    "CountError",
    "EquivalenceError",
    "GradAccumError",
    "LossError",
    "PlanComparison",
    "PlanError",
    "RunCardError",
    "StepResult",
    "SyncError",
    "TooManySkipsError",
    "WindowError",
    "Workload",
    "WorkloadError",
    "__version__",
    "batch_size",
    "compare_plans",
    "count_examples",
    "count_tokens",
    "factorizations",
    "grad_norm",
    "load_workload",
    "no_grad_sync",
    "split",
    "summed_cross_entropy",
    "sync_kind",
    "valid_tokens",
    "windows",
]
