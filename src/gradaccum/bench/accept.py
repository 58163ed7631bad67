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
from dataclasses import asdict, dataclass
from typing import Any

from gradaccum.bench.accept_checks import Equivalence, check_equivalence, partition
from gradaccum.bench.accept_spec import ACCEPT_SETTINGS, AcceptSpec, Arm
from gradaccum.bench.models import CommModel, MemoryModel, memory_model_of
from gradaccum.bench.quality import QualityResult, quality_reasons
from gradaccum.bench.runner import Launch
from gradaccum.bench.spec import PairedRecord, RunRecord
from gradaccum.bench.stats import ConfigSummary, summarize
from gradaccum.bench.sweep import ProgressEvent, comm_of, run_jobs
from gradaccum.bench.verdict import ArmFigures, Verdict, decide
from gradaccum.check.workload import DEFAULT_WORKLOAD, Workload
from gradaccum.runcard import RunCard

__all__ = [
    "ACCEPT_SETTINGS",
    "DEFAULT_WORKLOAD",
    "AcceptResult",
    "AcceptSpec",
    "Arm",
    "Equivalence",
    "check_equivalence",
    "make_runcard",
    "partition",
    "run_accept",
    "with_quality",
]


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
        max_tokens=chosen.spec.max_tokens,
        extra={
            "chosen": "candidate" if verdict.adopt else "baseline",
            "baseline": spec.baseline.label(),
            "candidate": spec.label_of("candidate"),
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
        spec.memory_spec(
            spec.candidate, scaling=spec.candidate_scaling, max_tokens=spec.candidate_max_tokens
        ),
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
