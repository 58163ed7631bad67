"""The adoption rule: a pure function from measured figures to ADOPT, KEEP BASELINE or INCONCLUSIVE.

The seeds' protocol: adopt an accumulation change only if global valid tokens and optimizer updates
match, parameter deltas pass the numerical tolerance, the skipped-step rate does not regress, and
median valid-token throughput improves by a declared margin across at least three runs. The
production-precision trace comparison is checked as its own criterion, and one more guards the
margin against noise: a 95 % confidence interval of the gain must lie above zero.

The gain and its interval come from *paired* figures when there are any: each paired run holds
both configurations in one process and alternates them in blocks, so a pair's ratio (candidate
throughput over baseline throughput in adjacent blocks) is free of the drift that moves whole
runs apart. Each run gives one figure, the median of its pairs' ratios. The *runs* are the
independent replicates (pairs within a run share a process, its memory layout and its neighbours'
load, so they are not independent): the interval is a Student-t interval of the runs' median
log-ratios, wide with three runs (t = 4.30) and narrowing as runs are added, and the gain is its
centre, exp(mean of the runs' median log-ratios) - 1, the geometric mean of the runs' median ratios.
One estimator, so the printed gain, its interval, ``runs_to_resolve`` and ``results.json`` never
disagree. A percentile bootstrap over pairs, tried first, gave A/A comparisons adopted by chance on
a loaded machine: with three runs it cannot reach beyond the observed range. With one run only (no
replicate) the gain is that run's median ratio and the interval a bootstrap of it over the pairs.

- ADOPT: every criterion passes (the gain is at least the margin and the interval's low end is
  above zero).
- KEEP BASELINE: an arithmetic or accounting criterion fails (tokens, updates, equivalence,
  traces, skips), or the interval lies entirely below the margin: the candidate is confidently
  not worth it.
- INCONCLUSIVE: the arithmetic passes but the interval straddles the decision (it reaches both
  below zero and the margin, or the gain is below the margin while the interval reaches it). The
  verdict says how many runs would resolve it if the runs' spread stays as measured, computed by
  the interval's own arithmetic at each larger number of runs.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gradaccum.errors import BenchError
from gradaccum.values import require_int

__all__ = [
    "ADOPT",
    "INCONCLUSIVE",
    "KEEP",
    "ArmFigures",
    "Criterion",
    "ParamCheck",
    "TraceCheck",
    "Verdict",
    "decide",
    "gain_interval",
]

ADOPT = "ADOPT"
KEEP = "KEEP BASELINE"
INCONCLUSIVE = "INCONCLUSIVE"
DEFAULT_MARGIN = 0.03
MIN_RUNS = 3
CONFIDENCE = 0.95
RESAMPLES = 2000
MAX_RUNS_SUGGESTED = 1000
ESTIMATOR = (
    "gain = exp(mean over runs of log(run's median paired ratio)) - 1, the centre of a Student-t "
    "interval of those log-ratios (one run: its median ratio - 1, bootstrap interval)"
)
"""What ``throughput_gain`` and ``interval`` are, in words (written to results.json)."""


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
    """ADOPT, KEEP BASELINE or INCONCLUSIVE, with every criterion and the figures behind them."""

    criteria: tuple[Criterion, ...]
    """Each criterion, in the protocol's order."""
    margin: float
    """The declared throughput margin (0.03 = 3 %)."""
    throughput_gain: float | None
    """The gain, the centre of ``interval`` on its log scale: exp(mean over runs of log(run's median
    paired ratio)) - 1 (one run: its median ratio - 1; no pairs: run r's candidate over baseline
    throughput in place of a run's median ratio)."""
    decision: str = KEEP
    """``ADOPT``, ``KEEP BASELINE`` or ``INCONCLUSIVE``."""
    interval: tuple[float, float] | None = None
    """The 95 % confidence interval of the gain (low, high), when it could be computed."""
    runs_to_resolve: int | None = None
    """For INCONCLUSIVE: the fewest runs whose interval (same centre, same spread) would decide."""
    run_ratios: tuple[float, ...] = ()
    """Each run's median ratio (candidate over baseline throughput), the figures the gain and its
    interval are computed from."""
    warnings: tuple[str, ...] = ()
    """Measurement warnings (the spread exceeds the margin, too few pairs)."""

    @property
    def adopt(self) -> bool:
        return self.decision == ADOPT

    @property
    def inconclusive(self) -> bool:
        return self.decision == INCONCLUSIVE

    @property
    def failed(self) -> list[Criterion]:
        return [c for c in self.criteria if not c.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "margin": self.margin,
            "throughput_gain": self.throughput_gain,
            "interval": None if self.interval is None else list(self.interval),
            "confidence": CONFIDENCE,
            "runs_to_resolve": self.runs_to_resolve,
            "run_ratios": list(self.run_ratios),
            "estimator": ESTIMATOR,
            "warnings": list(self.warnings),
            "criteria": [asdict(c) for c in self.criteria],
        }


