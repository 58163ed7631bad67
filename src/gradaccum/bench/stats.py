"""Runs of one configuration, summarized: medians and spread across runs.

Each run's figure is already a whole-run figure (throughput over all its measured updates, median
phase times); the summary takes the median across runs and reports the spread as min..max, because
with three to five runs a standard deviation says little.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradaccum.bench.memory import MemoryFigures
from gradaccum.bench.spec import Measurement, MeasureSpec, RunRecord, RunStatus
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan

__all__ = ["ConfigSummary", "Spread", "summarize"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Spread:
    """The median of one figure across runs, with its smallest and largest value."""

    median: float
    """Median across runs."""
    low: float
    """Smallest run."""
    high: float
    """Largest run."""

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise BenchError("a spread needs at least one value")
        return cls(median=float(statistics.median(values)), low=float(min(values)), high=float(max(values)))

    @property
    def relative(self) -> float:
        """(high - low) / median: how far apart the runs are, as a fraction of the median."""
        return (self.high - self.low) / self.median if self.median else float("nan")


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigSummary:
    """One configuration over all its runs."""

    spec: MeasureSpec
    """The configuration."""
    status: RunStatus
    """``ok`` when every run finished; otherwise the first problem (``oom`` before ``failed``)."""
    error: str | None
    """The first problem's message, if any."""
    runs: int
    """Runs attempted."""
    runs_ok: int
    """Runs that finished."""
    unit: str
    """What the throughput counts ("tokens", "examples")."""
    units_per_s: Spread | None
    """Valid units per second across runs."""
    step_ms: Spread | None
    """Per-run median step time at the optimizer boundary."""
    micro_ms: float | None
    """Median forward+backward time of one (non-synchronizing) micro-batch."""
    sync_ms: float | None
    """Median exposed synchronization time of the final backward (data-parallel only)."""
    optimizer_ms: float | None
    """Median optimizer phase time (the agreement, the host reads, unscale, clip and step)."""
    tokens_per_update: list[int]
    """Exact valid units of each measured update (identical in every run: same data)."""
    tokens_identical_across_runs: bool
    """Whether every run counted exactly the same units per update (it must)."""
    updates: int
    """Optimizer updates over all measured runs."""
    skipped_updates: int
    """Skipped updates over all measured runs."""
    peak_rss_bytes: float | None
    """Median across runs of the process peak RSS (CPU; fresh process per run)."""
    peak_allocated_bytes: float | None
    """Median across runs of CUDA ``max_memory_allocated`` over an update."""
    peak_reserved_bytes: float | None
    """Median across runs of CUDA ``max_memory_reserved`` over an update."""
    gradient_bytes: int | None
    """Bytes of one full gradient set."""
    allreduce_calls_per_update: int | None
    """Gradient all-reduce calls per update (data-parallel only)."""
    allreduce_bytes_per_update: int | None
    """Gradient bytes all-reduced per update per rank (data-parallel only)."""
    buckets: int | None
    """DDP buckets: all-reduce calls of one synchronized backward."""
    per_run_units_per_s: list[float]
    """Throughput of each finished run, in run order."""
    fresh_process: bool = True
    """Whether every run had a process of its own (else peak RSS includes earlier configurations)."""
    memory: MemoryFigures | None = None
    """Persistent and activation bytes from the tensors (and CUDA's peaks), from the first run."""
    allgather_calls_per_update: int | None = None
    """FSDP2: parameter all-gathers per update (first run; the same in every run)."""
    allgather_bytes_per_update: int | None = None
    """FSDP2: bytes all-gathered per update per rank."""
    reduce_scatter_calls_per_update: int | None = None
    """FSDP2: gradient reduce-scatters per update."""
    reduce_scatter_bytes_per_update: int | None = None
    """FSDP2: gradient bytes reduce-scattered per update per rank."""
    reduce_scatter_bytes_per_sync: int | None = None
    """FSDP2: bytes one synchronizing backward reduce-scatters (the padded gradient set)."""
    count_ms: float | None = None
    """Median time counting the window (and agreeing on N across ranks) before the first forward."""
    other_ms: float | None = None
    """Median over updates of the step time the timed phases leave (see ``Measurement.other_ms``)."""
    phase_means_ms: tuple[float, ...] | None = None
    """(count, micro-batches, optimizer, other, step): means per update over every run's updates.
    Means add up (step = the other four), where the table's medians need not."""
    compile_s: float | None = None
    """Compiled rows: median over runs of what compiling cost (see ``Measurement.compile_s``)."""
    recompiles: int = 0
    """Compiled rows: graphs compiled during the measured updates, summed over runs."""
    straggler: Spread | None = None
    """DDP on two or more ranks: each run's median over its updates of the slowest rank's window
    time over the ranks' mean (``Measurement.straggler``), across runs; ``None`` otherwise."""

    @property
    def comm_bytes_per_update(self) -> int | None:
        """Gradient and parameter bytes one rank communicates per update: DDP's all-reduces, or
        FSDP2's all-gathers plus reduce-scatters; ``None`` without data parallelism."""
        if self.reduce_scatter_bytes_per_update is not None:
            return self.reduce_scatter_bytes_per_update + (self.allgather_bytes_per_update or 0)
        return self.allreduce_bytes_per_update

    @property
    def plan(self) -> BatchPlan:
        return self.spec.plan

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def skip_rate(self) -> float:
        return self.skipped_updates / self.updates if self.updates else 0.0

    @property
    def peak_memory_bytes(self) -> float | None:
        """The process-level peak shown beside the memory model, never fitted by it: CUDA max allocated
        when present, else the CPU peak RSS. The model fits the bytes counted from the tensors
        (``memory``: persistent and activation bytes, :func:`gradaccum.bench.models.memory_model_of`)."""
        return self.peak_allocated_bytes if self.peak_allocated_bytes is not None else self.peak_rss_bytes

    @property
    def peak_memory_kind(self) -> str:
        if self.peak_allocated_bytes is not None:
            return "CUDA max_memory_allocated per update"
        if self.fresh_process:
            return "CPU process peak RSS (fresh process)"
        return "CPU process peak RSS (shared process: includes what ran before)"

    def to_dict(self) -> dict[str, Any]:
        def spread(s: Spread | None) -> dict[str, float] | None:
            return None if s is None else {"median": s.median, "low": s.low, "high": s.high}

        return {
            "label": self.spec.label,
            "row_label": self.spec.row_label,
            "checkpointing": self.spec.checkpointing,
            "sharding": self.spec.sharding,
            "defer_sync": self.spec.defer_sync,
            "micro_batch": self.spec.micro_batch,
            "accum_steps": self.spec.accum_steps,
            "dp": self.spec.dp,
            "global_batch": self.plan.global_batch,
            "status": self.status,
            "error": self.error,
            "runs": self.runs,
            "runs_ok": self.runs_ok,
            "unit": self.unit,
            "units_per_s": spread(self.units_per_s),
            "step_ms": spread(self.step_ms),
            "micro_ms": self.micro_ms,
            "sync_ms": self.sync_ms,
            "optimizer_ms": self.optimizer_ms,
            "count_ms": self.count_ms,
            "other_ms": self.other_ms,
            "phase_means_ms": None if self.phase_means_ms is None else list(self.phase_means_ms),
            "tokens_per_update": self.tokens_per_update,
            "tokens_identical_across_runs": self.tokens_identical_across_runs,
            "updates": self.updates,
            "skipped_updates": self.skipped_updates,
            "skip_rate": self.skip_rate,
            "peak_memory_kind": self.peak_memory_kind,
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "gradient_bytes": self.gradient_bytes,
            "allreduce_calls_per_update": self.allreduce_calls_per_update,
            "allreduce_bytes_per_update": self.allreduce_bytes_per_update,
            "buckets": self.buckets,
            "per_run_units_per_s": self.per_run_units_per_s,
            "fresh_process": self.fresh_process,
            "memory": None if self.memory is None else self.memory.to_dict(),
            "allgather_calls_per_update": self.allgather_calls_per_update,
            "allgather_bytes_per_update": self.allgather_bytes_per_update,
            "reduce_scatter_calls_per_update": self.reduce_scatter_calls_per_update,
            "reduce_scatter_bytes_per_update": self.reduce_scatter_bytes_per_update,
            "reduce_scatter_bytes_per_sync": self.reduce_scatter_bytes_per_sync,
            "comm_bytes_per_update": self.comm_bytes_per_update,
            "compile": self.spec.compile,
            "compile_s": self.compile_s,
            "recompiles": self.recompiles,
            "scaling": self.spec.scaling,
            "straggler": spread(self.straggler),
        }


