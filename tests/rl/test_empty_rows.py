"""Rows without a response token: how the sequence aggregations count them, and what they may hold.

The rollout of tests/rl/common.py has one such row in eight (row 3). The reference walks the rows in
Python and divides by the 7 sequences with a response; ``empty_rows="counted"`` divides by all 8
rows (TRL 1.16's grpo/dr_grpo), so its update is the reference times 7/8 exactly. Float64: only
the summation order differs (~1e-16); 1e-10 still sees the 8/7 factor (an error of 0.14).
"""

from __future__ import annotations

import pytest
import torch

import gradaccum
from gradaccum.errors import ConfigError
from gradaccum.rl import AGGREGATIONS, PolicyLoss
from tests.rl import common

TOL = 1e-10
EMPTY_ROW = 3


def _step(batch: dict, loss: PolicyLoss, rows: int) -> tuple[gradaccum.StepResult, dict[str, torch.Tensor]]:
    model = common.TinyPolicy()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0))
    result = acc.step(gradaccum.split(batch, micro_batch=rows), loss.loss_fn, loss.count_fn)
    return result, common.grads(model)


@pytest.mark.parametrize("aggregation", AGGREGATIONS[1:])
def test_counted_empty_rows_divide_by_every_row(aggregation: str) -> None:
    batch = common.rollout()
    assert not batch["response_mask"][EMPTY_ROW].any()
    sequences = sum(1 for _, r in common.SHAPES if r)
    want_excluded = common.reference_grads(batch, aggregation)
    want_counted = common.reference_grads(batch, aggregation, scale=sequences / len(common.SHAPES))
    for empty_rows, want in (("excluded", want_excluded), ("counted", want_counted)):
        loss = PolicyLoss(**common.loss_kwargs(aggregation), empty_rows=empty_rows)  # type: ignore[arg-type]
        assert int(loss.count_fn(batch)) == (sequences if empty_rows == "excluded" else len(common.SHAPES))
        for rows in (1, 2, 8):
            _, got = _step(batch, loss, rows)
            assert common.rel_err(got, want) < TOL, (empty_rows, rows)


def test_token_mean_is_the_same_under_both_conventions() -> None:
    batch = common.rollout()
    counts = {e: int(PolicyLoss("token-mean", empty_rows=e).count_fn(batch)) for e in ("excluded", "counted")}  # type: ignore[arg-type]
    assert counts["excluded"] == counts["counted"] == sum(r for _, r in common.SHAPES)


def test_an_unknown_convention_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"empty_rows must be one of \['excluded', 'counted'\]"):
        PolicyLoss(empty_rows="dropped")  # type: ignore[arg-type]


@pytest.mark.parametrize("per_token", [False, True], ids=["row-advantage", "token-advantages"])
def test_a_nan_advantage_on_a_row_without_response_is_never_read(per_token: bool) -> None:
    """The same rule per row and per token: an advantage where no token is trained is zeroed.
    (A NaN per-row advantage on the empty row used to make the window's loss NaN: skipped.)"""
    batch = common.rollout(per_token=per_token)
    want = common.reference_grads(batch, "seq-mean-token-mean")
    batch["advantages"][EMPTY_ROW] = float("nan")
    loss = PolicyLoss(**common.loss_kwargs("seq-mean-token-mean"))
    result, got = _step(batch, loss, 4)
    assert result.applied, result.skip_reason
    assert common.rel_err(got, want) < TOL


def test_a_nan_advantage_on_a_trained_row_still_skips_the_window() -> None:
    batch = common.rollout()
    batch["advantages"][0] = float("nan")
    result, _ = _step(batch, PolicyLoss(**common.loss_kwargs("token-mean")), 4)
    assert not result.applied
