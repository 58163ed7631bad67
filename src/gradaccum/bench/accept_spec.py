"""What an acceptance run compares and how: :class:`AcceptSpec`, a baseline and a candidate plan at
one global batch, with the measurement settings, the trace window, the skip limit and the quality
run, validated before any work starts; and the specs of the runs it launches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from gradaccum.bench.quality import MIN_SEEDS, QualitySpec
from gradaccum.bench.spec import MeasureSettings, MeasureSpec, PairedSpec, check_scaling
from gradaccum.bench.verdict import DEFAULT_MARGIN, MIN_RUNS
from gradaccum.check.workload import DEFAULT_WORKLOAD
from gradaccum.errors import BenchError, PlanError
from gradaccum.plan import BatchPlan
from gradaccum.step.config import AccumConfig, Scaling
from gradaccum.values import require_int

__all__ = [
    "ACCEPT_SETTINGS",
    "DEFAULT_BLOCK_UPDATES",
    "MEMORY_PROBE_UPDATES",
    "MIN_BLOCKS",
    "AcceptSpec",
    "Arm",
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
    candidate_max_tokens: int | None = None
    """A token-budget candidate: each update's global batch cut by :func:`gradaccum.split_by_tokens`
    into micro-batches of at most this many tokens, balanced across the ranks; ``candidate`` is
    then one window of the global batch's rows per rank (``global_batch/dp x 1``). ``None``: the
    candidate's fixed micro-batches."""

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
        if self.candidate_max_tokens is not None:
            require_int("candidate_max_tokens", self.candidate_max_tokens, error=BenchError)
            if c.accum_steps != 1:
                raise BenchError(
                    f"a token-budget candidate holds the global batch as one window of rows per rank "
                    f"({c.global_batch // c.dp}x1), got {c.label()}"
                )
            if self.quality_steps is not None:
                raise BenchError(
                    "--quality-steps does not train a token-budget candidate yet; its update is the "
                    "baseline's by construction (the float64 check shows it): leave --quality-steps out"
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

    def max_tokens_of(self, arm: Arm) -> int | None:
        """The arm's token budget (``None``: fixed micro-batches)."""
        return self.candidate_max_tokens if arm == "candidate" else None

    def label_of(self, arm: Arm) -> str:
        """The arm's plan (``4x8``), with its scaling once either arm post-scales (``4x8 post``),
        so that a comparison of the two modes at one plan names its arms apart."""
        budget = self.max_tokens_of(arm)
        label = self.plan_of(arm).label() if budget is None else f"tokens<={budget}"
        return f"{label} {self.scaling_of(arm)}" if "post" in self.scalings else label

    def accum_of(self, arm: Arm) -> AccumConfig:
        """The accumulator settings of one arm: :attr:`accum` with that arm's scaling."""
        return dataclasses.replace(self.accum, scaling=self.scaling_of(arm))

    def arm_spec(self, arm: Arm) -> MeasureSpec:
        """One arm measured with these settings and its own scaling."""
        return self.measure_spec(
            self.plan_of(arm), scaling=self.scaling_of(arm), max_tokens=self.max_tokens_of(arm)
        )

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

    def memory_spec(
        self, plan: BatchPlan, *, scaling: Scaling = "pre", max_tokens: int | None = None
    ) -> MeasureSpec:
        """A short single-configuration run in a fresh process, for its memory figures."""
        return dataclasses.replace(
            self.measure_spec(plan, scaling=scaling, max_tokens=max_tokens),
            steps=MEMORY_PROBE_UPDATES,
            warmup=1,
        )

    def measure_spec(
        self, plan: BatchPlan, *, scaling: Scaling = "pre", max_tokens: int | None = None
    ) -> MeasureSpec:
        return self.settings.measure_spec(self.workload, plan, scaling=scaling, max_tokens=max_tokens)

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
            if name in ("compile", "balance"):
                continue  # appended last (issues 23, 41), the earlier keys unchanged
            data[name] = value
            if name == "warmup":
                data["trace_steps"] = self.trace_steps  # where results.json has always had it
        data["quality_steps"] = self.quality_steps
        data["quality_seeds"] = self.quality_seeds
        data["quality_eval_examples"] = self.quality_eval_examples
        data["compile"] = self.settings.compile
        data["baseline_scaling"] = self.baseline_scaling  # appended (issue 22), the earlier keys unchanged
        data["candidate_scaling"] = self.candidate_scaling
        data["candidate_max_tokens"] = self.candidate_max_tokens  # appended (issue 34)
        data["balance"] = self.settings.balance  # appended (issue 41); None: the model's own choice
        return data
