"""The representative quality run: baseline and candidate trained from several seeds, compared by
their final evaluation loss.

The equivalence check proves one update exact in float64, with random layers switched off; it cannot
say what a changed micro-batch does over a training run when something in the model is *not* exact
under accumulation (BatchNorm normalizes each micro-batch on its own and updates its running
statistics once per micro-batch; dropout draws other masks; a mixture-of-experts router balances
per forward), nor over many steps of production precision. So each arm trains ``steps`` updates
from each of ``seeds`` seeds through the library's own loop (:func:`gradaccum.train.train`), with
production settings: dropout on and BatchNorm as it is (the model as the workload builds it, in
training mode), the precision and accumulator settings the acceptance run measured, and
``train``'s optimizer and schedule (AdamW at lr 1e-2, warmup then cosine over the run), as
``gradaccum train --runcard`` would train. Each run ends with one evaluation (no grad, eval mode)
on held-out examples; a seed picks the data stream, the dropout draws and the held-out examples,
the same for both arms (the workload's weights are fixed by its contract).

The interval. Each arm's final evaluation losses over the S seeds give a mean and a 95 % Student-t
interval, mean +- t(0.975, S-1) s / sqrt(S). The arms differ when the 95 % Welch interval of the
difference of their means (candidate - baseline; Welch-Satterthwaite degrees of freedom, rounded
down, which widens it) excludes zero. Welch treats the arms as independent samples, which is
conservative here: both arms of a seed share its data, so their losses are positively correlated.
The per-seed (paired) differences are reported beside it; they are not used for the decision,
because arms that are exact in arithmetic differ per seed by float rounding alone, consistently
enough to make a paired interval exclude zero while meaning nothing.

The data. Seed ``s`` trains on what ``gradaccum train --seed s`` draws
(:func:`gradaccum.train.data.train_seed`: a stream of its own per seed, within the 32 bits a torch
CPU generator keeps) and evaluates on that seed's held-out batches.

Under data parallelism each arm trains on one process with the same micro-batch and global batch
(accumulation dp x k): the same gradient per update by the exact step, while per-rank BatchNorm
buffers and dropout streams of a dp-rank run are not reproduced (a note says so).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from gradaccum.bench.verdict import t975
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan
from gradaccum.precision import PRECISIONS, Precision
from gradaccum.step.config import AccumConfig
from gradaccum.values import require_int

if TYPE_CHECKING:
    from gradaccum.check.workload import Workload

__all__ = [
    "MIN_SEEDS",
    "QUALITY_CODES",
    "QualityArm",
    "QualityResult",
    "QualitySpec",
    "mean_interval",
    "quality_reasons",
    "run_quality",
    "welch_interval",
]

MIN_SEEDS = 2
"""An interval over seeds needs at least two of them."""
QUALITY_CODES = {
    "batch-norm": "the equivalence check could not make it exact",
    "moe-router": "the equivalence check could not make it exact",
    "declared-hazard": "the equivalence check could not make it exact",
    "random-layer": "the equivalence check switched it off",
    "running-stats": "the equivalence check compares gradients, not the running estimates evaluation uses",
}
"""The scan's findings that make a quality run necessary, and what the check did about each."""


def _default_accum() -> AccumConfig:
    return AccumConfig(max_grad_norm=1.0, track_grad_norm=True, max_consecutive_skips=10)


