"""``TrainSpec.accum_steps`` (``train --accum-steps K``): the plan from the batch equation global
batch = micro-batch x processes x K, with the given flags or their defaults, and every contradiction
refused naming the flags, their values and what would fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradaccum.errors import PlanError
from gradaccum.plan import BatchPlan
from gradaccum.train.resolve import resolve_spec
from gradaccum.train.spec import DEFAULT_MICRO_BATCH, TrainSpec


def _plan(world: int = 1, **fields: object) -> BatchPlan:
    spec = TrainSpec(**fields)  # type: ignore[arg-type]
    return resolve_spec(spec, world=world, device="cpu", run_dir=Path("unused"), resume=None).config.plan


@pytest.mark.parametrize(
    ("world", "fields", "plan"),
    [
        (1, {"accum_steps": 2}, (DEFAULT_MICRO_BATCH, 2, 1)),  # the micro-batch keeps its default
        (2, {"accum_steps": 3, "micro_batch": 4}, (4, 3, 2)),
        (2, {"accum_steps": 2, "global_batch": 16}, (4, 2, 2)),  # 16 / (2 x 2)
        (1, {"accum_steps": 4, "global_batch": 32, "micro_batch": 8}, (8, 4, 1)),
    ],
)
def test_the_plan_follows_the_batch_equation(world: int, fields: dict, plan: tuple[int, int, int]) -> None:
    got = _plan(world, **fields)
    assert (got.micro_batch, got.accum_steps, got.dp) == plan
    assert got.global_batch == got.micro_batch * got.dp * got.accum_steps


def test_a_contradiction_names_the_flags_and_what_fits() -> None:
    with pytest.raises(PlanError) as err:
        _plan(2, accum_steps=3, global_batch=32, micro_batch=8)
    assert str(err.value) == (
        "--global-batch 32 contradicts --micro-batch 8 x 2 processes x --accum-steps 3 = 48 (global batch = "
        "micro-batch x processes x accum steps); use --accum-steps 2 for --global-batch 32 or --global-batch "
        "48 or two of the three flags"
    )


def test_a_global_batch_the_steps_do_not_divide_is_refused() -> None:
    with pytest.raises(PlanError, match=r"use --accum-steps 3 or 5, or --global-batch 28 or 32$"):
        _plan(1, accum_steps=4, global_batch=30)
    with pytest.raises(PlanError, match=r"not a multiple of 2 x 1 = 2; use --global-batch 6 or 8$"):
        _plan(2, accum_steps=1, global_batch=7)  # odd: no accum steps on 2 processes fits


def test_accum_steps_beside_a_token_budget_is_refused() -> None:
    with pytest.raises(PlanError, match=r"--max-tokens 256 cuts .* --accum-steps 2 fixes it"):
        TrainSpec(accum_steps=2, max_tokens=256)


def test_a_run_card_fixes_accum_steps(tmp_path: Path) -> None:
    from gradaccum.runcard import RunCard, write_runcard

    card = tmp_path / "card.json"
    write_runcard(
        RunCard(workload="gradaccum.examples:tiny_gpt", plan=BatchPlan(micro_batch=4, accum_steps=2, dp=1)),
        card,
    )
    with pytest.raises(PlanError, match=r"--accum-steps 3 \(the card has 2 \(global_batch = micro_batch 4"):
        _plan(1, runcard=card, accum_steps=3)
