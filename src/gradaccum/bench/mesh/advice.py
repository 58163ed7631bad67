"""Which sync policy for a memory budget: the least communication whose gradient memory fits.

Communication is compared by the bytes counted per update (then the calls); gradient memory by
the bytes held between micro-batches, the largest over ranks. Without a budget the advice states
the trade-off instead of choosing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradaccum.bench.mesh.model import PolicyBench
from gradaccum.bench.report import fmt_bytes
from gradaccum.fielddocs import document_fields

__all__ = ["PolicyAdvice", "advise_policy"]


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyAdvice:
    """The advisor's choice of sync policy."""

    budget_bytes: int | None
    """Gradient memory allowed per rank (``--memory-budget``); None: no budget given."""
    chosen: str | None
    """The policy with the least communication whose gradients held fit the budget; None without a
    budget or when none fits."""
    sentence: str
    """Why, in one sentence."""


def _cost(p: PolicyBench) -> str:
    held = fmt_bytes(p.grad_bytes_held)
    return f"{fmt_bytes(p.comm_bytes)} in {p.comm_calls} calls per update, holding {held}"


def advise_policy(policies: Sequence[PolicyBench], budget_bytes: int | None) -> PolicyAdvice:
    """The cheapest policy in communication among those whose gradient memory fits the budget."""
    ranked = sorted(policies, key=lambda p: (p.comm_bytes, p.comm_calls))
    if not ranked:
        return PolicyAdvice(budget_bytes=budget_bytes, chosen=None, sentence="no policy was measured")
    if budget_bytes is None:
        cheapest, leanest = ranked[0], min(ranked, key=lambda p: (p.grad_bytes_held, p.comm_bytes))
        sentence = (
            f"{cheapest.policy} communicates least ({_cost(cheapest)}); {leanest.policy} holds least "
            f"({_cost(leanest)}); give --memory-budget to choose"
            if cheapest is not leanest
            else f"{cheapest.policy} both communicates and holds least ({_cost(cheapest)})"
        )
        return PolicyAdvice(budget_bytes=None, chosen=None, sentence=sentence)
    fits = [p for p in ranked if p.grad_bytes_held <= budget_bytes]
    budget = fmt_bytes(budget_bytes)
    if not fits:
        leanest = min(ranked, key=lambda p: p.grad_bytes_held)
        return PolicyAdvice(
            budget_bytes=budget_bytes,
            chosen=None,
            sentence=f"no policy's gradients fit {budget} per rank: the least, {leanest.policy}, holds "
            f"{fmt_bytes(leanest.grad_bytes_held)}; shard wider (a larger dp_shard) or raise the budget",
        )
    chosen = fits[0]
    over = [p for p in ranked[: ranked.index(chosen)]]
    why = (
        "; "
        + ", ".join(f"{p.policy} communicates less but holds {fmt_bytes(p.grad_bytes_held)}" for p in over)
        if over
        else ""
    )
    return PolicyAdvice(
        budget_bytes=budget_bytes,
        chosen=chosen.policy,
        sentence=f"{chosen.policy}: the least communication ({_cost(chosen)}) whose gradients fit "
        f"{budget} per rank{why}",
    )
