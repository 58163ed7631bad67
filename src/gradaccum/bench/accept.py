"""The acceptance protocol: verify both partitionings, measure both side by side, decide, record.

1. the float64 equivalence check of each partitioning against the full batch (``verify``, with its
   denominator audit);
2. the production-precision loss and gradient-norm traces of both, over a declared window, with
   the training settings (clipping, skip policy) that change the update;
3. memory: one short run of each configuration in a fresh process (persistent and activation bytes
   from the tensors; on CUDA the allocator's peaks; the process's peak RSS);
4. throughput: at least three paired runs, each a fresh process that holds both configurations and
   alternates them in short blocks (A B, B A, ...), so that drift lands on both arms of a pair;
5. the adoption rule (:func:`gradaccum.bench.verdict.decide`): ADOPT, KEEP BASELINE or
   INCONCLUSIVE, from the paired block ratios and a confidence interval of the gain;
6. a run card for the configuration to use, with every setting that changes the update, so that
   ``train --runcard`` trains exactly what was verified and measured;
7. what the scan finds that the float64 check had to switch off or could not make exact
   (BatchNorm, random layers, MoE statistics): the reasons a representative quality run is needed;
   with ``quality_steps`` set, that run (:mod:`gradaccum.bench.quality`: both configurations trained
   from several seeds, final evaluation loss compared), added by :func:`with_quality` after the
   measurements, on one process.

The checks (1, 2) run in this process with the workload imported here; the measurements (3, 4) go
through a ``launch`` function, normally fresh worker processes.

Each arm is a plan and a scaling (``AccumConfig.scaling``, ``pre`` by default): comparing
``pre`` against ``post`` at one plan runs the same protocol, each arm's float64 check, traces,
memory and timing with its own scaling, and the run card records the chosen arm's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from gradaccum.bench.models import CommModel, MemoryModel, memory_model_of
from gradaccum.bench.quality import MIN_SEEDS, QualityResult, QualitySpec, quality_reasons
from gradaccum.bench.runner import Launch
from gradaccum.bench.spec import (
    MeasureSettings,
    MeasureSpec,
    PairedRecord,
    PairedSpec,
    RunRecord,
    check_scaling,
)
from gradaccum.bench.stats import ConfigSummary, summarize
from gradaccum.bench.sweep import ProgressEvent, comm_of, run_jobs
from gradaccum.bench.verdict import (
    DEFAULT_MARGIN,
    MIN_RUNS,
    ArmFigures,
    ParamCheck,
    TraceCheck,
    Verdict,
    decide,
)
from gradaccum.check.workload import DEFAULT_WORKLOAD, Workload
from gradaccum.errors import BenchError, PlanError
from gradaccum.plan import BatchPlan
from gradaccum.precision import dtype_of
from gradaccum.runcard import RunCard
from gradaccum.step.config import AccumConfig, Scaling
from gradaccum.values import require_int

__all__ = [
    "ACCEPT_SETTINGS",
    "DEFAULT_WORKLOAD",
    "AcceptResult",
    "AcceptSpec",
    "Arm",
    "Equivalence",
    "check_equivalence",
    "make_runcard",
    "run_accept",
    "with_quality",
]

ACCEPT_SETTINGS = MeasureSettings(runs=MIN_RUNS, steps=50, max_grad_norm=1.0)
"""The measurement settings of an acceptance run unless given: the protocol's minimum of runs,
longer runs than a sweep's (a verdict rests on two configurations only), and training's default
clipping, so that what is measured is what ``train`` will run."""
DEFAULT_BLOCK_UPDATES = 5
MIN_BLOCKS = 4
"""Fewer block pairs per run than this are refused as too short to measure."""
MEMORY_PROBE_UPDATES = 2
Arm = Literal["baseline", "candidate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AcceptSpec:
    """An accumulation change to accept or refuse: baseline and candidate at one global batch."""

    workload: str = DEFAULT_WORKLOAD
    """``MODULE:FUNCTION`` of the workload."""
    baseline: BatchPlan
    """The configuration in use."""
    candidate: BatchPlan
    """The proposed one; it must reach the same global batch."""
    margin: float = DEFAULT_MARGIN
    """Required median throughput gain (0.03 = 3 %)."""
    trace_steps: int = 8
    """Updates in the production-precision trace comparison (the declared window)."""
    settings: MeasureSettings = ACCEPT_SETTINGS
    """How both configurations are measured (at least three runs each): ``steps`` timed updates
    of each per run, in blocks of ``block_updates``. Its precision (float16 implies a GradScaler),
    ``max_grad_norm``, ``defer_sync``, device and seed are also those of the checks and the
    traces, and go in the run card."""
    block_updates: int = DEFAULT_BLOCK_UPDATES
    """Updates per block of a paired run: short enough that drift within a pair is small, long
    enough that a block's time is well above the clock's and the scheduler's noise."""
    max_consecutive_skips: int | None = 10
    """The skip limit training will use (recorded in the run card; it does not change timing)."""
    memory_budget_bytes: int | None = None
    """Say which micro-batch fits this budget, or that nothing does (the persistent term)."""
    quality_steps: int | None = None
    """Train both configurations this many updates per seed and compare their final evaluation
    loss (the representative quality run); ``None``: not run."""
    quality_seeds: int = 3
    """Seeds per configuration of the quality run (two or more: an interval needs them)."""
    quality_eval_examples: int = 64
    """Held-out examples of each quality run's final evaluation."""
    baseline_scaling: Scaling = "pre"
    """The baseline's ``AccumConfig.scaling``: ``pre`` or ``post`` (see :mod:`gradaccum.step.stream`)."""
    candidate_scaling: Scaling = "pre"
    """The candidate's: ``post`` against a ``pre`` baseline at the same plan compares the two modes."""

    def __post_init__(self) -> None:
        b, c = self.baseline, self.candidate
        if b.global_batch != c.global_batch:
            hint = ""
            per_pass = c.micro_batch * c.dp
            if b.global_batch % per_pass == 0:
                fixed = BatchPlan.solve(global_batch=b.global_batch, micro_batch=c.micro_batch, dp=c.dp)
                hint = (
                    f" To keep micro-batch {c.micro_batch} on dp={c.dp}, use accumulation "
                    f"{fixed.accum_steps} ({fixed.label()})."
                )
            raise PlanError(
                f"baseline {b.label()} has global batch {b.global_batch} ({b.equation()}) but candidate "
                f"{c.label()} has global batch {c.global_batch} ({c.equation()}). accept compares "
                "accumulation mechanics at a fixed global batch; a different global batch changes the "
                "optimization (updates, noise, tuned learning rate) and is not an accumulation change." + hint
            )
        if self.settings.runs < MIN_RUNS:
            raise BenchError(
                f"runs must be an integer >= {MIN_RUNS} (the protocol's minimum), got {self.settings.runs!r}"
            )
        if (
            isinstance(self.trace_steps, bool)
            or not isinstance(self.trace_steps, int)
            or self.trace_steps < 1
        ):
            raise BenchError(f"trace_steps must be a positive integer, got {self.trace_steps!r}")
        margin = self.margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < float("inf"):
            raise BenchError(f"margin must be a non-negative fraction (0.03 = 3%), got {margin!r}")
        require_int("block_updates", self.block_updates, error=BenchError)
        least = MIN_BLOCKS * self.block_updates
        if self.settings.steps < least:
            raise BenchError(
                f"--steps {self.settings.steps} is too short to measure: each run alternates the two "
                f"configurations in blocks of {self.block_updates} updates, and fewer than {MIN_BLOCKS} "
                f"block pairs per run give a confidence interval that rests on a handful of ratios; "
                f"use --steps {least} or more (or a smaller --block-updates)"
            )
        require_int("quality_steps", self.quality_steps, error=BenchError, none_ok=True)
        require_int("quality_seeds", self.quality_seeds, low=MIN_SEEDS, error=BenchError)
        require_int("quality_eval_examples", self.quality_eval_examples, error=BenchError)
        for scaling in (self.baseline_scaling, self.candidate_scaling):
            check_scaling(scaling)
        if "post" in self.scalings and b.dp > 1 and not self.settings.defer_sync:
            raise BenchError(
                f"scaling 'post' under data parallelism (dp={b.dp}) synchronizes on the last "
                "micro-batch only (a rank does not know its window's length before it); measuring it "
                "without deferred sync cannot run. Keep sync deferred, or compare 'pre' arms."
            )
        _ = self.accum  # a malformed skip limit is refused now
        _ = self.quality_spec()  # and so is a quality run that cannot be set up
        self.measure_spec(self.baseline)  # a malformed workload is refused now, not after the checks

    @property
    def scalings(self) -> tuple[Scaling, Scaling]:
        """(baseline's, candidate's) ``AccumConfig.scaling``."""
        return self.baseline_scaling, self.candidate_scaling

    def plan_of(self, arm: Arm) -> BatchPlan:
        return self.baseline if arm == "baseline" else self.candidate

    def scaling_of(self, arm: Arm) -> Scaling:
        return self.baseline_scaling if arm == "baseline" else self.candidate_scaling

    def label_of(self, arm: Arm) -> str:
        """The arm's plan (``4x8``), with its scaling once either arm post-scales (``4x8 post``),
        so that a comparison of the two modes at one plan names its arms apart."""
        label = self.plan_of(arm).label()
        return f"{label} {self.scaling_of(arm)}" if "post" in self.scalings else label

    def accum_of(self, arm: Arm) -> AccumConfig:
        """The accumulator settings of one arm: :attr:`accum` with that arm's scaling."""
        return dataclasses.replace(self.accum, scaling=self.scaling_of(arm))

    def arm_spec(self, arm: Arm) -> MeasureSpec:
        """One arm measured with these settings and its own scaling."""
        return self.measure_spec(self.plan_of(arm), scaling=self.scaling_of(arm))

    @property
    def blocks(self) -> int:
        """Blocks of each configuration per paired run."""
        return self.settings.steps // self.block_updates

    @property
    def accum(self) -> AccumConfig:
        """The accumulator settings training will use, as measured and recorded, with the
        baseline's scaling (:meth:`accum_of` gives either arm's)."""
        return AccumConfig(
            max_grad_norm=self.settings.max_grad_norm,
            defer_sync=self.settings.defer_sync,
            max_consecutive_skips=self.max_consecutive_skips,
            scaling=self.baseline_scaling,
        )

    def quality_spec(self) -> QualitySpec | None:
        """The quality run of both configurations with the measured settings; ``None`` if not asked for."""
        if self.quality_steps is None:
            return None
        return QualitySpec(
            workload=self.workload,
            baseline=self.baseline,
            candidate=self.candidate,
            steps=self.quality_steps,
            seeds=self.quality_seeds,
            first_seed=self.settings.seed,
            eval_examples=self.quality_eval_examples,
            precision=self.settings.precision,
            device=self.settings.device,
            accum=self.accum,
            threads=self.settings.threads,
            candidate_accum=self.accum_of("candidate"),
        )

    def paired_spec(self) -> PairedSpec:
        return PairedSpec(
            baseline=self.arm_spec("baseline"),
            candidate=self.arm_spec("candidate"),
            blocks=self.blocks,
            block_updates=self.block_updates,
        )

    def memory_spec(self, plan: BatchPlan, *, scaling: Scaling = "pre") -> MeasureSpec:
        """A short single-configuration run in a fresh process, for its memory figures."""
        return dataclasses.replace(
            self.measure_spec(plan, scaling=scaling), steps=MEMORY_PROBE_UPDATES, warmup=1
        )

    def measure_spec(self, plan: BatchPlan, *, scaling: Scaling = "pre") -> MeasureSpec:
        return self.settings.measure_spec(self.workload, plan, scaling=scaling)

    def to_dict(self) -> dict[str, Any]:
        """Flat, as results.json has always had it: the settings sit beside the comparison's fields."""
        data: dict[str, Any] = {
            "workload": self.workload,
            "baseline": self.baseline.label(),
            "candidate": self.candidate.label(),
            "margin": self.margin,
            "block_updates": self.block_updates,
            "blocks": self.blocks,
            "max_consecutive_skips": self.max_consecutive_skips,
            "memory_budget_bytes": self.memory_budget_bytes,
        }
        for name, value in self.settings.to_dict().items():
            if name == "compile":
                continue  # appended last (issue 23), the earlier keys unchanged
            data[name] = value
            if name == "warmup":
                data["trace_steps"] = self.trace_steps  # where results.json has always had it
        data["quality_steps"] = self.quality_steps
        data["quality_seeds"] = self.quality_seeds
        data["quality_eval_examples"] = self.quality_eval_examples
        data["compile"] = self.settings.compile
        data["baseline_scaling"] = self.baseline_scaling  # appended (issue 22), the earlier keys unchanged
        data["candidate_scaling"] = self.candidate_scaling
        return data


