"""The scan's findings in the light of what the check ran and measured.

The scan (:mod:`gradaccum.hazards.scanner`) reads a model and a plan: its ``error`` says "the
accumulated gradient differs from the full batch's, so verify fails". ``verify`` then runs one path
and measures it, which settles some findings:

* what gradaccum's own path removes is a note that says so (:meth:`Finding.handled`): in-batch
  negatives under the gradient cache (``--cached``); a router's per-forward balancing statistics
  under the window's exact load balance (``LoadBalance`` mode ``exact``, whose term the balance
  check measured against the full batch's objective);
* a router balanced by an approximate mode (``lagged``, ``micro-batch``) as asked is a warning
  naming how far that mode is from exact;
* any other ``error`` finding under a stage 1 that measured the update within its tolerance is a
  warning that says the measurement found no effect on this loss and partition: an error line under
  a PASS would contradict it.

So no output that passes carries an ``error``, and each finding says which of these applies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from gradaccum.hazards.finding import Finding

if TYPE_CHECKING:
    from gradaccum.check.balance import BalanceReport

__all__ = ["settle_findings"]

_RANK = {"error": 0, "warning": 1, "info": 2}


def _cached(finding: Finding) -> Finding:
    return finding.handled(
        "the gradient cache (CachedAccumulator)",
        explanation="CachedAccumulator computes the loss over the whole window's representations, so every "
        "example meets every negative of the step, as in one full batch.",
        fix="None while training with CachedAccumulator; the plain Accumulator would not be exact.",
        clause="uses in-batch negatives",
    )


def _balanced(finding: Finding, mode: str, balance: BalanceReport | None) -> Finding:
    """A router finding under the load balance ``mode`` the command runs. Under ``off`` nothing of
    gradaccum's balances it: the measurement alone settles it (see :func:`settle_findings`)."""
    if balance is None or mode == "off":
        return finding
    exact = balance.errors["exact"]
    if mode == "exact" and balance.passed:
        return finding.handled(
            "the window's exact load balance (LoadBalance mode 'exact')",
            explanation="The balancing term is computed once per optimizer step from the whole window's "
            f"routing statistics; the balance check measured its update {exact:.1e} from the full "
            f"batch's objective (tolerance {balance.tolerance:.0e}), and the model's own per-forward "
            "term is turned off.",
            fix="None while training with gradaccum's load balance (train, exact_trainer, or "
            "Accumulator(..., balance=LoadBalance.from_model(model))).",
        )
    if mode in balance.from_exact and mode != "exact":
        return finding.measured(
            "warning",
            summary=f"balanced here by LoadBalance mode {mode!r} as asked, {balance.from_exact[mode]:.1e} "
            "from exact",
            explanation=f"The {mode!r} balancing term is an approximation by design; the balance check "
            f"measured its update {balance.from_exact[mode]:.1e} (relative L2) from the exact mode's.",
        )
    return finding


def settle_findings(
    findings: Iterable[Finding],
    *,
    passed: bool,
    figure: str = "",
    cached: bool = False,
    balance_mode: str | None = None,
    balance: BalanceReport | None = None,
) -> tuple[Finding, ...]:
    """``findings`` settled by what ran (see the module docstring), errors first.

    ``passed``: stage 1 measured the update within its tolerances (``figure`` says by how much);
    ``cached``: the candidate was the gradient cache; ``balance_mode``: the load balance the command
    runs a routing model with (``exact``, ``lagged``, ``micro-batch``, ``off``; ``None``: no router
    recognised), and ``balance`` the balance check's report when it ran.
    """
    settled = []
    for finding in findings:
        if (
            cached
            and finding.code == "declared-hazard"
            and finding.summary.startswith("uses in-batch negatives")
        ):
            finding = _cached(finding)
        elif finding.code == "moe-router" and finding.breaks_equivalence and balance_mode is not None:
            finding = _balanced(finding, balance_mode, balance)
        if finding.breaks_equivalence and passed:
            finding = finding.measured(
                "warning",
                summary="yet the check measured this update within its tolerance",
                explanation=f"Stage 1 measured the accumulated update within its tolerance ({figure}) for "
                "this loss and partition, so this did not change the gradient checked here (the loss may "
                "not use it, or this partition may not show it); another loss or partition may.",
            )
        settled.append(finding)
    return tuple(sorted(settled, key=lambda f: _RANK[f.severity]))
