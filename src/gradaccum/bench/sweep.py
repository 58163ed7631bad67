"""The sweep: every (micro-batch, accumulation) factorization of one global batch, measured.

Further dimensions multiply the rows: activation checkpointing (``none``/``full``) and, under data
parallelism, sharding (``ddp``/``fsdp2``). An FSDP2 row is measured twice, with gradient sync
deferred and on every micro-batch, because deferral under FSDP2 is a trade and not a free win:
it reduce-scatters once per update instead of k times, but every rank keeps the unsharded
gradients until the final micro-batch. With a memory budget the advisor
(:mod:`gradaccum.bench.advisor`) picks the fastest row that fits, and the result carries a run
card for it.

Runs interleave across configurations (round r measures A, B, C, ... once each), so that drift in
machine load (a neighbour's job, thermal throttling) spreads over all of them instead of landing on
whichever ran last. Each run goes through a ``launch`` function, normally
:func:`gradaccum.bench.runner.run_isolated` (a fresh process per configuration and run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gradaccum.bench.advisor import Advice, Row, advise
from gradaccum.bench.models import CommModel, MemoryModel, comm_model, memory_model_of
from gradaccum.bench.runner import Launch
from gradaccum.bench.spec import CHECKPOINTING, MeasureSettings, MeasureSpec, RunRecord
from gradaccum.bench.stats import ConfigSummary, summarize
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan, factorizations
from gradaccum.runcard import RunCard
from gradaccum.step.config import AccumConfig

if TYPE_CHECKING:
    from gradaccum.bench.checkpointing import CheckpointingCheck

__all__ = [
    "SHARDING",
    "ProgressEvent",
    "SweepResult",
    "SweepSpec",
    "advised_runcard",
    "comm_of",
    "interleave",
    "run_jobs",
    "run_specs",
    "run_sweep",
]

SHARDING = ("ddp", "fsdp2")
"""``ddp``: every rank holds the whole model (DDP under data parallelism; the model as it is on
one process); ``fsdp2``: FSDP2 ``fully_shard`` of each repeated block and the root."""


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
    """Per rank: report the largest micro-batch the memory model predicts fits this budget, and
    advise the fastest measured row that fits it."""
    checkpointing: tuple[str, ...] = ("none",)
    """Activation checkpointing modes to measure each configuration with (``none``, ``full``)."""
    sharding: tuple[str, ...] = ("ddp",)
    """Sharding to measure each configuration with (:data:`SHARDING`; ``fsdp2`` needs dp > 1)."""
    compile: tuple[bool, ...] = (False,)
    """Eager (False) and/or compiled (True) models: ``bench --compile`` measures both."""
    max_tokens: tuple[int, ...] = ()
    """Token-budget arms beside the fixed configurations, at the same global batch: each update's
    global batch cut by :func:`gradaccum.split_by_tokens` within each budget (``bench
    --max-tokens``). They are measured like the others but left out of the memory model (which is
    a line in the micro-batch) and of the advice."""

    def __post_init__(self) -> None:
        for name, allowed in (("checkpointing", CHECKPOINTING), ("sharding", SHARDING)):
            values = getattr(self, name)
            if not values or any(v not in allowed for v in values) or len(set(values)) != len(values):
                raise BenchError(
                    f"{name} must list each of {allowed} at most once (at least one), got {list(values)}"
                )
        if not self.compile or len(set(self.compile)) != len(self.compile):
            raise BenchError(f"compile must list False and/or True once each, got {list(self.compile)}")
        if "fsdp2" in self.sharding and self.dp < 2:
            raise BenchError(
                "--sharding fsdp2 needs data parallelism (--dp 2 or more): on one rank nothing is sharded"
            )
        if len(set(self.max_tokens)) != len(self.max_tokens) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.max_tokens
        ):
            raise BenchError(f"max_tokens must list positive budgets once each, got {list(self.max_tokens)}")
        if self.max_tokens and self.global_batch % self.dp:
            raise BenchError(
                f"a token-budget arm holds global batch {self.global_batch} as rows per rank: it must be a "
                f"multiple of dp={self.dp}"
            )
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
        """Every row: each plan (largest micro-batch first) x sharding x checkpointing x compile,
        and for FSDP2 rows sync deferral on and off."""
        plans = self.plans if self.plans else tuple(factorizations(self.global_batch, dp=self.dp))
        window = BatchPlan(micro_batch=self.global_batch // self.dp, accum_steps=1, dp=self.dp)
        arms = [(plan, None) for plan in plans] + [(window, n) for n in self.max_tokens]
        specs = []
        for plan, budget in arms:
            base = self.settings.measure_spec(self.workload, plan, max_tokens=budget)
            for sharding in self.sharding:
                fsdp = sharding == "fsdp2"
                for mode in self.checkpointing:
                    for defer in (True, False) if fsdp else (self.settings.defer_sync,):
                        for compiled in self.compile:
                            specs.append(
                                dataclasses.replace(
                                    base, checkpointing=mode, fsdp=fsdp, defer_sync=defer, compile=compiled
                                )
                            )
        return specs

    def to_dict(self) -> dict[str, Any]:
        """Flat, as results.json has always had it: the settings sit beside the sweep's own fields."""
        return {
            "workload": self.workload,
            "global_batch": self.global_batch,
            "dp": self.dp,
            "plans": None if self.plans is None else [asdict(p) for p in self.plans],
            **{k: v for k, v in self.settings.to_dict().items() if k not in ("compile", "balance")},
            "memory_budget_bytes": self.memory_budget_bytes,
            "checkpointing": list(self.checkpointing),
            "sharding": list(self.sharding),
            "compile": list(self.compile),
            "max_tokens": list(self.max_tokens),
            "balance": self.settings.balance,  # appended (issue 41): a routing model's load balance
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
    advice: Advice | None = None
    """With a memory budget: the fastest measured row that fits it, and why."""
    checkpointing_check: CheckpointingCheck | None = None
    """With checkpointing in the sweep: checkpointed against plain, one float64 update."""
    card: RunCard | None = None
    """The run card of the advised row (``None`` without a budget, or when nothing fits)."""

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
                None if mm is None or c.spec.max_tokens is not None else mm.predict(c.spec.micro_batch)
                for c in self.configs
            ],
            "comm_model": [None if c is None else {**asdict(c), "matches": c.matches} for c in self.comm],
            "memory_budget_bytes": self.spec.memory_budget_bytes,
            "memory_budget_advice": self.budget_advice,
            "largest_fitting_micro_batch": self.largest_fitting_micro_batch,
            "largest_fitting_plan": None
            if self.largest_fitting_plan is None
            else asdict(self.largest_fitting_plan),
            "runs": [r.to_dict() for r in self.records],
            "advice": None if self.advice is None else self.advice.to_dict(),
            "checkpointing_check": None
            if self.checkpointing_check is None
            else {**asdict(self.checkpointing_check), "passed": self.checkpointing_check.passed},
            "runcard": None if self.card is None else self.card.to_dict(),
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
        return None, "no plain configuration (no checkpointing, no FSDP2) finished with its memory measured"
    return model, None


