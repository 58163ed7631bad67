"""The adoption rule as a pure function: ADOPT, KEEP BASELINE, or INCONCLUSIVE when noise decides.

Figures are made up; no measurement runs. Paired ratios (candidate over baseline throughput per
block pair) are drawn around a chosen gain with a chosen spread, so each case's verdict follows from
the arithmetic of the interval: a clear gain, a clear loss, a noisy small gain.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from gradaccum.bench.spec import BenchError
from gradaccum.bench.verdict import (
    ADOPT,
    INCONCLUSIVE,
    KEEP,
    ArmFigures,
    ParamCheck,
    TraceCheck,
    decide,
    gain_interval,
)

TOKENS = (500, 431, 612)
BASE = ArmFigures(
    label="8x4",
    global_batch=32,
    tokens_per_update=TOKENS,
    updates=90,
    skipped_updates=0,
    units_per_s_per_run=(1000.0, 1010.0, 990.0),
)
CAND = replace(BASE, label="4x8", units_per_s_per_run=(1100.0, 1080.0, 1120.0))  # +10% median
_PARAM = ParamCheck(
    label="baseline 8x4",
    grad_max_rel_err=7e-16,
    grad_tol=1e-10,
    param_max_abs_diff=3e-17,
    param_tol=1e-10,
    passed=True,
)
PARAMS = (_PARAM, replace(_PARAM, label="candidate 4x8", grad_max_rel_err=8e-16))
TRACE = TraceCheck(passed=True, figure="over 8 steps in float32, loss max rel diff 5e-08 (tol 1e-04)")
NAMES = [
    "global valid tokens per update equal",
    "optimizer updates equal",
    "parameter delta within tolerance (float64)",
    "production-precision traces agree",
    "skipped-step rate not worse",
    "throughput gain >= 3.0%",
    "95% interval of the gain above 0",
]


def pairs(
    gain: float, spread: float, *, runs: int = 3, per_run: int = 10, seed: int = 1
) -> list[list[float]]:
    """Paired ratios 1 + gain + uniform noise of +-spread, ``per_run`` pairs in each of ``runs``."""
    rng = random.Random(seed)
    return [[1 + gain + rng.uniform(-spread, spread) for _ in range(per_run)] for _ in range(runs)]


CLEAR_GAIN = pairs(0.10, 0.01)


def verdict(**changes: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = {
        "baseline": BASE,
        "candidate": CAND,
        "params": PARAMS,
        "trace": TRACE,
        "paired": CLEAR_GAIN,
    }
    args.update(changes)
    return decide(**args)  # type: ignore[arg-type]


def failing(v) -> list[str]:  # type: ignore[no-untyped-def]
    return [c.name for c in v.criteria if not c.passed]


def test_all_criteria_pass_adopts_and_reports_every_figure() -> None:
    v = verdict()
    assert v.adopt and v.decision == ADOPT
    assert [c.name for c in v.criteria] == NAMES
    assert v.throughput_gain == pytest.approx(0.10, abs=0.01)  # the runs' median paired ratios
    assert v.interval is not None and 0.09 < v.interval[0] < v.interval[1] < 0.11
    figure = v.criteria[5].figure
    assert "geometric mean over 3 runs of each run's median paired ratio" in figure and "1,100" in figure
    assert "1,543 tokens over 3 updates in each of the 3 runs" in v.criteria[0].figure  # 500 + 431 + 612
    assert "90 vs 90 updates in total (3 runs x 30 vs 3 x 30)" in v.criteria[1].figure
    assert v.to_dict()["decision"] == ADOPT and v.to_dict()["interval"] == list(v.interval)


def test_a_clear_loss_keeps_the_baseline_with_the_interval_below_the_margin() -> None:
    v = verdict(paired=pairs(-0.10, 0.02))
    assert v.decision == KEEP and v.interval is not None and v.interval[1] < 0
    assert v.runs_to_resolve is None


def runs_like(mean: float, sd: float, n: int) -> list[list[float]]:
    """``n`` one-pair runs whose log-ratios have exactly this mean and sample standard deviation."""
    half = (n - 1) // 2
    z = [1.0] * half + [-1.0] * half + ([0.0] if n % 2 else [])
    if n % 2 == 0:
        z = [x * math.sqrt((n - 1) / n) for x in [1.0] * (n // 2) + [-1.0] * (n // 2)]
    return [[math.exp(mean + sd * x)] for x in z]


@pytest.mark.parametrize(("gain", "sd", "expected"), [(0.05, 0.04, ADOPT), (0.01, 0.04, KEEP)])
def test_runs_to_resolve_is_the_interval_s_own_arithmetic(gain: float, sd: float, expected: str) -> None:
    # deterministic: runs built with exactly the measured centre and spread decide at runs_to_resolve
    # runs and not one run earlier (a gain at or above the margin clears 0; one below falls under it)
    v = verdict(paired=runs_like(math.log1p(gain), sd, 3))
    assert v.decision == INCONCLUSIVE and v.runs_to_resolve is not None and v.runs_to_resolve > 4
    n = v.runs_to_resolve
    assert verdict(paired=runs_like(math.log1p(gain), sd, n)).decision == expected
    assert verdict(paired=runs_like(math.log1p(gain), sd, n - 1)).decision == INCONCLUSIVE


def test_a_noisy_small_gain_is_inconclusive_and_says_how_many_runs_would_resolve_it() -> None:
    v = verdict(paired=pairs(0.035, 0.15))
    assert v.decision == INCONCLUSIVE and not v.adopt
    assert v.interval is not None and v.interval[0] < 0 < v.margin < v.interval[1]
    assert v.runs_to_resolve is not None and v.runs_to_resolve > 3
    assert any("wider than the margin" in w for w in v.warnings)
    # with that many runs of the same centre and spread, the interval clears zero: ADOPT, not maybe
    assert v.throughput_gain is not None and v.throughput_gain >= v.margin
    mean, sd = _log_moments(v.run_ratios)
    assert verdict(paired=runs_like(mean, sd, v.runs_to_resolve)).decision == ADOPT


def _log_moments(ratios: tuple[float, ...]) -> tuple[float, float]:
    logs = [math.log(r) for r in ratios]
    return statistics.fmean(logs), statistics.stdev(logs)


def test_the_gain_is_the_centre_of_its_interval_not_the_pooled_median() -> None:
    # runs whose pooled median (1.12) sits far from the centre of the runs' interval
    data = [[1.12, 1.13, 1.11, 1.12, 1.14], [1.12, 1.11, 1.13, 1.10, 1.12], [0.80, 0.81, 0.79, 0.80, 0.82]]
    v = verdict(paired=data)
    assert v.interval is not None and v.throughput_gain is not None
    low, high = v.interval
    centre = math.expm1((math.log1p(low) + math.log1p(high)) / 2)  # the centre on the log scale
    assert v.throughput_gain == pytest.approx(centre, rel=1e-12)
    medians = [statistics.median(r) for r in data]
    assert v.run_ratios == tuple(medians)
    assert v.throughput_gain == pytest.approx(math.prod(medians) ** (1 / 3) - 1, rel=1e-12)
    assert v.to_dict()["throughput_gain"] == v.throughput_gain
    assert f"{v.throughput_gain:+.1%} = geometric mean" in v.criteria[5].figure


def test_the_width_warning_compares_the_width_with_the_margin() -> None:
    v = verdict(paired=runs_like(math.log(0.64), 0.03, 3))  # a clear loss, measured noisily
    assert v.decision == KEEP and v.interval is not None and v.interval[1] - v.interval[0] > v.margin
    (warning,) = v.warnings
    assert "wider than the margin 3.0%" in warning and "far enough from them to decide" in warning
    assert "larger than the difference being measured" not in warning


def test_a_median_gain_above_the_margin_with_an_interval_through_zero_is_inconclusive() -> None:
    v = verdict(paired=[[1.20, 0.95, 1.04, 1.06], [1.05, 0.90, 1.12, 0.99], [1.08, 1.30, 0.93, 1.03]])
    assert v.throughput_gain is not None and v.throughput_gain >= 0.03
    assert v.interval is not None and v.interval[0] <= 0
    assert v.decision == INCONCLUSIVE


def test_a_tight_a_a_comparison_keeps_the_baseline_and_a_noisy_one_never_adopts() -> None:
    assert verdict(paired=pairs(0.0, 0.005)).decision == KEEP
    for seed in range(20):
        assert not verdict(paired=pairs(0.0, 0.08, seed=seed)).adopt


def test_the_interval_is_deterministic_and_takes_the_runs_as_replicates() -> None:
    data = pairs(0.05, 0.1)
    assert gain_interval(data) == gain_interval(data)
    # the same pairs in one run, or split over runs that differ from each other: the spread between
    # runs widens the interval even though the pooled median is the same
    one_run = [[r for run in data for r in run]]
    shifted = [[x + d for x in run] for run, d in zip(data, (-0.05, 0.0, 0.05), strict=True)]
    _, (lo1, hi1) = gain_interval(one_run)
    _, (lo2, hi2) = gain_interval(shifted)
    assert hi2 - lo2 > hi1 - lo1


@pytest.mark.parametrize(
    ("candidate", "name", "figure"),
    [
        (
            replace(CAND, tokens_per_update=(500, 430, 612)),
            NAMES[0],
            "update 1: baseline 431 vs candidate 430",
        ),
        (replace(CAND, tokens_per_update=(500, 431)), NAMES[0], "3 vs 2 measured updates"),
        (replace(CAND, tokens_per_update=()), NAMES[0], "no measured updates"),
        (replace(CAND, updates=87), NAMES[1], "90 vs 87 updates"),
        (replace(CAND, global_batch=16), NAMES[1], "global batch 32 vs 16"),
        (replace(CAND, skipped_updates=1), NAMES[4], "candidate 1/90 (1.1%) vs baseline 0/90"),
        (replace(CAND, units_per_s_per_run=(1100.0, 1100.0)), NAMES[5], "needs >= 3 finished runs"),
        (replace(CAND, runs_failed=1), NAMES[5], "1 failed"),
    ],
)
def test_each_measured_criterion_failing_alone_keeps_the_baseline(
    candidate: ArmFigures, name: str, figure: str
) -> None:
    v = verdict(candidate=candidate)
    assert v.decision == KEEP
    # a run that did not finish also leaves the interval criterion unmet
    expected = [name] if name != NAMES[5] else [NAMES[5], NAMES[6]]
    assert failing(v) == expected
    assert figure in v.criteria[NAMES.index(name)].figure


def test_a_failed_equivalence_check_keeps_the_baseline_and_names_the_cause() -> None:
    broken = replace(
        PARAMS[1],
        grad_max_rel_err=0.12,
        param_max_abs_diff=3e-3,
        passed=False,
        causes=("loss_fn returns a mean",),
    )
    v = verdict(params=(PARAMS[0], broken))
    assert failing(v) == [NAMES[2]]
    assert "likely cause: loss_fn returns a mean" in v.criteria[2].figure
    # figures beyond tolerance fail even if a report claims to pass
    v = verdict(params=(PARAMS[0], replace(PARAMS[1], param_max_abs_diff=2e-10)))
    assert failing(v) == [NAMES[2]]
    assert failing(verdict(params=())) == [NAMES[2]]


def test_failed_or_missing_traces_keep_the_baseline() -> None:
    assert failing(verdict(trace=TraceCheck(passed=False, figure="loss max rel diff 3e-02"))) == [NAMES[3]]
    assert failing(verdict(trace=None)) == [NAMES[3]]


def test_skip_rate_is_compared_as_a_rate_and_equal_rates_pass() -> None:
    base = replace(BASE, skipped_updates=2)
    assert failing(verdict(baseline=base, candidate=replace(CAND, skipped_updates=2))) == []
    assert failing(verdict(baseline=base, candidate=replace(CAND, skipped_updates=1))) == []


def test_the_margin_is_inclusive_and_declared() -> None:
    exact = [[1.03] * 10] * 3
    # 1.03 - 1 = 0.030000000000000027 in binary floating point: on the margin, not below it
    assert verdict(paired=exact).adopt
    assert verdict(paired=exact, margin=0.05).decision == KEEP  # interval [3%, 3%] below 5%
    assert verdict(paired=[[1.001] * 10] * 3, margin=0.0).adopt
    assert "0.0%" in verdict(margin=0.0).criteria[5].name


def test_a_run_s_median_not_its_mean_counts() -> None:
    # one fast outlier pair in each run lifts each run's mean by 40% but not its median (+1%)
    v = verdict(paired=[[1.01] * 9 + [5.0]] * 3)
    assert v.throughput_gain == pytest.approx(0.01, rel=1e-9)
    assert NAMES[5] in failing(v) and not v.adopt


def test_without_pairs_the_runs_themselves_are_compared() -> None:
    v = verdict(paired=None)
    assert v.adopt  # +10% with runs 1080..1120 against 990..1010
    assert "geometric mean over 3 runs of run r's candidate over baseline tokens/s" in v.criteria[5].figure


@pytest.mark.parametrize("margin", [-0.01, float("nan"), float("inf")])
def test_a_meaningless_margin_is_refused(margin: float) -> None:
    with pytest.raises(BenchError, match="margin"):
        verdict(margin=margin)
