"""Item 12, library side: hostile input gets an error that names the problem and writes nothing.

On one process the error is raised where the input arrives. On two ranks, where bad input usually
shows up on one rank only, that rank raises it and the other stops with a RankFailedError that
names the rank, instead of waiting in the next collective.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum import Accumulator, BatchPlan, count_tokens, split, windows
from gradaccum.batch import split_sizes, take
from gradaccum.errors import CountTypeError, PlanError, RunCardError
from gradaccum.plan import factorizations
from gradaccum.runcard import RunCard, read_runcard, write_runcard
from tests.faults.common import AGREED_WITHIN_S, F64_RTOL, Outcome, ddp_mlp, grads, rel_err, scenario_outcomes
from tests.helpers import models
from tests.helpers.reference import full_batch_grads

# -- labels of the wrong dtype -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_labels_of_the_wrong_dtype_are_refused_by_count_tokens(dtype: torch.dtype) -> None:
    labels = torch.ones(2, 5, dtype=dtype)
    # CountTypeError is both a CountError (exit 2 on the CLI) and a TypeError
    with pytest.raises(CountTypeError, match=f"labels must be an integer tensor .* got dtype {dtype}"):
        count_tokens(shift=False)({"labels": labels})
    assert issubclass(CountTypeError, TypeError)


def test_labels_of_the_wrong_dtype_stop_the_step_before_any_gradient() -> None:
    model = models.gpt()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = models.gpt_batch(4, seed=1)
    batch["labels"] = batch["labels"].float()
    with pytest.raises(TypeError, match="integer tensor"):
        acc.step(split(batch, micro_batch=2), models.gpt_loss, models.tokens)
    assert all(p.grad is None for p in model.parameters()) and acc.steps_applied == 0


# -- plans with zero or negative sizes -----------------------------------------------------------

PLANS = [
    (lambda: BatchPlan(micro_batch=0, accum_steps=4), "micro_batch must be a positive integer, got 0"),
    (lambda: BatchPlan(micro_batch=-2, accum_steps=4), "micro_batch must be a positive integer, got -2"),
    (lambda: BatchPlan(micro_batch=4, accum_steps=0), "accum_steps must be a positive integer, got 0"),
    (lambda: BatchPlan(micro_batch=4, accum_steps=2, dp=-1), "dp must be a positive integer, got -1"),
    (
        lambda: BatchPlan(micro_batch=2.0, accum_steps=2),
        r"micro_batch must be a positive integer, got 2.0 \(float\)",
    ),
    (lambda: BatchPlan(micro_batch=True, accum_steps=2), r"got True \(bool\)"),
    (
        lambda: BatchPlan.solve(global_batch=0, micro_batch=4),
        "global_batch must be a positive integer, got 0",
    ),
    (lambda: BatchPlan.solve(global_batch=-8, micro_batch=4), "global_batch must be a positive integer"),
    (
        lambda: BatchPlan.from_world(world_size=0, micro_batch=1, accum_steps=1),
        "world_size must be a positive",
    ),
    (
        lambda: BatchPlan(micro_batch=4, accum_steps=2).tokens_per_step(0),
        "seq_len must be a positive integer",
    ),
    (
        lambda: BatchPlan(micro_batch=4, accum_steps=2).optimizer_updates(-1),
        "dataset_size must be a non-negative",
    ),
    (lambda: factorizations(0), "global_batch must be a positive integer, got 0"),
    (lambda: factorizations(8, dp=0), "dp must be a positive integer, got 0"),
    (lambda: list(windows(range(4), 0)), "accum_steps must be a positive integer, got 0"),
    (lambda: list(windows(range(4), -1)), "accum_steps must be a positive integer, got -1"),
    (lambda: split_sizes(8, micro_batch=0), "micro_batch must be a positive integer, got 0"),
    (lambda: split_sizes(8, micro_batch=-4), "micro_batch must be a positive integer, got -4"),
    (lambda: split_sizes(8, sizes=[0, 8]), r"partition sizes must be positive integers, got \[0, 8\]"),
    (lambda: split_sizes(8, sizes=[-1, 9]), r"partition sizes must be positive integers, got \[-1, 9\]"),
    (lambda: split_sizes(8, sizes=[]), r"partition sizes must be positive integers, got \[\]"),
    (lambda: split(models.mlp_batch(4), micro_batch=3), "micro_batch=3 does not divide the batch of 4"),
]


@pytest.mark.parametrize(("make", "match"), PLANS, ids=[m for _, m in PLANS])
def test_plans_with_zero_or_negative_sizes_are_refused_by_name(make: Any, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        make()


# -- run cards truncated or edited by hand -------------------------------------------------------


@pytest.fixture
def card_path(tmp_path: Path) -> Path:
    path = tmp_path / "runcard.json"
    write_runcard(
        RunCard(workload="gradaccum.examples:tiny_gpt", plan=BatchPlan(micro_batch=2, accum_steps=4)), path
    )
    return path


def _edit(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del data[key]
        else:
            data[key] = value
    path.write_text(json.dumps(data))


_DELETE = object()

EDITS = [
    ({"global_batch": 16}, "says global_batch=16 but micro_batch x dp x accum_steps = 2 x 1 x 4 = 8"),
    ({"micro_batch": 0}, "run card plan is invalid: micro_batch must be a positive integer, got 0"),
    ({"accum_steps": -4, "global_batch": -8}, "accum_steps must be a positive integer, got -4"),
    ({"micro_batch": "2"}, r"micro_batch must be a positive integer, got '2' \(str\)"),
    ({"dp": True}, r"dp must be a positive integer, got True \(bool\)"),
    ({"accum_steps": _DELETE}, "run card is missing accum_steps"),
    ({"format_version": 99}, "format_version 99 is not supported"),
    ({"precision": "fp8"}, "precision must be one of"),
    (
        {"accum": {"defer_sync": True, "max_grad_norm": -1.0}},
        "max_grad_norm must be a positive finite number",
    ),
    ({"accum": {"bucket_size": 3}}, r"unknown settings \['bucket_size'\]"),
    ({"accum": "sum"}, "'accum' must be an object, got str"),
    ({"accum": {"skip_nonfinite": "false"}}, r"skip_nonfinite must be True or False, got 'false' \(str\)"),
    ({"accum": {"defer_sync": "no"}}, r"defer_sync must be True or False, got 'no' \(str\)"),
    ({"accum": {"max_consecutive_skips": 2.5}}, "max_consecutive_skips must be a positive integer"),
    ({"seed": "0"}, "'seed' an integer"),
    ({"workload": 5}, "'workload' must be a string"),
    ({"tokens_per_step": -5}, "tokens_per_step must be a non-negative integer or None, got -5"),
    # free-form fields of the wrong type
    ({"versions": "2.13"}, "'versions' must be an object of version strings"),
    ({"versions": {"torch": 2.13}}, "'versions' must be an object of version strings"),
    ({"extra": [1, 2, 3]}, "'extra' must be an object, got list"),
    ({"git_commit": 5}, "'git_commit' must be a string or null, got 5"),
]


@pytest.mark.parametrize(("changes", "match"), EDITS, ids=[m for _, m in EDITS])
def test_run_cards_edited_by_hand_are_refused_by_name(
    card_path: Path, changes: dict[str, Any], match: str
) -> None:
    _edit(card_path, **changes)
    with pytest.raises(RunCardError, match=match):
        read_runcard(card_path)


@pytest.mark.parametrize("keep", [0, 1, 40, -2])
def test_truncated_run_cards_are_refused(card_path: Path, keep: int) -> None:
    text = card_path.read_text()
    card_path.write_text(text[:keep])
    with pytest.raises(RunCardError, match="not valid JSON \\(truncated\\?\\)"):
        read_runcard(card_path)


def test_run_card_that_is_not_an_object_or_missing_is_refused(card_path: Path, tmp_path: Path) -> None:
    card_path.write_text("[1, 2]")
    with pytest.raises(RunCardError, match="a run card is a JSON object, got list"):
        read_runcard(card_path)
    with pytest.raises(RunCardError, match="cannot read run card"):
        read_runcard(tmp_path / "nowhere.json")


def test_a_failed_write_leaves_the_previous_card_whole(card_path: Path) -> None:
    before = card_path.read_text()

    class Unserializable(RunCard):
        def to_dict(self) -> dict[str, Any]:
            return {"workload": object()}  # json.dumps fails before anything is written

    with pytest.raises(TypeError):
        write_runcard(Unserializable(workload="w", plan=BatchPlan(micro_batch=1, accum_steps=1)), card_path)
    assert card_path.read_text() == before
    assert [p.name for p in card_path.parent.iterdir()] == [card_path.name]  # no temporary left


# -- bad input on one of two ranks ---------------------------------------------------------------

BOUNDS = [0, 6, 10]


def _local(rank: int) -> dict[str, torch.Tensor]:
    return take(models.mlp_batch(10, seed=9), BOUNDS[rank], BOUNDS[rank + 1])


def _one_rank_bad(rank: int, bad_rank: int, count: Any = None, loss: Any = None) -> dict[str, Any]:
    """One step where rank ``bad_rank`` uses the hostile ``count``/``loss``, then a clean step."""
    ddp = ddp_mlp()
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    window = split(_local(rank), micro_batch=2)
    count_fn = count if (count is not None and rank == bad_rank) else models.count_rows
    loss_fn = loss if (loss is not None and rank == bad_rank) else models.mlp_loss
    try:
        acc.step(window, loss_fn, count_fn)
        error = None
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    cleared = all(p.grad is None for p in ddp.parameters())
    acc.step(window, models.mlp_loss, models.count_rows)
    return {"error": error, "cleared": cleared, "grads": grads(ddp)}


SCENARIOS = {
    "count_fn returns a float": lambda r, w: _one_rank_bad(r, 1, count=lambda mb: 2.5),
    "count_fn returns a negative int": lambda r, w: _one_rank_bad(r, 0, count=lambda mb: -1),
    "count_fn returns NaN": lambda r, w: _one_rank_bad(r, 1, count=lambda mb: float("nan")),
    "count_fn returns a negative tensor": lambda r, w: _one_rank_bad(r, 1, count=lambda mb: torch.tensor(-3)),
    "loss_fn returns a vector": lambda r, w: _one_rank_bad(
        r, 0, loss=lambda m, mb: ((m(mb["x"]) - mb["y"]) ** 2).sum(dim=1)
    ),
    "loss_fn returns a detached scalar": lambda r, w: _one_rank_bad(
        r, 1, loss=lambda m, mb: models.mlp_loss(m, mb).detach()
    ),
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Outcome]]:
    return scenario_outcomes(__name__)


ONE_RANK = [
    ("count_fn returns a float", 1, "CountError", "count_fn returned 2.5 for micro-batch 0"),
    (
        "count_fn returns a negative int",
        0,
        "CountError",
        "count_fn returned -1 for micro-batch 0: a count cannot be negative",
    ),
    ("count_fn returns NaN", 1, "CountError", "count_fn returned nan for micro-batch 0"),
    ("loss_fn returns a vector", 0, "LossError", "loss_fn returned a tensor of shape (2,) for micro-batch 0"),
    (
        "loss_fn returns a detached scalar",
        1,
        "LossError",
        "loss_fn returned a scalar that does not require grad",
    ),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "bad_rank", "kind", "text"), ONE_RANK, ids=[c[0] for c in ONE_RANK])
def test_hostile_input_on_one_rank_stops_every_rank_naming_it(
    outcomes: list[dict[str, Outcome]], name: str, bad_rank: int, kind: str, text: str
) -> None:
    want = full_batch_grads(models.mlp(), models.mlp_batch(10, seed=9), models.mlp_loss, models.count_rows)
    for rank in (0, 1):
        o = outcomes[rank][name]
        assert o.ok and o.seconds < AGREED_WITHIN_S, o.message
        error_type, message = o.value["error"]
        if rank == bad_rank:
            assert error_type == kind and text in message, message
        else:
            assert error_type == "RankFailedError", message
            assert f"rank {bad_rank} failed in" in message and f"{kind}: {text}" in message
        assert o.value["cleared"]
        assert rel_err(o.value["grads"], want) < F64_RTOL  # the next step is unaffected


@pytest.mark.distributed
def test_negative_tensor_count_on_one_rank_is_refused_on_every_rank(
    outcomes: list[dict[str, Outcome]],
) -> None:
    # a tensor count's sign is only known after the counts all-reduce, so every rank refuses alike
    for rank in (0, 1):
        o = outcomes[rank]["count_fn returns a negative tensor"]
        assert o.ok, o.message
        assert o.value["error"] == ("CountError", "count_fn returned a negative count on 1 rank(s)")
        assert o.value["cleared"]