def partition(plan: BatchPlan) -> list[int]:
    """The plan's micro-batch sizes over the whole global batch, as one process sees it.

    Under DP each rank sums its share and DDP averages; the exact step makes that equal to one
    process accumulating all ``dp x accum_steps`` micro-batches, which is what the check runs.
    """
    return [plan.micro_batch] * (plan.accum_steps * plan.dp)


@dataclass(frozen=True, kw_only=True, slots=True)
class Equivalence:
    """Steps 1 and 2: the float64 checks of both partitionings and the trace comparison."""

    params: tuple[ParamCheck, ...]
    """Baseline and candidate against the full batch, float64."""
    trace: TraceCheck
    """Production-precision traces of both."""
    details: dict[str, Any] = field(default_factory=dict)
    """The underlying reports as plain data (for results.json)."""


def _plain(obj: Any) -> Any:
    """A JSON-ready copy of a report (dataclass, tuple, tensor, dtype ...)."""
    if hasattr(obj, "__dataclass_fields__"):
        return {name: _plain(getattr(obj, name)) for name in obj.__dataclass_fields__}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def check_equivalence(spec: AcceptSpec, workload: Workload) -> Equivalence:
    """Run the ``verify`` machinery on both partitionings (float64) and compare traces.

    The float64 check cuts one global batch (``make_batch(global_batch, seed)``) both ways, each
    against that batch in one forward/backward; the traces run ``trace_steps`` updates of both.
    """
    # imported here so that measurement works without the checks
    from gradaccum.check.equivalence import compare_traces, verify

    params = []
    details: dict[str, Any] = {}
    batch = workload.make_batch(spec.baseline.global_batch, spec.settings.seed)
    arms: tuple[Arm, Arm] = ("baseline", "candidate")
    for name in arms:
        plan = spec.plan_of(name)
        report = verify(
            workload.build_model,
            batch,
            workload.loss_fn,
            workload.count_fn,
            sizes=partition(plan),
            optimizer_factory=workload.optimizer_factory,
            dtype=torch.float64,
            device=spec.settings.device,
            declared_hazards=workload.declared_hazards,
            seed=spec.settings.seed,
            name=workload.name,
            unit=workload.unit,
            scaling=spec.scaling_of(name),
        )
        details[f"equivalence_{name}"] = _plain(report)
        params.append(
            ParamCheck(
                label=f"{name} {spec.label_of(name)}",
                grad_max_rel_err=float(report.grad_max_rel_err),
                grad_tol=float(report.grad_tol),
                param_max_abs_diff=float(report.param_max_abs_diff),
                param_tol=float(report.param_tol),
                passed=bool(report.passed),
                causes=tuple(str(c) for c in report.likely_causes),
            )
        )
    trace = compare_traces(
        workload,
        baseline_sizes=partition(spec.baseline),
        candidate_sizes=partition(spec.candidate),
        steps=spec.trace_steps,
        dtype=dtype_of(spec.settings.precision),
        seed=spec.settings.seed,
        device=spec.settings.device,
        accum=spec.accum_of("baseline"),
        candidate_accum=spec.accum_of("candidate"),
    )
    details["trace"] = _plain(trace)
    return Equivalence(
        params=tuple(params),
        trace=TraceCheck(passed=bool(trace.passed), figure=_trace_figure(trace)),
        details=details,
    )


