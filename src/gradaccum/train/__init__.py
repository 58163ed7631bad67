"""Training with exact accumulation: ``gradaccum train`` and its library entry point :func:`train`.

The names are imported on first use (as in :mod:`gradaccum`), so that the command line reads
:class:`TrainSpec` and the defaults of :mod:`gradaccum.train.spec` without importing torch. No
submodule may share an exported name (importing ``gradaccum.train.X`` binds ``X`` to the module):
:func:`evaluate` lives in ``evaluation.py`` for that reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradaccum.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "BatchChange": "gradaccum.train.batch_schedule",
    "CriticalBatchConfig": "gradaccum.train.batch_schedule",
    "CriticalBatchSchedule": "gradaccum.train.batch_schedule",
    "CheckpointError": "gradaccum.train.checkpoint",
    "CheckpointWriteError": "gradaccum.train.checkpoint",
    "ResumePoint": "gradaccum.train.checkpoint",
    "TrainProgress": "gradaccum.train.checkpoint",
    "checkpoint_problem": "gradaccum.train.checkpoint",
    "find_intact": "gradaccum.train.checkpoint",
    "latest_checkpoint": "gradaccum.train.checkpoint",
    "remove_partial_checkpoints": "gradaccum.train.checkpoint",
    "resolve_checkpoint": "gradaccum.train.checkpoint",
    "DEFAULT_WORKLOAD": "gradaccum.train.config",
    "TrainConfig": "gradaccum.train.config",
    "TrainError": "gradaccum.train.config",
    "DataPosition": "gradaccum.train.data",
    "ShardedStream": "gradaccum.train.data",
    "shard_bounds": "gradaccum.train.data",
    "evaluate": "gradaccum.train.evaluation",
    "TrainControl": "gradaccum.train.loop",
    "TrainResult": "gradaccum.train.loop",
    "train": "gradaccum.train.loop",
    "CheckpointRecord": "gradaccum.train.records",
    "EvalRecord": "gradaccum.train.records",
    "StepRecord": "gradaccum.train.records",
    "TrainEvent": "gradaccum.train.records",
    "TrainStart": "gradaccum.train.records",
    "plot_loss": "gradaccum.train.records",
    "read_metrics": "gradaccum.train.records",
    "SKIPPED_POLICY": "gradaccum.train.schedule",
    "Schedule": "gradaccum.train.schedule",
    "ScheduleConfig": "gradaccum.train.schedule",
    "resolve_schedule": "gradaccum.train.schedule",
    "TrainSpec": "gradaccum.train.spec",
    "ResolvedSpec": "gradaccum.train.resolve",
    "resolve_spec": "gradaccum.train.resolve",
}

__all__ = [
    "DEFAULT_WORKLOAD",
    "SKIPPED_POLICY",
    "BatchChange",
    "CheckpointError",
    "CheckpointRecord",
    "CheckpointWriteError",
    "CriticalBatchConfig",
    "CriticalBatchSchedule",
    "DataPosition",
    "EvalRecord",
    "ResolvedSpec",
    "ResumePoint",
    "Schedule",
    "ScheduleConfig",
    "ShardedStream",
    "StepRecord",
    "TrainConfig",
    "TrainControl",
    "TrainError",
    "TrainEvent",
    "TrainProgress",
    "TrainResult",
    "TrainSpec",
    "TrainStart",
    "checkpoint_problem",
    "evaluate",
    "find_intact",
    "latest_checkpoint",
    "plot_loss",
    "read_metrics",
    "remove_partial_checkpoints",
    "resolve_checkpoint",
    "resolve_schedule",
    "resolve_spec",
    "shard_bounds",
    "train",
]

if TYPE_CHECKING:
    from gradaccum.train.batch_schedule import BatchChange, CriticalBatchConfig, CriticalBatchSchedule
    from gradaccum.train.checkpoint import (
        CheckpointError,
        CheckpointWriteError,
        ResumePoint,
        TrainProgress,
        checkpoint_problem,
        find_intact,
        latest_checkpoint,
        remove_partial_checkpoints,
        resolve_checkpoint,
    )
    from gradaccum.train.config import DEFAULT_WORKLOAD, TrainConfig, TrainError
    from gradaccum.train.data import DataPosition, ShardedStream, shard_bounds
    from gradaccum.train.evaluation import evaluate
    from gradaccum.train.loop import TrainControl, TrainResult, train
    from gradaccum.train.records import (
        CheckpointRecord,
        EvalRecord,
        StepRecord,
        TrainEvent,
        TrainStart,
        plot_loss,
        read_metrics,
    )
    from gradaccum.train.resolve import ResolvedSpec, resolve_spec
    from gradaccum.train.schedule import SKIPPED_POLICY, Schedule, ScheduleConfig, resolve_schedule
    from gradaccum.train.spec import TrainSpec


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