@dataclass(frozen=True, kw_only=True, slots=True)
class QualitySpec:
    """Two configurations at one global batch, each trained from ``seeds`` seeds."""

    workload: str
    """``MODULE:FUNCTION`` (or ``hf:`` spec) of the workload."""
    baseline: BatchPlan
    """The configuration in use."""
    candidate: BatchPlan
    """The proposed one (same global batch)."""
    steps: int
    """Optimizer updates per run."""
    seeds: int = 3
    """Runs per arm, seeds ``first_seed, first_seed + 1, ...``."""
    first_seed: int = 0
    """The first seed."""
    eval_examples: int = 64
    """Held-out examples of the final evaluation."""
    precision: str = "float32"
    """Training precision (as measured)."""
    device: str = "cpu"
    """Training device."""
    accum: AccumConfig = field(default_factory=_default_accum)
    """The accumulator settings the acceptance run measured (clipping, deferral, skip limit)."""
    threads: int | None = None
    """``torch.set_num_threads`` while training (restored after); ``None`` leaves torch's. On a
    shared CPU, one thread avoids the stalls of intra-op threads waiting on each other."""
    candidate_accum: AccumConfig | None = None
    """The candidate's accumulator settings where they differ from ``accum`` (e.g. its
    ``scaling``); ``None``: the candidate trains with ``accum`` too."""

    def __post_init__(self) -> None:
        require_int("quality steps", self.steps, error=BenchError)
        require_int("quality eval_examples", self.eval_examples, error=BenchError)
        require_int("first_seed", self.first_seed, low=0, error=BenchError)
        require_int("threads", self.threads, error=BenchError, none_ok=True)
        require_int("seeds", self.seeds, low=MIN_SEEDS, error=BenchError)
        if self.baseline.global_batch != self.candidate.global_batch:
            raise BenchError(
                f"a quality run compares two configurations at one global batch; {self.baseline.label()} "
                f"has {self.baseline.global_batch}, {self.candidate.label()} {self.candidate.global_batch}"
            )
        if self.precision not in PRECISIONS:
            raise BenchError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")

    @staticmethod
    def trained_plan(plan: BatchPlan) -> BatchPlan:
        """What one process trains for ``plan``: its micro-batch, and accumulation dp x k."""
        return BatchPlan(micro_batch=plan.micro_batch, accum_steps=plan.accum_steps * plan.dp, dp=1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "baseline": self.baseline.label(),
            "candidate": self.candidate.label(),
            "steps": self.steps,
            "seeds": self.seeds,
            "first_seed": self.first_seed,
            "eval_examples": self.eval_examples,
            "precision": self.precision,
            "device": self.device,
            "accum": self.accum.to_dict(),
            "threads": self.threads,
            "candidate_accum": None if self.candidate_accum is None else self.candidate_accum.to_dict(),
        }

    def accum_of(self, arm: str) -> AccumConfig:
        """What ``arm`` (``baseline`` or ``candidate``) trains with."""
        if arm == "candidate" and self.candidate_accum is not None:
            return self.candidate_accum
        return self.accum


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % Student-t interval of the mean of ``values`` (two or more)."""
    if len(values) < MIN_SEEDS:
        raise BenchError(f"an interval over seeds needs at least {MIN_SEEDS} values, got {len(values)}")
    mean = statistics.fmean(values)
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def welch_interval(baseline: Sequence[float], candidate: Sequence[float]) -> tuple[float, float, float]:
    """(difference, low, high): candidate mean - baseline mean and its 95 % Welch interval.

    Degrees of freedom by Welch-Satterthwaite, rounded down (a smaller df, a wider interval); when
    both samples have no spread at all the interval is the difference itself.
    """
    for values in (baseline, candidate):
        if len(values) < MIN_SEEDS:
            raise BenchError(f"a Welch interval needs at least {MIN_SEEDS} values per arm, got {len(values)}")
    diff = statistics.fmean(candidate) - statistics.fmean(baseline)
    va = statistics.variance(baseline) / len(baseline)
    vb = statistics.variance(candidate) / len(candidate)
    if va + vb == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va**2 / (len(baseline) - 1) + vb**2 / (len(candidate) - 1))
    half = t975(max(1, math.floor(df))) * math.sqrt(va + vb)
    return diff, diff - half, diff + half


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityArm:
    """One configuration's runs."""

    label: str
    """The plan's label (``8x4``)."""
    trained: str
    """What each run trained (the same, or ``MICROx(DP*ACCUM)`` on one process under DP)."""
    seeds: tuple[int, ...]
    """The seeds, in order."""
    eval_losses: tuple[float, ...]
    """Final evaluation loss per seed (per counted unit)."""
    train_losses: tuple[float | None, ...]
    """The last applied window's training loss per seed."""
    mean: float
    """Mean final evaluation loss over seeds."""
    low: float
    """95 % Student-t interval of the mean: lower end."""
    high: float
    """Upper end."""
    runs: tuple[str, ...]
    """The run folders."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "trained": self.trained,
            "seeds": list(self.seeds),
            "eval_losses": list(self.eval_losses),
            "train_losses": list(self.train_losses),
            "mean": self.mean,
            "interval": [self.low, self.high],
            "runs": list(self.runs),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class QualityResult:
    """Both arms over the seeds, and whether their final evaluation losses differ."""

    spec: QualitySpec
    """What was trained."""
    unit: str
    """What the evaluation loss is averaged over."""
    baseline: QualityArm
    """The baseline's runs."""
    candidate: QualityArm
    """The candidate's runs."""
    difference: float
    """Candidate mean - baseline mean."""
    difference_low: float
    """95 % Welch interval of the difference: lower end."""
    difference_high: float
    """Upper end."""
    paired_differences: tuple[float, ...]
    """Candidate - baseline, seed by seed (shown, not used for the decision)."""
    reasons: tuple[str, ...] = ()
    """What the scan found that makes this run necessary (empty: none found)."""
    notes: tuple[str, ...] = ()
    """How the runs depart from the configurations as measured (one process under DP)."""

    @property
    def differ(self) -> bool:
        """Whether the difference's interval excludes zero."""
        return not self.difference_low <= 0.0 <= self.difference_high

    def describe(self) -> str:
        """One sentence: both means with their intervals, and the verdict on the difference."""
        b, c = self.baseline, self.candidate
        how = (
            f"final eval loss over {len(b.seeds)} seeds after {self.spec.steps} updates: baseline "
            f"{b.label} {b.mean:.4f} [{b.low:.4f}, {b.high:.4f}], candidate {c.label} {c.mean:.4f} "
            f"[{c.low:.4f}, {c.high:.4f}]; difference {self.difference:+.4f} "
            f"[{self.difference_low:+.4f}, {self.difference_high:+.4f}]"
        )
        if self.differ:
            worse = "higher" if self.difference > 0 else "lower"
            return f"{how}: the candidate's loss is {worse}, beyond what the seeds' spread explains"
        return f"{how}: no difference the seeds can resolve"

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "unit": self.unit,
            "baseline": self.baseline.to_dict(),
            "candidate": self.candidate.to_dict(),
            "difference": self.difference,
            "difference_interval": [self.difference_low, self.difference_high],
            "differ": self.differ,
            "paired_differences": list(self.paired_differences),
            "interval": "95% Student-t over seeds per arm; Welch 95% for the difference of means",
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "summary": self.describe(),
        }


