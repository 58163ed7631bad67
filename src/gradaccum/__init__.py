"""gradaccum: exact, verified and measured gradient accumulation for PyTorch.

The names below are what a user calls: the step, the plan, counting and loss helpers, the checks,
their reports, and the errors worth catching. Each is imported on first use, so ``import
gradaccum`` costs nothing and never pulls in the measurement (``gradaccum.bench``), the training
front end (``gradaccum.train``), ``torch.distributed.checkpoint``, matplotlib or rich. Everything
else lives in its feature's folder: ``gradaccum.step``, ``gradaccum.cache``, ``gradaccum.check``,
``gradaccum.hazards``, ``gradaccum.distributed``, ``gradaccum.bench``, ``gradaccum.train``,
``gradaccum.rl`` (policy and preference losses) and ``gradaccum.moe`` (MoE load balancing), both
reachable without an import; every exception
class is in ``gradaccum.errors``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradaccum.lazy import lazy_exports

__version__ = "0.2.0"

_EXPORTS: dict[str, str] = {
    # the exact step
    "Accumulator": "gradaccum.step.accumulator",
    "AccumConfig": "gradaccum.step.config",
    "StepResult": "gradaccum.step.config",
    "NoiseScale": "gradaccum.step.noise",
    "CachedAccumulator": "gradaccum.cache.accumulator",
    "AdaptiveMicroBatch": "gradaccum.step.adaptive",
    "step_adaptive": "gradaccum.step.adaptive",
    # the plan and its windows
    "BatchPlan": "gradaccum.plan",
    "windows": "gradaccum.plan",
    "split": "gradaccum.batch",
    "split_by_tokens": "gradaccum.tokens.split",
    # counting and summed losses
    "count_tokens": "gradaccum.loss",
    "count_examples": "gradaccum.loss",
    "summed_cross_entropy": "gradaccum.loss",
    "CausalLMLoss": "gradaccum.loss",
    "pack": "gradaccum.packing",
    # the checks
    "verify": "gradaccum.check.equivalence",
    "verify_workload": "gradaccum.check.equivalence",
    "audit_count": "gradaccum.check.audit",
    "verify_packed": "gradaccum.check.packed",
    "compare_traces": "gradaccum.check.traces",
    "scan": "gradaccum.hazards.scanner",
    "guard": "gradaccum.hazards.sanitizer",
    "Workload": "gradaccum.workloads.base",
    # their reports
    "EquivalenceReport": "gradaccum.check.report",
    "PackedReport": "gradaccum.check.packed",
    "TraceReport": "gradaccum.check.report",
    "Finding": "gradaccum.hazards.scanner",
    # the errors a caller catches (every class is in gradaccum.errors)
    "GradAccumError": "gradaccum.errors",
    "ConfigError": "gradaccum.errors",
    "PlanError": "gradaccum.errors",
    "WindowError": "gradaccum.errors",
    "CountError": "gradaccum.errors",
    "LossError": "gradaccum.errors",
    "SyncError": "gradaccum.errors",
    "RankFailedError": "gradaccum.errors",
    "WindowOutOfMemoryError": "gradaccum.errors",
    "TooManySkipsError": "gradaccum.errors",
    "EquivalenceError": "gradaccum.errors",
    "WorkloadError": "gradaccum.errors",
}

__all__ = [
    "AccumConfig",
    "Accumulator",
    "AdaptiveMicroBatch",
    "BatchPlan",
    "CachedAccumulator",
    "CausalLMLoss",
    "ConfigError",
    "CountError",
    "EquivalenceError",
    "EquivalenceReport",
    "Finding",
    "GradAccumError",
    "LossError",
    "NoiseScale",
    "PackedReport",
    "PlanError",
    "RankFailedError",
    "StepResult",
    "SyncError",
    "TooManySkipsError",
    "TraceReport",
    "WindowError",
    "WindowOutOfMemoryError",
    "Workload",
    "WorkloadError",
    "__version__",
    "audit_count",
    "compare_traces",
    "count_examples",
    "count_tokens",
    "guard",
    "pack",
    "scan",
    "split",
    "split_by_tokens",
    "step_adaptive",
    "summed_cross_entropy",
    "verify",
    "verify_packed",
    "verify_workload",
    "windows",
]
"""The public API; each name but ``__version__`` is imported from its module on first use."""

if TYPE_CHECKING:
    from gradaccum.batch import split
    from gradaccum.cache.accumulator import CachedAccumulator
    from gradaccum.check.audit import audit_count
    from gradaccum.check.equivalence import verify, verify_workload
    from gradaccum.check.packed import PackedReport, verify_packed
    from gradaccum.check.report import EquivalenceReport, TraceReport
    from gradaccum.check.traces import compare_traces
    from gradaccum.errors import (
        ConfigError,
        CountError,
        EquivalenceError,
        GradAccumError,
        LossError,
        PlanError,
        RankFailedError,
        SyncError,
        TooManySkipsError,
        WindowError,
        WindowOutOfMemoryError,
        WorkloadError,
    )
    from gradaccum.hazards.sanitizer import guard
    from gradaccum.hazards.scanner import Finding, scan
    from gradaccum.loss import CausalLMLoss, count_examples, count_tokens, summed_cross_entropy
    from gradaccum.packing import pack
    from gradaccum.plan import BatchPlan, windows
    from gradaccum.step.accumulator import Accumulator
    from gradaccum.step.adaptive import AdaptiveMicroBatch, step_adaptive
    from gradaccum.step.config import AccumConfig, StepResult
    from gradaccum.step.noise import NoiseScale
    from gradaccum.tokens.split import split_by_tokens
    from gradaccum.workloads.base import Workload


_SUBPACKAGES = ("rl", "moe")
"""Feature folders reachable as ``gradaccum.<name>`` without an import (``gradaccum.rl.PolicyLoss``);
each is itself lazy."""


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__, subpackages=_SUBPACKAGES)