def _median_of(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def summarize(spec: MeasureSpec, records: Sequence[RunRecord]) -> ConfigSummary:
    """Median and spread of ``records`` (the runs of ``spec``, in run order)."""
    if not records:
        raise BenchError(f"configuration {spec.label} has no runs to summarize")
    done: list[Measurement] = [r.measurement for r in records if r.measurement is not None]
    problems = [r for r in records if not r.ok]
    status: RunStatus = "ok"
    error = None
    for kind in ("oom", "failed", "timeout"):
        hit = next((r for r in problems if r.status == kind), None)
        if hit is not None:
            status, error = hit.status, hit.error
            break
    first = done[0] if done else None
    return ConfigSummary(
        spec=spec,
        status=status,
        error=error,
        runs=len(records),
        runs_ok=len(done),
        unit=first.unit if first else "tokens",
        units_per_s=Spread.of([m.units_per_s for m in done]) if done else None,
        step_ms=Spread.of([m.step_ms_median for m in done]) if done else None,
        micro_ms=_median_of([m.micro_ms for m in done]),
        sync_ms=_median_of([m.sync_ms for m in done]),
        optimizer_ms=_median_of([m.optimizer_ms for m in done]),
        tokens_per_update=list(first.tokens_per_update) if first else [],
        tokens_identical_across_runs=all(m.tokens_per_update == done[0].tokens_per_update for m in done),
        updates=sum(m.updates for m in done),
        skipped_updates=sum(m.skipped_updates for m in done),
        peak_rss_bytes=_median_of([m.peak_rss_bytes for m in done]),
        peak_allocated_bytes=_median_of([m.peak_allocated_bytes for m in done]),
        peak_reserved_bytes=_median_of([m.peak_reserved_bytes for m in done]),
        gradient_bytes=first.gradient_bytes if first else None,
        allreduce_calls_per_update=first.allreduce_calls_per_update if first else None,
        allreduce_bytes_per_update=first.allreduce_bytes_per_update if first else None,
        buckets=first.buckets if first else None,
        per_run_units_per_s=[m.units_per_s for m in done],
        fresh_process=all(m.fresh_process for m in done),
        memory=next((m.memory for m in done if m.memory is not None), None),
        allgather_calls_per_update=first.allgather_calls_per_update if first else None,
        allgather_bytes_per_update=first.allgather_bytes_per_update if first else None,
        reduce_scatter_calls_per_update=first.reduce_scatter_calls_per_update if first else None,
        reduce_scatter_bytes_per_update=first.reduce_scatter_bytes_per_update if first else None,
        reduce_scatter_bytes_per_sync=first.reduce_scatter_bytes_per_sync if first else None,
        count_ms=_median_of([m.count_ms for m in done]),
        other_ms=_median_of([m.other_ms for m in done]),
        phase_means_ms=_phase_means(done),
        compile_s=_median_of([m.compile_s for m in done]),
        recompiles=sum(m.recompiles for m in done),
        straggler=_straggler_spread(done),
    )


def _straggler_spread(done: Sequence[Measurement]) -> Spread | None:
    medians = [m.straggler_median for m in done]
    present = [m for m in medians if m is not None]
    return Spread.of(present) if present else None


def _phase_means(done: Sequence[Measurement]) -> tuple[float, ...] | None:
    totals = [m.phase_totals_ms for m in done]
    updates = sum(m.updates for m in done)
    if not done or updates == 0 or any(t is None for t in totals):
        return None
    return tuple(sum(t[i] for t in totals if t is not None) / updates for i in range(5))