def _trace_figure(trace: Any) -> str:
    """The trace report's one-line summary, without its own PASS/FAIL (the verdict shows that)."""
    text = str(trace.summary())
    for prefix in ("PASS: ", "FAIL: "):
        text = text.removeprefix(prefix)
    if trace.skipped:
        text += f"; skipped: {'; '.join(trace.skipped)}"
    return text


@dataclass(frozen=True, kw_only=True, slots=True)
class AcceptResult:
    """Everything the acceptance run found, and the run card it recommends."""

    spec: AcceptSpec
    """What was compared."""
    equivalence: Equivalence
    """Steps 1 and 2."""
    baseline: ConfigSummary
    """The baseline: timing from the paired runs, memory from its own fresh-process run."""
    candidate: ConfigSummary
    """The candidate, likewise."""
    comm: tuple[CommModel | None, CommModel | None]
    """Communication model of baseline and candidate."""
    memory_model: MemoryModel | None
    """persistent + activation bytes against the micro-batch, from both configurations."""
    verdict: Verdict
    """ADOPT, KEEP BASELINE or INCONCLUSIVE, with every criterion."""
    records: tuple[PairedRecord, ...]
    """Every paired run, in the order it ran."""
    memory_records: tuple[RunRecord, RunRecord]
    """The baseline's and the candidate's memory runs."""
    card: RunCard
    """The configuration to use (the candidate if adopted), with its environment."""
    quality_reasons: tuple[str, ...] = ()
    """What the scan found that the equivalence check had to switch off or could not make exact:
    why a representative quality run is needed (empty: nothing found)."""
    quality: QualityResult | None = None
    """The quality run, when one was asked for (see :func:`with_quality`)."""

    @property
    def equivalence_passed(self) -> bool:
        """Whether both partitionings and the traces passed: False means broken arithmetic."""
        return all(p.passed for p in self.equivalence.params) and self.equivalence.trace.passed

    @property
    def budget_advice(self) -> str | None:
        """With a memory budget: the largest micro-batch that fits, or why nothing can."""
        budget = self.spec.memory_budget_bytes
        if budget is None or self.memory_model is None:
            return None
        return self.memory_model.advice(
            budget, global_batch=self.spec.baseline.global_batch, dp=self.spec.baseline.dp
        )

    def to_dict(self) -> dict[str, Any]:
        mm = self.memory_model
        return {
            "kind": "accept",
            "spec": self.spec.to_dict(),
            "verdict": self.verdict.to_dict(),
            "equivalence": {
                "params": [asdict(p) for p in self.equivalence.params],
                "trace": asdict(self.equivalence.trace),
                "details": self.equivalence.details,
            },
            "baseline": self.baseline.to_dict(),
            "candidate": self.candidate.to_dict(),
            "comm_model": [None if c is None else {**asdict(c), "matches": c.matches} for c in self.comm],
            "memory_model": None if mm is None else asdict(mm),
            "memory_budget_advice": self.budget_advice,
            "runcard": self.card.to_dict(),
            "runs": [r.to_dict() for r in self.records],
            "memory_runs": [r.to_dict() for r in self.memory_records],
            "quality_reasons": list(self.quality_reasons),
            "quality": None if self.quality is None else self.quality.to_dict(),
        }


