"""The token planner's promises over random windows (hypothesis), checked against brute force.

Whenever the window holds at least as many rows as ranks: every rank gets a micro-batch, every row
lies in exactly one micro-batch, every micro-batch is within the budget, and ``equal_count`` gives
equal counts; it refuses only a window that has no equal plan, which is found here independently
by enumerating every partition of the rows into micro-batches within the budget (small windows).
Rows without a valid token (prompt-only rows: a length, every label -100) weigh nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradaccum
from gradaccum.errors import PlanError
from gradaccum.tokens.balance import TokenPlan, plan_tokens


def _partitions(items: list[int]) -> Iterator[list[list[int]]]:
    """Every partition of ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for g in range(len(part)):
            yield [*part[:g], [first, *part[g]], *part[g + 1 :]]


def _equal_plan_exists(lengths: Sequence[int], budget: int, world: int) -> bool:
    """Some partition of the rows within the budget has a number of micro-batches ``world`` divides."""
    for part in _partitions(list(range(len(lengths)))):
        fits = all(len(g) * max(lengths[i] for i in g) <= budget for g in part)
        if fits and len(part) % world == 0:
            return True
    return False


@st.composite
def windows(draw: st.DrawFn) -> tuple[list[int], list[int], int, int]:
    rows = draw(st.integers(1, 7))
    world = draw(st.integers(1, min(rows, 4)))
    lengths = draw(st.lists(st.integers(1, 24), min_size=rows, max_size=rows))
    empty = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    valid = [0 if e else n for n, e in zip(lengths, empty, strict=True)]
    budget = max(lengths) * draw(st.integers(1, 4)) + draw(st.integers(0, 8))
    return lengths, valid, budget, world


def _check(plan: TokenPlan, rows: int, budget: int, world: int) -> None:
    assert len(plan.ranks) == world
    assert all(len(rank) >= 1 for rank in plan.ranks), [len(r) for r in plan.ranks]
    assert all(mb and plan.computed_tokens(mb) <= budget for rank in plan.ranks for mb in rank)
    assert sorted(i for rank in plan.ranks for mb in rank for i in mb) == list(range(rows))


@settings(max_examples=300, deadline=None)
@given(windows())
def test_every_rank_steps_and_equal_count_refuses_only_without_an_equal_plan(
    window: tuple[list[int], list[int], int, int],
) -> None:
    lengths, valid, budget, world = window
    _check(plan_tokens(lengths, budget, world=world, valid=valid), len(lengths), budget, world)
    exists = _equal_plan_exists(lengths, budget, world)
    try:
        plan = plan_tokens(lengths, budget, world=world, equal_count=True, valid=valid)
    except PlanError as err:
        assert not exists, f"refused a window with an equal plan: {err}"
        assert "no multiple of" in str(err)
        return
    assert exists
    _check(plan, len(lengths), budget, world)
    assert len({len(rank) for rank in plan.ranks}) == 1


def test_a_prompt_only_row_does_not_leave_a_rank_empty() -> None:
    # four rows, the third with no label to train: its zero weight used to land it beside another
    # micro-batch, leaving rank 3 with none ([2, 1, 1, 0] micro-batches)
    plan = plan_tokens([26, 5, 6, 18], 26, world=4, valid=[26, 5, 0, 18])
    assert [len(rank) for rank in plan.ranks] == [1, 1, 1, 1]
    labels = torch.full((4, 26), -100)
    for row, n in enumerate([26, 5, 6, 18]):
        if row != 2:
            labels[row, :n] = 7
    batch = {"input_ids": torch.ones(4, 26, dtype=torch.long), "labels": labels}
    for rank in range(4):
        assert len(gradaccum.split_by_tokens(batch, 26, rank=rank, world=4)) == 1


def test_equal_count_finds_the_equal_plan_a_balancing_split_needs() -> None:
    # 5 rows of 20 tokens, budget 40, 4 ranks: (2, 1, 1, 1) rows fit; the search for a better
    # balanced plan used to ask for 4 more micro-batches than 5 rows can fill, and refused
    plan = plan_tokens([20] * 5, 40, world=4, equal_count=True)
    assert [len(rank) for rank in plan.ranks] == [1, 1, 1, 1]
    assert sorted(sum(len(mb) for mb in rank) for rank in plan.ranks) == [1, 1, 1, 2]


def test_equal_count_without_an_equal_plan_says_why() -> None:
    with pytest.raises(PlanError, match=r"5 rows need at least 5 micro-batches .* no multiple of 4"):
        plan_tokens([20] * 5, 20, world=4, equal_count=True)
