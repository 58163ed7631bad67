"""Training with exact accumulation: ``gradaccum train`` and its library entry point :func:`train`."""

from __future__ import annotations

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
from gradaccum.train.evaluate import evaluate
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
from gradaccum.train.schedule import SKIPPED_POLICY, Schedule, ScheduleConfig, resolve_schedule

__all__ = [
    "DEFAULT_WORKLOAD",
    "SKIPPED_POLICY",
    "CheckpointError",
    "CheckpointRecord",
    "CheckpointWriteError",
    "DataPosition",
    "EvalRecord",
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
    "shard_bounds",
    "train",
]
