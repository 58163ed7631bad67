"""The adoption rule: a pure function from measured figures to ADOPT or KEEP BASELINE.

The seeds' protocol: adopt an accumulation change only if global valid tokens and optimizer updates
match, parameter deltas pass the numerical tolerance, the skipped-step rate does not regress, and
median valid-token throughput improves by a declared margin across at least three runs. The
production-precision trace comparison is checked as its own criterion. Every criterion is reported
with its figure, passed or not; the verdict is ADOPT only when all pass.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gradaccum.errors import BenchError
from gradaccum.values import require_int

__all__ = ["ADOPT", "KEEP", "ArmFigures", "Criterion", "ParamCheck", "TraceCheck", "Verdict", "decide"]

ADOPT = "ADOPT"
KEEP = "KEEP BASELINE"
DEFAULT_MARGIN = 0.03
MIN_RUNS = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class ArmFigures:
    """What was measured for one side (baseline or candidate) of the comparison."""

    label: str
    """The plan, e.g. ``8x4``."""
    global_batch: int
    """Examples per optimizer update across all ranks."""
    tokens_per_update: tuple[int, ...]
    """Exact global valid units of each measured update, in order."""
    updates: int
    """Optimizer updates over all measured runs."""
    skipped_updates: int
    """Of those, skipped (overflow, non-finite, zero count)."""
    units_per_s_per_run: tuple[float, ...]
    """Valid-unit throughput of each finished run."""
    runs_failed: int = 0
    """Runs that did not finish (OOM, crash, timeout)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamCheck:
    """The float64 equivalence check of one partitioning against the full batch."""

    label: str
    """Which partitioning (e.g. ``baseline 8x4``)."""
    grad_max_rel_err: float
    """Largest relative gradient error against the full batch."""
    grad_tol: float
    """Its declared tolerance."""
    param_max_abs_diff: float
    """Largest absolute parameter difference after one update."""
    param_tol: float
    """Its declared tolerance."""
    passed: bool
    """The check's own verdict (it may fail for reasons beyond the two figures)."""
    causes: tuple[str, ...] = ()
    """The check's likely causes when it failed, most specific first."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceCheck:
    """The production-precision loss and gradient-norm trace comparison."""

    passed: bool
    """Whether both traces agree within the declared tolerance."""
    figure: str
    """The figures in words: steps, largest relative differences, tolerance and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Criterion:
    """One line of the verdict."""

    name: str
    """What is checked."""
    passed: bool
    """Whether it holds."""
    figure: str
    """The measured figure(s) it was decided on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """ADOPT or KEEP BASELINE, with every criterion."""

    criteria: tuple[Criterion, ...]
    """Each criterion, in the protocol's order."""
    margin: float
    """The declared throughput margin (0.03 = 3 %)."""
    throughput_gain: float | None
    """median(candidate) / median(baseline) - 1, when both measured."""

    @property
    def adopt(self) -> bool:
        return all(c.passed for c in self.criteria)

    @property
    def decision(self) -> str:
        return ADOPT if self.adopt else KEEP

    @property
    def failed(self) -> list[Criterion]:
        return [c for c in self.criteria if not c.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "margin": self.margin,
            "throughput_gain": self.throughput_gain,
            "criteria": [asdict(c) for c in self.criteria],
        }


def _tokens(base: ArmFigures, cand: ArmFigures) -> Criterion:
    name = "global valid tokens per update equal"
    b, c = base.tokens_per_update, cand.tokens_per_update
    if not b or not c:
        return Criterion(name=name, passed=False, figure="no measured updates to compare")
    if b == c:
        return Criterion(
            name=name,
            passed=True,
            figure=f"{sum(b):,} in {len(b)} updates on both (per update {min(b):,}..{max(b):,})",
        )
    if len(b) != len(c):
        return Criterion(name=name, passed=False, figure=f"{len(b)} vs {len(c)} measured updates")
    i = next(i for i, (x, y) in enumerate(zip(b, c, strict=True)) if x != y)
    return Criterion(name=name, passed=False, figure=f"update {i}: baseline {b[i]:,} vs candidate {c[i]:,}")


