"""The adoption rule as a pure function: all criteria pass -> ADOPT; each one failing alone -> KEEP.

Figures are made up; no measurement runs. Throughputs are chosen with a clear gap to the 3% margin
except in the boundary cases, which test the margin itself.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gradaccum.bench.spec import BenchError
from gradaccum.bench.verdict import ADOPT, KEEP, ArmFigures, ParamCheck, TraceCheck, decide

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
PARAMS = (
    ParamCheck(
        label="baseline 8x4",
        grad_max_rel_err=7e-16,
        grad_tol=1e-10,
        param_max_abs_diff=3e-17,
        param_tol=1e-10,
        passed=True,
    ),
    ParamCheck(
        label="candidate 4x8",
        grad_max_rel_err=8e-16,
        grad_tol=1e-10,
        param_max_abs_diff=3e-17,
        param_tol=1e-10,
        passed=True,
    ),
)
TRACE = TraceCheck(passed=True, figure="over 8 steps in float32, loss max rel diff 5e-08 (tol 1e-04)")
NAMES = [
    "global valid tokens per update equal",
    "optimizer updates equal",
    "parameter delta within tolerance (float64)",
    "production-precision traces agree",
    "skipped-step rate not worse",
    "median throughput gain >= 3.0%",
]


def verdict(**changes: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = {"baseline": BASE, "candidate": CAND, "params": PARAMS, "trace": TRACE}
    args.update(changes)
    return decide(**args)  # type: ignore[arg-type]


def failing(v) -> list[str]:  # type: ignore[no-untyped-def]
    return [c.name for c in v.criteria if not c.passed]


def test_all_criteria_pass_adopts_and_reports_every_figure() -> None:
    v = verdict()
    assert v.adopt and v.decision == ADOPT
    assert [c.name for c in v.criteria] == NAMES
    assert v.throughput_gain == pytest.approx(1100 / 1000 - 1)  # medians 1100 and 1000
    assert "+10.0%" in v.criteria[-1].figure and "1,100" in v.criteria[-1].figure
    assert "1,543 in 3 updates" in v.criteria[0].figure  # 500 + 431 + 612
    assert v.to_dict()["decision"] == ADOPT


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
        (replace(CAND, units_per_s_per_run=(1020.0, 1025.0, 1029.0)), NAMES[5], "+2.5%"),
        (replace(CAND, units_per_s_per_run=(900.0, 905.0, 910.0)), NAMES[5], "-9.5%"),
        (replace(CAND, units_per_s_per_run=(1100.0, 1100.0)), NAMES[5], "needs >= 3 finished runs"),
        (replace(CAND, runs_failed=1), NAMES[5], "1 failed"),
    ],
)
def test_each_measured_criterion_failing_alone_keeps_the_baseline(
    candidate: ArmFigures, name: str, figure: str
) -> None:
    v = verdict(candidate=candidate)
    assert v.decision == KEEP
    assert failing(v) == [name]
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
    exact = replace(CAND, units_per_s_per_run=(1030.0, 1030.0, 1030.0))
    base = replace(BASE, units_per_s_per_run=(1000.0, 1000.0, 1000.0))
    # 1030/1000 - 1 = 0.030000000000000027 in binary floating point: on the margin, not below it
    assert verdict(baseline=base, candidate=exact).adopt
    assert not verdict(baseline=base, candidate=exact, margin=0.05).adopt
    assert verdict(candidate=replace(CAND, units_per_s_per_run=(1001.0, 1001.0, 1001.0)), margin=0.0).adopt
    assert "0.0%" in verdict(margin=0.0).criteria[-1].name


def test_the_median_not_the_mean_decides() -> None:
    # one fast outlier run lifts the mean by 40% but not the median (+1%)
    cand = replace(CAND, units_per_s_per_run=(1010.0, 2200.0, 1000.0))
    assert failing(verdict(candidate=cand)) == [NAMES[5]]


@pytest.mark.parametrize("margin", [-0.01, float("nan"), float("inf")])
def test_a_meaningless_margin_is_refused(margin: float) -> None:
    with pytest.raises(BenchError, match="margin"):
        verdict(margin=margin)
