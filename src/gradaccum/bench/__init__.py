"""Measurement: timing, memory, communication counts, sweeps and the adoption verdict.

Needs torch alone; the PNG plots import matplotlib when they are drawn. The worker entry point
(``python -m gradaccum.bench.worker``) is not imported here, so that running it imports it once.
"""

from __future__ import annotations

from gradaccum.bench.accept import (
    AcceptResult,
    AcceptSpec,
    Equivalence,
    check_equivalence,
    run_accept,
    with_quality,
)
from gradaccum.bench.advisor import Advice, Row, advise
from gradaccum.bench.checkpointing import CheckpointingCheck, apply_checkpointing, check_checkpointing
from gradaccum.bench.measure import measure, measure_safely
from gradaccum.bench.models import CommModel, MemoryModel, comm_model, fit_memory_model
from gradaccum.bench.quality import QualityResult, QualitySpec, run_quality
from gradaccum.bench.runfolder import new_run_folder, write_accept_folder, write_sweep_folder
from gradaccum.bench.runner import Launch, run_isolated, run_joined
from gradaccum.bench.spec import Measurement, MeasureSettings, MeasureSpec, RunRecord
from gradaccum.bench.stats import ConfigSummary, Spread, summarize
from gradaccum.bench.sweep import ProgressEvent, SweepResult, SweepSpec, run_sweep
from gradaccum.bench.verdict import ArmFigures, Criterion, ParamCheck, TraceCheck, Verdict, decide
from gradaccum.distributed.comm import CommCounter, count_allreduces

__all__ = [
    "AcceptResult",
    "AcceptSpec",
    "Advice",
    "ArmFigures",
    "BenchError",
    "CheckpointingCheck",
    "CommCounter",
    "CommModel",
    "ConfigSummary",
    "Criterion",
    "Equivalence",
    "Launch",
    "MeasureSettings",
    "MeasureSpec",
    "Measurement",
    "MemoryModel",
    "ParamCheck",
    "ProgressEvent",
    "QualityResult",
    "QualitySpec",
    "Row",
    "RunRecord",
    "Spread",
    "SweepResult",
    "SweepSpec",
    "TraceCheck",
    "Verdict",
    "advise",
    "apply_checkpointing",
    "check_checkpointing",
    "check_equivalence",
    "comm_model",
    "count_allreduces",
    "decide",
    "fit_memory_model",
    "measure",
    "measure_safely",
    "new_run_folder",
    "run_accept",
    "run_isolated",
    "run_joined",
    "run_quality",
    "run_sweep",
    "summarize",
    "with_quality",
    "write_accept_folder",
    "write_sweep_folder",
]