def _arm(summary: ConfigSummary, label: str) -> ArmFigures:
    return ArmFigures(
        label=label,
        global_batch=summary.plan.global_batch,
        tokens_per_update=tuple(summary.tokens_per_update),
        updates=summary.updates,
        skipped_updates=summary.skipped_updates,
        units_per_s_per_run=tuple(summary.per_run_units_per_s),
        runs_failed=summary.runs - summary.runs_ok,
    )


def make_runcard(
    spec: AcceptSpec, verdict: Verdict, chosen: ConfigSummary, environment: dict[str, Any], unit: str
) -> RunCard:
    """The card of the configuration to use, with every setting that changes the update."""
    settings = spec.settings
    return RunCard(
        workload=spec.workload,
        plan=chosen.plan,
        accum=dataclasses.replace(spec.accum, scaling=chosen.spec.scaling),
        precision=settings.precision,
        optimizer="workload",
        denominator=unit,
        tokens_per_step=chosen.tokens_per_update[0] if chosen.tokens_per_update else None,
        seed=settings.seed,
        versions=dict(environment.get("versions", {})),
        device=str(environment.get("device", settings.device)),
        git_commit=environment.get("git_commit"),
        verdict=verdict.decision,
        compile=settings.compile,
        extra={
            "chosen": "candidate" if verdict.adopt else "baseline",
            "baseline": spec.baseline.label(),
            "candidate": spec.candidate.label(),
            "margin": spec.margin,
            "throughput_gain": verdict.throughput_gain,
            "gain_interval": None if verdict.interval is None else list(verdict.interval),
            "trace_steps": spec.trace_steps,
            "scaler": "GradScaler" if settings.precision == "float16" else None,
            "tokens_per_step_source": "global valid units of the first measured update "
            f"(make_batch({chosen.plan.global_batch}, seed={settings.seed + 1 + settings.warmup}))",
            "schedule_clock": "optimizer updates (one per window of accum_steps micro-batches)",
            "baseline_scaling": spec.baseline_scaling,
            "candidate_scaling": spec.candidate_scaling,
        },
    )


