"""The advisor as a pure function of measured rows (synthetic figures): the fastest row within the
budget and the sentence that says why; the persistent wall; what to try when nothing fits.

Also the sweep's rows: every plan x sharding x checkpointing, FSDP2 rows with deferral on and off.
"""

from __future__ import annotations

import pytest

from gradaccum.bench.advisor import Row, advise
from gradaccum.bench.models import fit_memory_model
from gradaccum.bench.spec import MeasureSettings
from gradaccum.bench.sweep import SweepSpec
from gradaccum.errors import BenchError
from gradaccum.plan import BatchPlan

GIB = 1024**3


def row(
    micro: int,
    accum: int,
    units_per_s: float,
    memory_gib: float,
    *,
    ckpt: bool = False,
    fsdp: bool = False,
    defer: bool = True,
    dp: int = 1,
    persistent_gib: float = 1.0,
) -> Row:
    plan = BatchPlan(micro_batch=micro, accum_steps=accum, dp=dp)
    label = (
        plan.label() + (" ckpt" if ckpt else "") + (" fsdp2" if fsdp else "") + ("" if defer else " no-defer")
    )
    return Row(
        label=label,
        plan=plan,
        checkpointing="full" if ckpt else "none",
        fsdp=fsdp,
        defer_sync=defer,
        units_per_s=units_per_s,
        unit="tokens",
        memory_bytes=memory_gib * GIB,
        memory_kind="CUDA max reserved",
        persistent_bytes=persistent_gib * GIB,
    )


# global batch 16: micro-batch 8 needs 9 GiB plainly, 5 GiB checkpointed; micro-batch 2 fits plainly
ROWS = [
    row(8, 2, 1500.0, 9.0),
    row(8, 2, 1300.0, 5.0, ckpt=True),
    row(4, 4, 1100.0, 6.5),
    row(2, 8, 1000.0, 3.5),
    row(2, 8, 700.0, 2.5, ckpt=True),
]


def test_the_fastest_row_within_the_budget_is_chosen_and_compared_with_the_best_plain_one() -> None:
    advice = advise(ROWS, 6 * GIB, global_batch=16)
    assert advice.outcome == "fits"
    assert advice.chosen is ROWS[1] and advice.compared is ROWS[3]
    assert advice.fitting == ("8x2 ckpt", "2x8", "2x8 ckpt")
    # the sentence of the issue, with the figures: 1300 / 1000 = 1.30
    assert advice.sentence.startswith(
        "micro-batch 8 with checkpointing (8x2): 1.30x the tokens/s of micro-batch 2 without checkpointing "
        "(2x8), both within 6.0 GiB (5.0 GiB and 3.5 GiB, CUDA max reserved)"
    )
    # and what the budget costs: the fastest row overall (1500 / 1300 = 1.15x) does not fit
    assert "the fastest measured, micro-batch 8 without checkpointing (8x2), has 1.15x its tokens/s" in (
        advice.sentence
    )
    assert "needs 9.0 GiB" in advice.sentence
    assert advice.to_dict()["chosen"]["label"] == "8x2 ckpt"


def test_a_plain_winner_is_compared_with_the_checkpointed_alternative() -> None:
    advice = advise(ROWS, 7 * GIB, global_batch=16)  # 4x4 (6.5 GiB) fits too, but is slower
    assert advice.chosen is ROWS[1] and advice.fitting[:2] == ("8x2 ckpt", "4x4")
    roomy = advise(ROWS, 10 * GIB, global_batch=16)
    assert roomy.chosen is ROWS[0] and roomy.compared is ROWS[1]
    assert roomy.sentence.startswith(
        "micro-batch 8 without checkpointing (8x2): 1.15x the tokens/s of "
        "micro-batch 8 with checkpointing (8x2)"
    )
    assert "the fastest measured" not in roomy.sentence  # the chosen row is the fastest


def test_a_single_fitting_row_says_it_is_the_only_one() -> None:
    advice = advise(ROWS, 3 * GIB, global_batch=16)
    assert advice.chosen is ROWS[4] and advice.compared is None
    assert advice.sentence.startswith(
        "micro-batch 2 with checkpointing (2x8) is the only measured configuration within 3.0 GiB (2.5 GiB"
    )


def test_rows_of_another_global_batch_are_not_compared() -> None:
    other = row(16, 2, 9000.0, 1.0)  # global batch 32: faster, smaller, and beside the point
    advice = advise([*ROWS, other], 6 * GIB, global_batch=16)
    assert advice.chosen is ROWS[1]


