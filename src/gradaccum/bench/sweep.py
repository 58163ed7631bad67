"""The sweep: every (micro-batch, accumulation) factorization of one global batch, measured.

Runs interleave across configurations (round r measures A, B, C, ... once each), so that drift in
machine load (a neighbour's job, thermal throttling) spreads over all of them instead of landing on
whichever ran last. Each run goes through a ``launch`` function, normally
:func:`gradaccum.bench.runner.run_isolated` (a fresh process per configuration and run).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gradaccum.bench.models import CommModel, MemoryModel, comm_model, memory_model_of
from gradaccum.bench.runner import Launch
from gradaccum.bench.spec import MeasureSettings, MeasureSpec, RunRecord
from gradaccum.bench.stats import ConfigSummary, summarize
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan, factorizations

__all__ = ["ProgressEvent", "SweepResult", "SweepSpec", "interleave", "run_specs", "run_sweep"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepSpec:
    """A sweep at one fixed global batch."""

    workload: str
    """``MODULE:FUNCTION`` of the workload."""
    global_batch: int
    """Examples per optimizer update across all replicas: held fixed by every configuration."""
    dp: int = 1
    """Data-parallel replicas."""
    plans: tuple[BatchPlan, ...] | None = None
    """Configurations to measure; ``None``: every factorization of ``global_batch`` on ``dp``."""
    settings: MeasureSettings = field(default_factory=MeasureSettings)
    """How each configuration is measured: runs, steps, precision, device ..."""
    memory_budget_bytes: int | None = None
    """Report the largest micro-batch the memory model predicts fits this budget."""

    def __post_init__(self) -> None:
        if self.plans is not None and len(set(self.plans)) != len(self.plans):
            labels = [p.label() for p in self.plans]
            raise BenchError(f"the sweep lists a configuration twice: {labels}; list each once")
        for plan in self.plans or ():
            if plan.global_batch != self.global_batch or plan.dp != self.dp:
                raise BenchError(
                    f"every configuration of a sweep must reach global batch {self.global_batch} on dp="
                    f"{self.dp}; {plan.equation()} does not. Drop it or change --global-batch/--dp."
                )

    def measure_specs(self) -> list[MeasureSpec]:
        plans = self.plans if self.plans else tuple(factorizations(self.global_batch, dp=self.dp))
        return [self.settings.measure_spec(self.workload, p) for p in plans]

    def to_dict(self) -> dict[str, Any]:
        """Flat, as results.json has always had it: the settings sit beside the sweep's own fields."""
        return {
            "workload": self.workload,
            "global_batch": self.global_batch,
            "dp": self.dp,
            "plans": None if self.plans is None else [asdict(p) for p in self.plans],
            **self.settings.to_dict(),
            "memory_budget_bytes": self.memory_budget_bytes,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class ProgressEvent:
    """Reported before and after each run, for progress bars."""

    done: int
    """Runs finished so far."""
    total: int
    """Runs in all."""
    spec: Any
    """The configuration of this run (a MeasureSpec, or a PairedSpec for accept's paired runs);
    ``spec.label`` names it."""
    run_index: int
    """Which of its runs (0-based)."""
    record: Any = None
    """The finished run's record (RunRecord or PairedRecord); ``None`` when it is about to start."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepResult:
    """Every configuration summarized, the memory and communication models, and the raw runs."""

    spec: SweepSpec
    """What was swept."""
    configs: tuple[ConfigSummary, ...]
    """One summary per configuration, largest micro-batch first."""
    memory_model: MemoryModel | None
    """The fitted memory model; ``None`` when it could not be fitted (see ``memory_model_note``)."""
    memory_model_note: str | None
    """Why no model was fitted, if none was."""
    comm: tuple[CommModel | None, ...]
    """The communication model per configuration (``None`` where the configuration failed)."""
    largest_fitting_micro_batch: int | None
    """The largest micro-batch the memory model predicts fits the budget (any value, extrapolated)."""
    largest_fitting_plan: BatchPlan | None
    """The factorization of the global batch with the largest micro-batch that fits the budget."""
    records: tuple[RunRecord, ...] = field(default_factory=tuple)
    """Every run, in the order it ran."""

    @property
    def budget_advice(self) -> str | None:
        """With a memory budget: the largest factorization that fits, or why none can."""
        budget = self.spec.memory_budget_bytes
        if budget is None or self.memory_model is None:
            return None
        return self.memory_model.advice(budget, global_batch=self.spec.global_batch, dp=self.spec.dp)

    def to_dict(self) -> dict[str, Any]:
        mm = self.memory_model
        return {
            "kind": "sweep",
            "spec": self.spec.to_dict(),
            "configs": [c.to_dict() for c in self.configs],
            "memory_model": None if mm is None else asdict(mm),
            "memory_model_note": self.memory_model_note,
            "memory_predictions_bytes": [
                None if mm is None else mm.predict(c.spec.micro_batch) for c in self.configs
            ],
            "comm_model": [None if c is None else {**asdict(c), "matches": c.matches} for c in self.comm],
            "memory_budget_bytes": self.spec.memory_budget_bytes,
            "memory_budget_advice": self.budget_advice,
            "largest_fitting_micro_batch": self.largest_fitting_micro_batch,
            "largest_fitting_plan": None
            if self.largest_fitting_plan is None
            else asdict(self.largest_fitting_plan),
            "runs": [r.to_dict() for r in self.records],
        }


def interleave(specs: Sequence[MeasureSpec], runs: int) -> list[tuple[MeasureSpec, int]]:
    """Run order: A B C, A B C, ... (each round measures every configuration once)."""
    return [(spec, r) for r in range(runs) for spec in specs]


def run_jobs(
    jobs: Sequence[tuple[Any, int]],
    launch: Launch,
    on_progress: Callable[[ProgressEvent], None] | None = None,
) -> list[Any]:
    """Launch each (spec, run index) in order; failed runs are recorded, never raised."""
    records: list[Any] = []
    for done, (spec, r) in enumerate(jobs):
        if on_progress is not None:
            on_progress(ProgressEvent(done=done, total=len(jobs), spec=spec, run_index=r))
        record = launch(spec, r)
        records.append(record)
        if on_progress is not None:
            on_progress(ProgressEvent(done=done + 1, total=len(jobs), spec=spec, run_index=r, record=record))
    return records


def run_specs(
    specs: Sequence[MeasureSpec],
    runs: int,
    launch: Launch,
    on_progress: Callable[[ProgressEvent], None] | None = None,
) -> list[RunRecord]:
    """Every run of every spec, interleaved; failed runs are recorded, never raised."""
    return run_jobs(interleave(specs, runs), launch, on_progress)


def _memory(configs: Sequence[ConfigSummary]) -> tuple[MemoryModel | None, str | None]:
    model = memory_model_of([c for c in configs if c.ok])
    if model is None:
        return None, "no configuration finished with its memory measured"
    return model, None


def run_sweep(
    spec: SweepSpec, launch: Launch, *, on_progress: Callable[[ProgressEvent], None] | None = None
) -> SweepResult:
    """Measure every configuration ``spec.settings.runs`` times (interleaved) and fit the models."""
    specs = spec.measure_specs()
    records = run_specs(specs, spec.settings.runs, launch, on_progress)
    configs = tuple(summarize(s, [r for r in records if r.spec == s]) for s in specs)
    model, note = _memory(configs)
    comm = tuple(
        None
        if c.gradient_bytes is None
        else comm_model(
            c.gradient_bytes,
            c.spec.accum_steps,
            defer_sync=c.spec.defer_sync,
            measured_bytes=c.allreduce_bytes_per_update,
        )
        for c in configs
    )
    largest: int | None = None
    fitting: BatchPlan | None = None
    if model is not None and spec.memory_budget_bytes is not None:
        largest = model.largest_micro_batch(spec.memory_budget_bytes)
        feasible = factorizations(spec.global_batch, dp=spec.dp)
        fitting = next((p for p in feasible if largest is None or p.micro_batch <= largest), None)
    return SweepResult(
        spec=spec,
        configs=configs,
        memory_model=model,
        memory_model_note=note,
        comm=comm,
        largest_fitting_micro_batch=largest,
        largest_fitting_plan=fitting,
        records=tuple(records),
    )