def _arm_runs(records: list[PairedRecord], which: str) -> list[RunRecord]:
    """One arm's side of each paired run, as the single-configuration records the summaries take."""
    out = []
    for r in records:
        spec = r.spec.baseline if which == "baseline" else r.spec.candidate
        measurement = r.baseline if which == "baseline" else r.candidate
        out.append(
            RunRecord(
                spec=spec, status=r.status, measurement=measurement, error=r.error, run_index=r.run_index
            )
        )
    return out


def _with_memory(summary: ConfigSummary, probe: RunRecord) -> ConfigSummary:
    """The arm's timing with the memory of its own fresh-process run (the paired process holds both
    configurations, so its allocator peaks and RSS are not one configuration's)."""
    m = probe.measurement
    if m is None:
        return dataclasses.replace(
            summary, memory=None, peak_rss_bytes=None, peak_allocated_bytes=None, peak_reserved_bytes=None
        )
    return dataclasses.replace(
        summary,
        memory=m.memory,
        peak_rss_bytes=float(m.peak_rss_bytes),
        peak_allocated_bytes=None if m.peak_allocated_bytes is None else float(m.peak_allocated_bytes),
        peak_reserved_bytes=None if m.peak_reserved_bytes is None else float(m.peak_reserved_bytes),
        fresh_process=m.fresh_process,
    )


