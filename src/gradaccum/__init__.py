"""gradaccum: exact, verified and measured gradient accumulation for PyTorch.

The library (:class:`Accumulator`, :class:`BatchPlan`, :func:`verify`, :func:`scan`, :func:`guard`,
:class:`CachedAccumulator`, the measurement and training code) needs torch alone; the command line
adds ``rich``, and plots add ``matplotlib``. ``gradaccum.train.train`` and ``gradaccum.bench`` stay in
their subpackages' namespaces (``gradaccum.check.equivalence`` here is the function; its module is
``gradaccum.check.equivalence`` in ``sys.modules`` and is imported as ``from gradaccum.check.equivalence import ...``).
"""

from __future__ import annotations

from gradaccum.batch import batch_size, split
from gradaccum.bench import (
    AcceptResult,
    AcceptSpec,
    BenchError,
    CommModel,
    Measurement,
    MeasureSettings,
    MeasureSpec,
    MemoryModel,
    SweepResult,
    SweepSpec,
    Verdict,
    comm_model,
    decide,
    fit_memory_model,
    measure,
    run_accept,
    run_sweep,
)
from gradaccum.cache.accumulator import CachedAccumulator, cached_candidate, cached_candidate_for
from gradaccum.cache.replay import CacheError
from gradaccum.check.equivalence import (
    EquivalenceReport,
    Tolerance,
    TraceReport,
    compare_traces,
    verify,
    verify_workload,
)
from gradaccum.check.workload import Workload, load_workload
from gradaccum.distributed.dist import CollectiveError
from gradaccum.distributed.sync import no_grad_sync, sync_kind
from gradaccum.errors import (
    ConfigMismatchError,
    CountError,
    CountTypeError,
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
from gradaccum.hazards.rules import GUARD_RULES, GuardConfig, GuardError, GuardFinding, GuardWarning
from gradaccum.hazards.sanitizer import Guard, guard
from gradaccum.hazards.scanner import Finding, scan
from gradaccum.loss import IGNORE_INDEX, count_examples, count_tokens, summed_cross_entropy, valid_tokens
from gradaccum.plan import BatchPlan, PlanComparison, compare_plans, factorizations, windows
from gradaccum.runcard import RunCard, read_runcard, write_runcard
from gradaccum.step.accumulator import AccumConfig, Accumulator, StepResult
from gradaccum.step.adaptive import AdaptiveMicroBatch, step_adaptive
from gradaccum.step.agreement import RankFailedError, UnusedParameterError, WindowOutOfMemoryError
from gradaccum.step.norms import grad_norm
from gradaccum.train import (
    CheckpointError,
    ScheduleConfig,
    TrainConfig,
    TrainControl,
    TrainError,
    TrainResult,
)

__version__ = "0.1.0"

__all__ = [
    "GUARD_RULES",
    "IGNORE_INDEX",
    "AcceptResult",
    "AcceptSpec",
    "AccumConfig",
    "Accumulator",
    "AdaptiveMicroBatch",
    "BatchPlan",
    "BenchError",
    "CacheError",
    "CachedAccumulator",
    "CheckpointError",
    "CollectiveError",
    "CommModel",
    "ConfigMismatchError",
    "CountError",
    "CountTypeError",
    "EquivalenceError",
    "EquivalenceReport",
    "Finding",
    "GradAccumError",
    "Guard",
    "GuardConfig",
    "GuardError",
    "GuardFinding",
    "GuardWarning",
    "LossError",
    "MeasureSettings",
    "MeasureSpec",
    "Measurement",
    "MemoryModel",
    "PlanComparison",
    "PlanError",
    "RankFailedError",
    "RunCard",
    "RunCardError",
    "ScheduleConfig",
    "StepResult",
    "SweepResult",
    "SweepSpec",
    "SyncError",
    "Tolerance",
    "TooManySkipsError",
    "TraceReport",
    "TrainConfig",
    "TrainControl",
    "TrainError",
    "TrainResult",
    "UnusedParameterError",
    "Verdict",
    "WindowError",
    "WindowOutOfMemoryError",
    "Workload",
    "WorkloadError",
    "__version__",
    "batch_size",
    "cached_candidate",
    "cached_candidate_for",
    "comm_model",
    "compare_plans",
    "compare_traces",
    "count_examples",
    "count_tokens",
    "decide",
    "factorizations",
    "fit_memory_model",
    "grad_norm",
    "guard",
    "load_workload",
    "measure",
    "no_grad_sync",
    "read_runcard",
    "run_accept",
    "run_sweep",
    "scan",
    "split",
    "step_adaptive",
    "summed_cross_entropy",
    "sync_kind",
    "valid_tokens",
    "verify",
    "verify_workload",
    "windows",
    "write_runcard",
]
