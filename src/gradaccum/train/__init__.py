"""Training with exact accumulation: ``gradaccum train`` and its library entry point :func:`train`."""

from __future__ import annotations

from gradaccum.train.checkpoint import CheckpointError, TrainProgress, latest_checkpoint, resolve_checkpoint
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
    "DataPosition",
    "EvalRecord",
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
    "evaluate",
    "latest_checkpoint",
    "plot_loss",
    "read_metrics",
    "resolve_checkpoint",
    "resolve_schedule",
    "shard_bounds",
    "train",
]