def comm_of(c: ConfigSummary) -> CommModel | None:
    """k x G against 1 x G: DDP's G is the gradient set, FSDP2's the padded set it reduce-scatters
    per synchronizing backward, measured (each parameter's dim 0 is padded to a multiple of dp)."""
    if c.spec.max_tokens is not None and not c.spec.defer_sync:
        return None  # k varies per update: the model of k syncs does not apply
    if c.spec.fsdp:
        per_sync, measured = c.reduce_scatter_bytes_per_sync, c.reduce_scatter_bytes_per_update
    else:
        per_sync, measured = c.gradient_bytes, c.allreduce_bytes_per_update
    if per_sync is None:
        return None
    return comm_model(per_sync, c.spec.accum_steps, defer_sync=c.spec.defer_sync, measured_bytes=measured)


def advised_runcard(
    spec: SweepSpec, advice: Advice, configs: Sequence[ConfigSummary], environment: dict[str, Any]
) -> RunCard | None:
    """The card of the advised row, with the accumulator settings it was measured with; ``None``
    when nothing was chosen. ``train --runcard`` replays the plan, precision and accumulator
    settings; checkpointing and sharding are recorded in ``extra`` (train does not apply them)."""
    chosen = advice.chosen
    if chosen is None:
        return None
    summary = next(c for c in configs if c.spec.row_label == chosen.label)
    settings = spec.settings
    return RunCard(
        workload=spec.workload,
        plan=chosen.plan,
        accum=AccumConfig(max_grad_norm=settings.max_grad_norm, defer_sync=chosen.defer_sync),
        precision=settings.precision,
        optimizer="workload",
        denominator=summary.unit,
        tokens_per_step=summary.tokens_per_update[0] if summary.tokens_per_update else None,
        seed=settings.seed,
        versions=dict(environment.get("versions", {})),
        device=str(environment.get("device", settings.device)),
        git_commit=environment.get("git_commit"),
        compile=summary.spec.compile,
        max_tokens=summary.spec.max_tokens,  # a budget row: train cuts its windows by the same budget
        extra={
            "source": "gradaccum bench --memory-budget",
            "advice": advice.sentence,
            "row": chosen.label,
            "checkpointing": chosen.checkpointing,
            "fsdp": chosen.fsdp,
            "memory_budget_bytes": advice.budget_bytes,
            "memory_bytes": chosen.memory_bytes,
            "memory_kind": chosen.memory_kind,
            "units_per_s": chosen.units_per_s,
            "not_replayed": "gradaccum train --runcard takes the plan, precision and accumulator "
            "settings; it does not apply checkpointing, and FSDP2 needs train --fsdp",
        },
    )