def run_accept(
    spec: AcceptSpec,
    launch: Launch,
    *,
    workload: Workload,
    environment: dict[str, Any],
    equivalence: Equivalence | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_progress: Callable[[ProgressEvent], None] | None = None,
) -> AcceptResult:
    """The whole protocol. ``equivalence`` may be given when it was checked beforehand (torchrun)."""
    if equivalence is None:
        if on_stage is not None:
            on_stage("equivalence")
        equivalence = check_equivalence(spec, workload)
    if on_stage is not None:
        on_stage("measure")
    probes = [
        spec.memory_spec(spec.baseline, scaling=spec.baseline_scaling),
        spec.memory_spec(spec.candidate, scaling=spec.candidate_scaling),
    ]
    paired = spec.paired_spec()
    jobs: list[tuple[Any, int]] = [(probes[0], 0), (probes[1], 0)]
    jobs += [(paired, r) for r in range(spec.settings.runs)]
    done = run_jobs(jobs, launch, on_progress)
    memory_records: tuple[RunRecord, RunRecord] = (done[0], done[1])
    records: list[PairedRecord] = list(done[2:])
    base = _with_memory(summarize(paired.baseline, _arm_runs(records, "baseline")), memory_records[0])
    cand = _with_memory(summarize(paired.candidate, _arm_runs(records, "candidate")), memory_records[1])
    verdict = decide(
        baseline=_arm(base, spec.label_of("baseline")),
        candidate=_arm(cand, spec.label_of("candidate")),
        params=equivalence.params,
        trace=equivalence.trace,
        paired=[r.ratios for r in records if r.ok],
        margin=spec.margin,
        unit=workload.unit,
    )
    chosen = cand if verdict.adopt else base
    return AcceptResult(
        spec=spec,
        equivalence=equivalence,
        baseline=base,
        candidate=cand,
        comm=(comm_of(base), comm_of(cand)),
        memory_model=memory_model_of([base, cand]),
        verdict=verdict,
        records=tuple(records),
        memory_records=memory_records,
        card=make_runcard(spec, verdict, chosen, environment, workload.unit),
        quality_reasons=quality_reasons(workload, (spec.baseline, spec.candidate)),
    )


def with_quality(result: AcceptResult, quality: QualityResult) -> AcceptResult:
    """``result`` with its quality run, which the run card also records (the means, intervals and
    whether they differ), so that the card carries the evidence for the configuration it names."""
    card = dataclasses.replace(
        result.card,
        extra={
            **result.card.extra,
            "quality": {
                "summary": quality.describe(),
                "differ": quality.differ,
                "baseline_eval_loss": [quality.baseline.mean, quality.baseline.low, quality.baseline.high],
                "candidate_eval_loss": [
                    quality.candidate.mean,
                    quality.candidate.low,
                    quality.candidate.high,
                ],
                "difference": [quality.difference, quality.difference_low, quality.difference_high],
                "steps": quality.spec.steps,
                "seeds": list(quality.baseline.seeds),
            },
        },
    )
    return dataclasses.replace(result, quality=quality, card=card)