def quality_reasons(workload: Workload, plans: Iterable[BatchPlan]) -> tuple[str, ...]:
    """What the scan finds in ``workload``'s model under ``plans`` that the equivalence check had
    to switch off or could not make exact: one line per kind of finding, its modules named."""
    from gradaccum.hazards.scanner import scan

    model = workload.build_model()
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for plan in plans:
        k = plan.accum_steps * plan.dp
        found = scan(model, k, micro_batch=plan.micro_batch, declared_hazards=workload.declared_hazards)
        for f in found:
            if f.code in QUALITY_CODES and f.severity != "info":  # a note: nothing differs
                paths = grouped.setdefault((f.code, f.kind, f.summary), [])
                if f.path not in paths:
                    paths.append(f.path)
    lines = []
    for (code, kind, summary), paths in grouped.items():
        where = ", ".join(f"`{p}`" for p in paths if p)
        lines.append(f"{kind}{' at ' + where if where else ''} {summary}: {QUALITY_CODES[code]}")
    return tuple(lines)


def _train_one(
    spec: QualitySpec, root: Path, workload: Workload, arm: str, plan: BatchPlan, seed: int
) -> tuple[float, float | None, str]:
    """One run through ``gradaccum.train``: (final eval loss, last training loss, run folder)."""
    from gradaccum.train import TrainConfig, train

    run_dir = root / f"{arm}-seed{seed}"
    config = TrainConfig(
        plan=spec.trained_plan(plan),
        run_dir=run_dir,
        workload=spec.workload,
        steps=spec.steps,
        precision=cast(Precision, spec.precision),
        accum=replace(spec.accum_of(arm), track_grad_norm=True),
        seed=seed,
        device=spec.device,
        eval_every=spec.steps,  # once, at the end
        eval_examples=spec.eval_examples,
        keep_checkpoints=1,
    )
    result = train(config, workload=workload)
    if result.eval_loss is None:
        raise BenchError(
            f"the quality run {arm} seed {seed} evaluated no units: the held-out batch of "
            f"{spec.eval_examples} examples counts none; raise eval_examples"
        )
    return result.eval_loss, result.last_loss, str(run_dir)