def _updates(base: ArmFigures, cand: ArmFigures) -> Criterion:
    same = base.updates == cand.updates and base.global_batch == cand.global_batch
    return Criterion(
        name="optimizer updates equal",
        passed=same and base.updates > 0,
        figure=(
            f"{base.updates} vs {cand.updates} updates at global batch "
            f"{base.global_batch} vs {cand.global_batch}"
        ),
    )


def _params(checks: Sequence[ParamCheck]) -> Criterion:
    name = "parameter delta within tolerance (float64)"
    if not checks:
        return Criterion(name=name, passed=False, figure="no equivalence check ran")
    ok = all(
        c.passed and c.param_max_abs_diff <= c.param_tol and c.grad_max_rel_err <= c.grad_tol for c in checks
    )
    figure = "; ".join(
        f"{c.label}: param diff {c.param_max_abs_diff:.1e} (tol {c.param_tol:.0e}), "
        f"grad rel err {c.grad_max_rel_err:.1e} (tol {c.grad_tol:.0e})"
        + (f", likely cause: {c.causes[0]}" if c.causes and not c.passed else "")
        for c in checks
    )
    return Criterion(name=name, passed=ok, figure=figure)


def _trace(trace: TraceCheck | None) -> Criterion:
    name = "production-precision traces agree"
    if trace is None:
        return Criterion(name=name, passed=False, figure="the trace comparison did not run")
    return Criterion(name=name, passed=trace.passed, figure=trace.figure)


def _skips(base: ArmFigures, cand: ArmFigures) -> Criterion:
    name = "skipped-step rate not worse"
    if base.updates == 0 or cand.updates == 0:
        return Criterion(name=name, passed=False, figure="no measured updates")
    b_rate = base.skipped_updates / base.updates
    c_rate = cand.skipped_updates / cand.updates
    return Criterion(
        name=name,
        passed=c_rate <= b_rate,
        figure=(
            f"candidate {cand.skipped_updates}/{cand.updates} ({c_rate:.1%}) vs "
            f"baseline {base.skipped_updates}/{base.updates} ({b_rate:.1%})"
        ),
    )


def _throughput(
    base: ArmFigures, cand: ArmFigures, margin: float, min_runs: int, unit: str
) -> tuple[Criterion, float | None]:
    name = f"median throughput gain >= {margin:.1%}"
    short = [
        f"{arm} has {len(a.units_per_s_per_run)} finished run(s)"
        + (f" and {a.runs_failed} failed" if a.runs_failed else "")
        for arm, a in (("baseline", base), ("candidate", cand))
        if len(a.units_per_s_per_run) < min_runs or a.runs_failed
    ]
    if not base.units_per_s_per_run or not cand.units_per_s_per_run:
        return Criterion(name=name, passed=False, figure="; ".join(short)), None
    b = statistics.median(base.units_per_s_per_run)
    c = statistics.median(cand.units_per_s_per_run)
    gain = c / b - 1 if b > 0 else float("nan")
    figure = (
        f"{gain:+.1%}: candidate {c:,.0f} vs baseline {b:,.0f} {unit}/s "
        f"(medians of {len(cand.units_per_s_per_run)} and {len(base.units_per_s_per_run)} runs)"
    )
    if short:
        figure += f"; needs >= {min_runs} finished runs each: " + "; ".join(short)
    return Criterion(name=name, passed=not short and gain >= margin, figure=figure), gain


def decide(
    *,
    baseline: ArmFigures,
    candidate: ArmFigures,
    params: Sequence[ParamCheck],
    trace: TraceCheck | None,
    margin: float = DEFAULT_MARGIN,
    min_runs: int = MIN_RUNS,
    unit: str = "tokens",
) -> Verdict:
    """Apply the adoption rule to measured figures; no I/O, no measurement, no randomness."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < math.inf:
        raise BenchError(f"margin must be a non-negative fraction (0.03 = 3%), got {margin!r}")
    require_int("min_runs", min_runs, error=BenchError)
    throughput, gain = _throughput(baseline, candidate, margin, min_runs, unit)
    criteria = (
        _tokens(baseline, candidate),
        _updates(baseline, candidate),
        _params(params),
        _trace(trace),
        _skips(baseline, candidate),
        throughput,
    )
    return Verdict(criteria=criteria, margin=margin, throughput_gain=gain)
