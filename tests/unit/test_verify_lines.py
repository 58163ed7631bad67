"""Each line of verify's reports true on its own, on reports built by hand for the cases a real run
rarely reaches: a trace that fails on skipped steps with figures inside the tolerance, non-finite
figures, and the scan's findings settled by what ran (``gradaccum.check.findings``)."""

from __future__ import annotations

import math

from gradaccum.check.balance import BalanceReport
from gradaccum.check.findings import settle_findings
from gradaccum.check.report import EquivalenceReport, TraceReport
from gradaccum.check.tolerances import Tolerance
from gradaccum.hazards.finding import Finding

TOL = Tolerance(value=1e-10, reason="float64 rounding")
TRACE_TOL = Tolerance(value=1e-4, reason="float32 rounding")


def _trace(candidate_loss: tuple[float, ...], loss_diff: float, passed: bool) -> TraceReport:
    return TraceReport(
        passed=passed,
        steps=2,
        dtype="float32",
        baseline_sizes=(8,),
        candidate_sizes=(2, 2, 2, 2),
        baseline_loss=(3.0, 2.0),
        candidate_loss=candidate_loss,
        baseline_grad_norm=(1.0, 1.0),
        candidate_grad_norm=(1.0, 1.0),
        loss_max_rel_diff=loss_diff,
        grad_norm_max_rel_diff=0.0,
        tol=TRACE_TOL,
    )


def test_a_trace_that_fails_on_skipped_steps_says_so_on_its_line() -> None:
    trace = _trace((3.0, math.nan), 0.0, passed=False)
    assert trace.failures == ("the sides skipped different steps (baseline none, candidate step 1)",)
    assert trace.summary().startswith(
        "FAIL: the sides skipped different steps (baseline none, candidate step 1); over 2 steps in float32, "
        "loss max rel diff 0.00e+00 (tol 1e-04), gradient-norm max rel diff 0.00e+00 (tol 1e-04)"
    )


def test_a_non_finite_trace_figure_is_named() -> None:
    trace = _trace((3.0, 2.0), math.inf, passed=False)
    assert trace.failures == ("loss max rel diff inf (non-finite, tol 1e-04)",)
    assert "loss max rel diff inf (non-finite, tol 1e-04)" in trace.summary()
    passing = _trace((3.0, 2.0), 1e-7, passed=True)
    assert passing.failures == ()
    assert passing.summary().startswith("PASS: over 2 steps in float32, loss max rel diff 1.00e-07, ")


def _report(grad: float, param: float, passed: bool) -> EquivalenceReport:
    return EquivalenceReport(
        passed=passed,
        grad_max_rel_err=grad,
        param_max_abs_diff=param,
        grad_tol=TOL,
        param_tol=TOL,
        worst=(),
        likely_causes=(),
        sizes=(2, 2),
        dtype="float64",
    )


def test_a_failed_update_marks_the_figure_over_its_tolerance() -> None:
    report = _report(math.nan, 1e-17, passed=False)
    assert report.failures == ("gradient max rel err nan (non-finite, tol 1e-10)",)
    assert report.summary() == (
        "FAIL: gradient max rel err nan (non-finite, tol 1e-10), parameter max abs diff 1.00e-17 "
        "(tol 1e-10), float64, micro-batches [2, 2]"
    )
    over = _report(1e-16, 3e-3, passed=False)
    assert over.failures == ("parameter max abs diff 3.00e-03 (over tol 1e-10)",)
    assert (
        _report(1e-16, 1e-17, passed=True)
        .summary()
        .startswith("PASS: gradient max rel err 1.00e-16 (tol 1e-10)")
    )


def _router() -> Finding:
    return Finding(
        code="moe-router",
        severity="error",
        path="",
        kind="MixtralForCausalLM",
        summary="routes tokens with load-balancing statistics computed per forward",
        explanation="per forward.",
        fix="balance over the window.",
    )


def _balance(exact: float) -> BalanceReport:
    return BalanceReport(
        errors={"exact": exact, "lagged": 0.07, "micro-batch": 0.08},
        from_exact={"exact": 0.0, "lagged": 0.075, "micro-batch": 0.076},
        tolerance=1e-10,
        sizes=(2, 2),
    )


def test_a_router_under_the_exact_balance_is_a_note_that_says_so() -> None:
    (note,) = settle_findings([_router()], passed=True, balance_mode="exact", balance=_balance(6e-16))
    assert note.severity == "info" and not note.breaks_equivalence
    assert note.handled_by == "the window's exact load balance (LoadBalance mode 'exact')"
    assert note.summary.endswith(
        ", handled here by the window's exact load balance (LoadBalance mode 'exact')"
    )
    assert "6.0e-16 from the full batch's objective" in note.explanation


def test_a_router_under_an_approximate_balance_is_a_warning_with_its_distance() -> None:
    (warning,) = settle_findings([_router()], passed=True, balance_mode="lagged", balance=_balance(6e-16))
    assert warning.severity == "warning"
    assert warning.summary.endswith(
        "; balanced here by LoadBalance mode 'lagged' as asked, 7.5e-02 from exact"
    )


def test_a_router_whose_balance_failed_stays_an_error_beside_the_fail() -> None:
    failed = _balance(0.3)
    assert failed.summary().startswith(
        "load balance: exact 3.0e-01 from the full batch's objective (tolerance 1e-10) FAIL (over"
    )
    (error,) = settle_findings([_router()], passed=failed.passed, balance_mode="exact", balance=failed)
    assert error.severity == "error"


def test_an_error_the_check_measured_away_is_a_warning_under_pass() -> None:
    unbalanced = settle_findings([_router()], passed=True, figure="gradient max rel err 3.00e-16, tol 1e-10")
    (warning,) = unbalanced
    assert warning.severity == "warning"
    assert warning.summary.endswith("; yet the check measured this update within its tolerance")
    assert warning.explanation.startswith(
        "Stage 1 measured the accumulated update within its tolerance (gradient max rel err 3.00e-16, "
        "tol 1e-10)"
    )
    assert settle_findings([_router()], passed=False)[0].severity == "error"


def test_in_batch_negatives_under_the_cache_are_a_note() -> None:
    hazard = Finding(
        code="declared-hazard",
        severity="error",
        path="",
        kind="loss",
        summary="uses in-batch negatives: each example meets only the examples of its own forward",
        explanation="fewer negatives.",
        fix="cache.",
    )
    (note,) = settle_findings([hazard], passed=True, cached=True)
    assert note.severity == "info"
    assert (
        note.headline
        == "the loss uses in-batch negatives, handled here by the gradient cache (CachedAccumulator)"
    )