def run_sweep(
    spec: SweepSpec,
    launch: Launch,
    *,
    on_progress: Callable[[ProgressEvent], None] | None = None,
    environment: dict[str, Any] | None = None,
    checkpointing_check: CheckpointingCheck | None = None,
) -> SweepResult:
    """Measure every configuration ``spec.settings.runs`` times (interleaved), fit the models and,
    with a budget, advise. ``environment`` (versions, device, commit) goes into the advised row's
    run card; ``checkpointing_check``, checked beforehand in this process, into the result."""
    specs = spec.measure_specs()
    records = run_specs(specs, spec.settings.runs, launch, on_progress)
    configs = tuple(summarize(s, [r for r in records if r.spec == s]) for s in specs)
    model, note = _memory(configs)
    comm = tuple(comm_of(c) for c in configs)
    largest: int | None = None
    fitting: BatchPlan | None = None
    if model is not None and spec.memory_budget_bytes is not None:
        largest = model.largest_micro_batch(spec.memory_budget_bytes)
        feasible = factorizations(spec.global_batch, dp=spec.dp)
        fitting = next((p for p in feasible if largest is None or p.micro_batch <= largest), None)
    advice = card = None
    if spec.memory_budget_bytes is not None:
        fixed = [c for c in configs if c.spec.max_tokens is None]  # a card records a fixed plan
        rows = [row for row in map(Row.of, fixed) if row is not None]
        advice = advise(rows, spec.memory_budget_bytes, global_batch=spec.global_batch)
        card = advised_runcard(spec, advice, configs, environment or {})
    return SweepResult(
        spec=spec,
        configs=configs,
        memory_model=model,
        memory_model_note=note,
        comm=comm,
        largest_fitting_micro_batch=largest,
        largest_fitting_plan=fitting,
        records=tuple(records),
        advice=advice,
        checkpointing_check=checkpointing_check,
        card=card,
    )