def run_quality(
    spec: QualitySpec,
    run_root: str | Path,
    *,
    workload: Workload | None = None,
    reasons: tuple[str, ...] = (),
    on_run: Callable[[str, int, int, int], None] | None = None,
) -> QualityResult:
    """Train both arms of ``spec`` from every seed (seed-major: baseline, candidate, next seed), each
    into ``run_root/ARM-seedS``, and compare their final evaluation losses.

    One process, no process group: under data parallelism each arm trains its plan's micro-batch
    with accumulation dp x k (see :meth:`QualitySpec.trained_plan`). ``workload`` overrides loading
    ``spec.workload``; ``on_run(arm, seed, done, total)`` is called before each run.
    """
    from gradaccum.check.workload import load_workload
    from gradaccum.distributed import dist

    if dist.world_size() != 1:
        raise BenchError(
            "the quality run trains on one process; call it outside an initialized process group "
            "(accept runs it on rank 0 after the measurements)"
        )
    if workload is None:
        workload = load_workload(spec.workload)
    root = Path(run_root)
    seeds = tuple(range(spec.first_seed, spec.first_seed + spec.seeds))
    arms = (("baseline", spec.baseline), ("candidate", spec.candidate))
    losses: dict[str, list[float]] = {"baseline": [], "candidate": []}
    last: dict[str, list[float | None]] = {"baseline": [], "candidate": []}
    dirs: dict[str, list[str]] = {"baseline": [], "candidate": []}
    total = len(seeds) * len(arms)
    threads = torch.get_num_threads()
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    try:
        for i, seed in enumerate(seeds):
            for j, (arm, plan) in enumerate(arms):
                if on_run is not None:
                    on_run(arm, seed, 2 * i + j, total)
                eval_loss, last_loss, run_dir = _train_one(spec, root, workload, arm, plan, seed)
                losses[arm].append(eval_loss)
                last[arm].append(last_loss)
                dirs[arm].append(run_dir)
    finally:
        torch.set_num_threads(threads)

    scalings = {name: spec.accum_of(name).scaling for name in losses}

    def arm_of(name: str, plan: BatchPlan) -> QualityArm:
        mean, low, high = mean_interval(losses[name])
        return QualityArm(
            # the scaling too once an arm post-scales: a pre/post comparison at one plan
            label=plan.label() + (f" {scalings[name]}" if "post" in scalings.values() else ""),
            trained=spec.trained_plan(plan).label(),
            seeds=seeds,
            eval_losses=tuple(losses[name]),
            train_losses=tuple(last[name]),
            mean=mean,
            low=low,
            high=high,
            runs=tuple(dirs[name]),
        )

    diff, low, high = welch_interval(losses["baseline"], losses["candidate"])
    notes = []
    if spec.baseline.dp > 1:
        b, c = spec.baseline, spec.candidate
        notes.append(
            f"each arm trained on one process with accumulation dp x k ({spec.trained_plan(b).label()} "
            f"for {b.label()}, {spec.trained_plan(c).label()} for {c.label()}): the same global batch, "
            "micro-batch and update; per-rank BatchNorm buffers and dropout streams of a multi-rank run "
            "are not reproduced"
        )
    return QualityResult(
        spec=spec,
        unit=workload.unit,
        baseline=arm_of("baseline", spec.baseline),
        candidate=arm_of("candidate", spec.candidate),
        difference=diff,
        difference_low=low,
        difference_high=high,
        paired_differences=tuple(c - b for b, c in zip(losses["baseline"], losses["candidate"], strict=True)),
        reasons=reasons,
        notes=tuple(notes),
    )