def test_the_persistent_wall_says_neither_accumulation_nor_checkpointing_can_help() -> None:
    heavy = [row(2, 8, 1000.0, 9.0, persistent_gib=8.0), row(2, 8, 700.0, 8.5, ckpt=True, persistent_gib=8.0)]
    advice = advise(heavy, 6 * GIB, global_batch=16)
    assert advice.outcome == "persistent" and advice.chosen is None
    text = advice.sentence
    assert text.startswith("the persistent state alone (8.0 GiB: parameters, gradients and optimizer state)")
    assert "exceeds the budget of 6.0 GiB" in text
    assert (
        "neither a smaller micro-batch nor more accumulation can fix that, nor can activation checkpointing"
        in (text)
    )
    assert "shard the state (FSDP2, ZeRO) or use a lighter optimizer" in text
    # the plain rows' memory model says the same, in the same words (one sentence, written once)
    model = fit_memory_model([2, 4], [1.0 * GIB, 2.0 * GIB], 8 * GIB)
    assert model.advice(6 * GIB, global_batch=16, dp=1) == text


def test_a_sharded_persistent_wall_asks_for_more_ranks() -> None:
    rows = [
        row(2, 4, 900.0, 9.0, dp=2, persistent_gib=8.0),
        row(2, 4, 800.0, 7.0, dp=2, fsdp=True, persistent_gib=6.5),
    ]
    advice = advise(rows, 6 * GIB, global_batch=16)
    assert advice.outcome == "persistent"
    assert "(6.5 GiB per rank, already sharded over 2 ranks with FSDP2:" in advice.sentence
    assert "shard it over more ranks or use a lighter optimizer" in advice.sentence


def test_when_only_the_activations_are_in_the_way_the_untried_remedies_are_named() -> None:
    plain = [row(8, 2, 1500.0, 9.0), row(4, 4, 1100.0, 6.5, dp=1)]
    advice = advise(plain, 6 * GIB, global_batch=16)
    assert advice.outcome == "activations"
    assert advice.sentence.startswith(
        "no measured configuration fits 6.0 GiB: the smallest, micro-batch 4 (4x4)"
    )
    assert "activation checkpointing (--checkpointing full)" in advice.sentence
    assert "a smaller micro-batch with more accumulation" in advice.sentence
    dp_rows = [row(1, 8, 1000.0, 7.0, dp=2, ckpt=True)]
    assert "sharding the state (--sharding fsdp2)" in advise(dp_rows, 6 * GIB, global_batch=16).sentence


def test_nothing_measured_and_a_bad_budget() -> None:
    assert advise([], 6 * GIB, global_batch=16).outcome == "nothing measured"
    with pytest.raises(BenchError, match="positive"):
        advise(ROWS, 0, global_batch=16)


def test_the_sweep_multiplies_plans_by_sharding_and_checkpointing() -> None:
    settings = MeasureSettings(runs=1, steps=2)
    plans = (BatchPlan(micro_batch=4, accum_steps=1, dp=2), BatchPlan(micro_batch=2, accum_steps=2, dp=2))
    sweep = SweepSpec(
        workload="m:f",
        global_batch=8,
        dp=2,
        plans=plans,
        settings=settings,
        checkpointing=("none", "full"),
        sharding=("ddp", "fsdp2"),
    )
    labels = [s.row_label for s in sweep.measure_specs()]
    assert labels == [
        "4x2x1", "4x2x1 ckpt", "4x2x1 fsdp2", "4x2x1 fsdp2 no-defer", "4x2x1 ckpt fsdp2",
        "4x2x1 ckpt fsdp2 no-defer",
        "2x2x2", "2x2x2 ckpt", "2x2x2 fsdp2", "2x2x2 fsdp2 no-defer", "2x2x2 ckpt fsdp2",
        "2x2x2 ckpt fsdp2 no-defer",
    ]  # fmt: skip
    assert SweepSpec(workload="m:f", global_batch=8).measure_specs()[0].row_label == "8x1"
    with pytest.raises(BenchError, match="needs data parallelism"):
        SweepSpec(workload="m:f", global_batch=8, sharding=("fsdp2",))
    with pytest.raises(BenchError, match="checkpointing must list each of"):
        SweepSpec(workload="m:f", global_batch=8, checkpointing=("full", "full"))
    with pytest.raises(BenchError, match="checkpointing must list each of"):
        SweepSpec(workload="m:f", global_batch=8, checkpointing=("selective",))