def _tokens(base: ArmFigures, cand: ArmFigures, unit: str) -> Criterion:
    name = f"global valid {unit} per update equal"
    b, c = base.tokens_per_update, cand.tokens_per_update
    if not b or not c:
        return Criterion(name=name, passed=False, figure="no measured updates to compare")
    if b == c:
        runs = len(base.units_per_s_per_run)
        every = f"in each of the {runs} runs" if runs > 1 else "in the run"
        return Criterion(
            name=name,
            passed=True,
            figure=f"{sum(b):,} {unit} over {len(b)} updates {every} (the same data), identical on both "
            f"(per update {min(b):,}..{max(b):,})",
        )
    if len(b) != len(c):
        return Criterion(name=name, passed=False, figure=f"{len(b)} vs {len(c)} measured updates")
    i = next(i for i, (x, y) in enumerate(zip(b, c, strict=True)) if x != y)
    return Criterion(name=name, passed=False, figure=f"update {i}: baseline {b[i]:,} vs candidate {c[i]:,}")


def _updates(base: ArmFigures, cand: ArmFigures) -> Criterion:
    same = base.updates == cand.updates and base.global_batch == cand.global_batch
    runs = (len(base.units_per_s_per_run), len(cand.units_per_s_per_run))
    per_run = ""
    if runs[0] and runs[1] and base.updates % runs[0] == 0 and cand.updates % runs[1] == 0:
        per_run = f" ({runs[0]} runs x {base.updates // runs[0]} vs {runs[1]} x {cand.updates // runs[1]})"
    return Criterion(
        name="optimizer updates equal",
        passed=same and base.updates > 0,
        figure=(
            f"{base.updates} vs {cand.updates} updates in total{per_run} at global batch "
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


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values."""
    pos = q * (len(sorted_values) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


# Student t quantiles at 0.975 for 1..30 degrees of freedom; beyond, z + (z^3 + z) / (4 df)
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (a 95 % two-sided interval)."""
    if df < 1:
        raise BenchError("a t interval needs at least two runs")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df)


def _bootstrap(ratios: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1 - CONFIDENCE) / 2
    return _quantile(medians, tail) - 1, _quantile(medians, 1 - tail) - 1


def _t_interval(mean: float, spread: float, runs: int) -> tuple[float, float]:
    """exp(mean +- t(0.975, runs - 1) * spread / sqrt(runs)) - 1: the interval of the gain from the
    runs' log-ratios' mean and standard deviation."""
    half = t975(runs - 1) * spread / math.sqrt(runs)
    return math.expm1(mean - half), math.expm1(mean + half)


def _log_figures(runs: Sequence[Sequence[float]]) -> tuple[list[float], float, float]:
    """Each run's median ratio, and the mean and standard deviation of their logs."""
    medians = [float(statistics.median(run)) for run in runs]
    logs = [math.log(m) for m in medians]
    # equal logs: their mean exactly (fmean of n copies can round away from the value)
    mean = logs[0] if len(set(logs)) == 1 else statistics.fmean(logs)
    return medians, mean, statistics.stdev(logs)


def gain_interval(paired: Sequence[Sequence[float]]) -> tuple[float, tuple[float, float]]:
    """The gain and its 95 % interval, with the runs as the replicates; the gain is the centre.

    ``paired[r]`` holds run r's paired ratios (candidate over baseline throughput). With two or
    more runs: the gain is exp(mean) - 1 and the interval exp(mean +- t * s / sqrt(n)) - 1, over
    the runs' median log-ratios. With one run: the gain is its median ratio - 1 and the interval a
    percentile bootstrap of that median over its pairs (deterministic). Pure: no hidden state.
    """
    runs = [list(r) for r in paired if r]
    if not runs or any(x <= 0 for run in runs for x in run):
        raise BenchError("the gain's interval needs at least one positive paired ratio")
    if len(runs) == 1:
        return float(statistics.median(runs[0])) - 1, _bootstrap(runs[0])
    _, mean, spread = _log_figures(runs)
    return math.expm1(mean), _t_interval(mean, spread, len(runs))


def _unpaired(base: ArmFigures, cand: ArmFigures) -> list[list[float]]:
    """Without paired blocks: run r's candidate over run r's baseline throughput (the runs were
    interleaved A B A B, so each run's neighbour is its pair); every combination when they differ
    in number."""
    b, c = base.units_per_s_per_run, cand.units_per_s_per_run
    if len(b) == len(c):
        return [[y / x] for x, y in zip(b, c, strict=True) if x > 0]
    return [[y / x for x in b for y in c if x > 0]]


def _pct(ratios: Sequence[float]) -> str:
    return ", ".join(f"{r - 1:+.1%}" for r in ratios)


def _throughput(
    base: ArmFigures,
    cand: ArmFigures,
    paired: Sequence[Sequence[float]] | None,
    margin: float,
    min_runs: int,
    unit: str,
) -> tuple[Criterion, Criterion, float | None, tuple[float, float] | None, list[list[float]]]:
    name = f"throughput gain >= {margin:.1%}"
    ci_name = f"{CONFIDENCE:.0%} interval of the gain above 0"
    short = [
        f"{arm} has {len(a.units_per_s_per_run)} finished run(s)"
        + (f" and {a.runs_failed} failed" if a.runs_failed else "")
        for arm, a in (("baseline", base), ("candidate", cand))
        if len(a.units_per_s_per_run) < min_runs or a.runs_failed
    ]
    if not base.units_per_s_per_run or not cand.units_per_s_per_run:
        why = "; ".join(short) or "no finished run"
        return (
            Criterion(name=name, passed=False, figure=why),
            Criterion(name=ci_name, passed=False, figure=why),
            None,
            None,
            [],
        )
    b = statistics.median(base.units_per_s_per_run)
    c = statistics.median(cand.units_per_s_per_run)
    pairs = [list(r) for r in (paired or ()) if r]
    source = pairs if pairs else _unpaired(base, cand)
    gain, (low, high) = gain_interval(source)
    medians = [float(statistics.median(r)) for r in source]
    ratio = f"candidate over baseline {unit}/s"
    if pairs and len(pairs) > 1:
        how = (
            f"geometric mean over {len(pairs)} runs of each run's median paired ratio ({ratio} in "
            f"adjacent blocks; {sum(len(r) for r in pairs)} block pairs); the runs' medians: {_pct(medians)}"
        )
    elif pairs:
        how = f"median of one run's {len(pairs[0])} paired block ratios ({ratio} in adjacent blocks)"
    elif len(source) > 1:
        how = f"geometric mean over {len(source)} runs of run r's {ratio} (no paired blocks): {_pct(medians)}"
    else:
        how = f"median over every combination of the arms' runs of {ratio} (no paired blocks)"
    figure = (
        f"{gain:+.1%} = {how}. For scale, the median run's {unit}/s: candidate {c:,.0f}, "
        f"baseline {b:,.0f} (their ratio {c / b - 1:+.1%} is not the paired estimate)"
        if b > 0
        else f"{gain:+.1%} = {how}"
    )
    if short:
        figure += f"; needs >= {min_runs} finished runs each: " + "; ".join(short)
    runs_n = len(source)
    how_ci = (
        f"Student t over {runs_n} runs' median log-ratios, centred on the gain"
        if runs_n > 1
        else "bootstrap of one run's median ratio over its pairs"
    )
    ci_figure = f"[{low:+.1%}, {high:+.1%}] ({CONFIDENCE:.0%}, {how_ci})"
    gain_ok = not short and gain >= margin
    ci_ok = not short and low > 0
    return (
        Criterion(name=name, passed=gain_ok, figure=figure),
        Criterion(name=ci_name, passed=ci_ok, figure=ci_figure),
        gain,
        (low, high),
        source,
    )


def _runs_to_resolve(source: Sequence[Sequence[float]], margin: float) -> int | None:
    """The fewest runs whose interval decides, with the gain and the runs' spread as measured.

    The same arithmetic as :func:`gain_interval`: the interval at n runs is
    exp(mean +- t(n-1) s / sqrt(n)) - 1, and it decides when its low end clears 0 (a gain at or
    above the margin: ADOPT) or its high end falls under the margin (a gain below it: KEEP).
    """
    runs = [r for r in source if r]
    if len(runs) < 2:
        return None
    _, mean, spread = _log_figures(runs)
    adopting = math.expm1(mean) >= margin
    if spread == 0:
        return None
    for n in range(len(runs) + 1, MAX_RUNS_SUGGESTED + 1):
        low, high = _t_interval(mean, spread, n)
        if (low > 0) if adopting else (high < margin):
            return n
    return MAX_RUNS_SUGGESTED + 1


def decide(
    *,
    baseline: ArmFigures,
    candidate: ArmFigures,
    params: Sequence[ParamCheck],
    trace: TraceCheck | None,
    paired: Sequence[Sequence[float]] | None = None,
    margin: float = DEFAULT_MARGIN,
    min_runs: int = MIN_RUNS,
    unit: str = "tokens",
) -> Verdict:
    """Apply the adoption rule to measured figures; no I/O, no measurement, no randomness.

    ``paired``: per paired run, its block ratios (candidate over baseline throughput); without them
    the gain and its interval come from the per-run throughputs of the two arms.
    """
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < math.inf:
        raise BenchError(f"margin must be a non-negative fraction (0.03 = 3%), got {margin!r}")
    require_int("min_runs", min_runs, error=BenchError)
    throughput, interval_ok, gain, interval, source = _throughput(
        baseline, candidate, paired, margin, min_runs, unit
    )
    accounting = (
        _tokens(baseline, candidate, unit),
        _updates(baseline, candidate),
        _params(params),
        _trace(trace),
        _skips(baseline, candidate),
    )
    criteria = (*accounting, throughput, interval_ok)
    short = any(len(a.units_per_s_per_run) < min_runs or a.runs_failed for a in (baseline, candidate))
    warnings: list[str] = []
    runs_needed: int | None = None
    decided = False  # whether the interval itself decided (not an accounting failure)
    if all(c.passed for c in criteria):
        decision = ADOPT
        decided = True
    elif not all(c.passed for c in accounting) or gain is None or interval is None or short:
        decision = KEEP  # wrong arithmetic, or runs that did not finish: nothing to weigh
    elif interval[1] < margin:
        decision = KEEP  # confidently below the margin
        decided = True
    else:
        decision = INCONCLUSIVE
        runs_needed = _runs_to_resolve(source, margin)
    if interval is not None and interval[1] - interval[0] > margin:
        width = interval[1] - interval[0]
        warning = (
            f"the {CONFIDENCE:.0%} interval of the gain is {width:.1%} wide, wider than the margin "
            f"{margin:.1%}: between runs this machine's noise is larger than the margin, so a gain within "
            "about half that width of 0 or of the margin cannot be decided"
        )
        if decided and gain is not None:
            warning += f" (this one, {gain:+.1%}, is far enough from them to decide)"
        warnings.append(warning)
    if runs_needed is not None and runs_needed > MAX_RUNS_SUGGESTED:
        runs_needed = None
        warnings.append(
            f"the gain sits too close to the decision for any practical number of runs (> "
            f"{MAX_RUNS_SUGGESTED}) to resolve it: the two configurations are about as fast"
        )
    return Verdict(
        criteria=criteria,
        margin=margin,
        throughput_gain=gain,
        decision=decision,
        interval=interval,
        runs_to_resolve=runs_needed,
        warnings=tuple(warnings),
        run_ratios=tuple(float(statistics.median(r)) for r in source),
    )
