"""Item 11: an out-of-memory error mid-window, retried at a smaller micro-batch on every rank.

The OOM is the real exception type (``torch.cuda.OutOfMemoryError`` is constructible on CPU builds
and is ``torch.OutOfMemoryError``), raised from a forward or gradient hook as an allocator would.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator, split
from gradaccum.batch import take
from gradaccum.errors import PlanError, RankFailedError, WindowOutOfMemoryError
from gradaccum.step.adaptive import AdaptiveMicroBatch, step_adaptive
from tests.faults.common import (
    F64_RTOL,
    Outcome,
    Trip,
    ddp_mlp,
    ok_values,
    params,
    rel_err,
    same,
    scenario_outcomes,
)
from tests.helpers import models
from tests.helpers.reference import full_batch_grads


def _oom() -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def _rows_over(limit: int) -> Any:
    """A Trip condition: the micro-batch holds more than ``limit`` examples (it does not fit)."""
    return lambda inputs: inputs[0].shape[0] > limit


def _adamw(model: nn.Module) -> Accumulator:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return Accumulator(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5))


# -- one process -------------------------------------------------------------------------------


def test_oom_mid_window_retries_smaller_and_equals_an_uninterrupted_run() -> None:
    batch = models.mlp_batch(12, seed=3)
    model = models.mlp()
    acc = _adamw(model)
    # the second forward of the first attempt runs out of memory: one micro-batch is already
    # accumulated and must be discarded; micro-batches of 2 fit
    trip = Trip(_oom, calls={2}, when=_rows_over(2))
    model[0].register_forward_hook(trip)
    result, used = step_adaptive(acc, batch, 4, models.mlp_loss, models.count_rows)
    assert used == 2 and result.applied and result.micro_batches == 6
    assert (acc.steps_applied, acc.steps_skipped) == (1, 0)

    plain = models.mlp()
    plain_acc = _adamw(plain)
    plain_acc.step(split(batch, micro_batch=2), models.mlp_loss, models.count_rows)
    # the same micro-batches in the same order from cleared gradients: identical arithmetic
    assert same(params(model), params(plain))
    assert plain_acc.optimizer.state_dict()["state"].keys() == acc.optimizer.state_dict()["state"].keys()
    assert acc.scheduler.last_epoch == plain_acc.scheduler.last_epoch == 1


def test_oom_in_the_last_backward_is_retried_on_one_process() -> None:
    batch = models.mlp_batch(8, seed=4)
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    backwards = {"n": 0}

    def maybe_oom(grad: torch.Tensor) -> torch.Tensor:
        backwards["n"] += 1
        if backwards["n"] == 2:  # the second (last) backward of the first attempt, k = 2
            raise _oom()
        return grad

    model[2].weight.register_hook(maybe_oom)
    result, used = step_adaptive(acc, batch, 4, models.mlp_loss, models.count_rows)
    assert used == 2 and result.applied
    want = full_batch_grads(models.mlp(), batch, models.mlp_loss, models.count_rows)
    assert rel_err({n: p.grad for n, p in model.named_parameters()}, want) < F64_RTOL


def _backward_oom_on(model: nn.Module, call: int) -> None:
    """Raise an OOM from the ``call``-th backward through the model's last layer."""
    backwards = {"n": 0}

    def maybe_oom(grad: torch.Tensor) -> torch.Tensor:
        backwards["n"] += 1
        if backwards["n"] == call:
            raise _oom()
        return grad

    model[2].weight.register_hook(maybe_oom)


def _forward_oom_on(model: nn.Module, call: int) -> None:
    """Raise an OOM from the ``call``-th forward of a micro-batch of more than 2 examples."""
    model[0].register_forward_hook(Trip(_oom, calls={call}, when=_rows_over(2)))


@pytest.mark.parametrize(
    ("fault", "call"),
    [(_forward_oom_on, 2), (_backward_oom_on, 3)],  # mid-window forward; the last backward (k = 3)
    ids=["forward mid-window", "last backward"],
)
def test_step_adaptive_composes_with_post_scaling(fault: Any, call: int) -> None:
    """Post-scaling streams the window and scales the gradients after it; a retry after an OOM must
    leave nothing of the failed attempt (its gradients, its count, the constant c the next window
    takes from this one's N), so pre and post give the same two updates and post the same bits as
    an uninterrupted post run at the micro-batch that fit."""
    batches = [models.mlp_batch(12, seed=3), models.mlp_batch(12, seed=9)]
    runs: dict[str, nn.Module] = {}
    for scaling in ("pre", "post"):
        model = runs[scaling] = models.mlp()
        fault(model, call)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), scaling=scaling)
        adaptive = AdaptiveMicroBatch(acc, 4)
        for batch in batches:
            result = adaptive.step(batch, models.mlp_loss, models.count_rows)
            assert result.applied and result.micro_batches == 6
            assert result.global_count == int(batch["w"].sum())
        assert adaptive.micro_batch == 2 and adaptive.reductions == [(1, 4, 2)]
        assert (acc.steps_applied, acc.steps_skipped) == (2, 0)
    # float64: pre and post differ by post's one extra rounding (the W/(N c) multiply) per update
    assert rel_err(params(runs["post"]), params(runs["pre"])) < F64_RTOL
    assert (
        rel_err(
            {n: p.grad for n, p in runs["post"].named_parameters()},
            {n: p.grad for n, p in runs["pre"].named_parameters()},
        )
        < F64_RTOL
    )
    plain = models.mlp()
    plain_acc = Accumulator(plain, torch.optim.SGD(plain.parameters(), lr=0.1), scaling="post")
    for batch in batches:
        plain_acc.step(split(batch, micro_batch=2), models.mlp_loss, models.count_rows)
    assert same(params(runs["post"]), params(plain))


def test_retry_restores_the_random_generator_so_dropout_matches_an_uninterrupted_run() -> None:
    def dropout_mlp() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 3)).double()

    batch = models.mlp_batch(8, seed=5)
    model = dropout_mlp()
    model[0].register_forward_hook(Trip(_oom, calls={2}, when=_rows_over(2)))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(123)
    _, used = step_adaptive(acc, batch, 4, models.mlp_loss, models.count_rows)
    assert used == 2
    plain = dropout_mlp()
    torch.manual_seed(123)
    Accumulator(plain, torch.optim.SGD(plain.parameters(), lr=0.1)).step(
        split(batch, micro_batch=2), models.mlp_loss, models.count_rows
    )
    assert same(params(model), params(plain))


def test_oom_even_at_the_smallest_micro_batch_raises_and_changes_nothing() -> None:
    model = models.mlp()
    model[0].register_forward_hook(Trip(_oom))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = params(model)
    with pytest.raises(
        WindowOutOfMemoryError, match=r"micro_batch=1 \(min_micro_batch=1\) on this rank"
    ) as err:
        step_adaptive(acc, models.mlp_batch(8, seed=6), 4, models.mlp_loss, models.count_rows)
    assert isinstance(err.value, torch.OutOfMemoryError)  # callers' existing OOM handlers still apply
    assert err.value.failures[0].oom and err.value.failures[0].phase == "forward"
    assert same(before, params(model)) and all(p.grad is None for p in model.parameters())
    assert (acc.steps_applied, acc.steps_skipped) == (0, 0)


def test_adaptive_micro_batch_remembers_what_fit() -> None:
    model = models.mlp()
    model[0].register_forward_hook(Trip(_oom, when=_rows_over(3)))
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    adaptive = AdaptiveMicroBatch(acc, 8)
    for seed in (1, 2):
        assert adaptive.step(models.mlp_batch(10, seed=seed), models.mlp_loss, models.count_rows).applied
    # 8 -> 4 -> 2 on the first step (10 = 2+2+2+2+2); the second step starts at 2
    assert adaptive.micro_batch == 2 and adaptive.reductions == [(1, 8, 2)]


def test_a_micro_batch_that_does_not_divide_the_batch_leaves_a_shorter_last_one() -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result, used = step_adaptive(acc, models.mlp_batch(7, seed=2), 3, models.mlp_loss, models.count_rows)
    assert used == 3 and result.micro_batches == 3  # 3 + 3 + 1


@pytest.mark.parametrize(
    ("micro", "floor", "match"),
    [(0, 1, "micro_batch must be a positive integer"), (4, 0, "min_micro_batch"), (2, 4, "larger than")],
)
def test_bad_retry_settings_are_refused(micro: int, floor: int, match: str) -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(PlanError, match=match):
        step_adaptive(
            acc, models.mlp_batch(4), micro, models.mlp_loss, models.count_rows, min_micro_batch=floor
        )


# -- two ranks ---------------------------------------------------------------------------------

BOUNDS = [0, 12, 20]  # rank 0: 12 examples (3 micro-batches of 4), rank 1: 8 (2 of 4)


def _global() -> dict[str, torch.Tensor]:
    return models.mlp_batch(20, seed=8)


def _local(rank: int) -> dict[str, torch.Tensor]:
    return take(_global(), BOUNDS[rank], BOUNDS[rank + 1])


def _adaptive_ddp(
    rank: int, oom_rank: int, trip: Trip | None, floors: tuple[int, int] = (1, 1)
) -> dict[str, Any]:
    ddp = ddp_mlp()
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    if rank == oom_rank and trip is not None:
        ddp.module[0].register_forward_hook(trip)
    try:
        result, used = step_adaptive(
            acc, _local(rank), 4, models.mlp_loss, models.count_rows, min_micro_batch=floors[rank]
        )
        out: dict[str, Any] = {"used": used, "applied": result.applied, "error": None}
    except Exception as exc:
        out = {"error": (type(exc).__name__, str(exc), isinstance(exc, torch.OutOfMemoryError))}
    out["params"] = params(ddp)
    # the uninterrupted run at micro-batch 2, in the same processes
    plain = ddp_mlp()
    Accumulator(plain, torch.optim.SGD(plain.parameters(), lr=0.1)).step(
        split(_local(rank), micro_batch=2), models.mlp_loss, models.count_rows
    )
    out["uninterrupted"] = params(plain)
    return out


def _oom_and_error(rank: int) -> dict[str, Any]:
    """Rank 0 runs out of memory while rank 1 fails for another reason: nobody retries."""
    ddp = ddp_mlp()
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    error = _oom if rank == 0 else (lambda: ValueError("bad example"))
    ddp.module[0].register_forward_hook(Trip(error, calls={2}))
    try:
        step_adaptive(acc, _local(rank), 4, models.mlp_loss, models.count_rows)
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "oom": isinstance(exc, torch.OutOfMemoryError),
        }
    return {"error": None}


SCENARIOS = {
    # rank 1 runs out of memory in its second micro-batch (mid-window) at 4, fits at 2
    "mid-window on rank 1": lambda r, w: _adaptive_ddp(r, 1, Trip(_oom, calls={2}, when=_rows_over(2))),
    # rank 0 runs out of memory in its last, synchronizing micro-batch's forward
    "last forward on rank 0": lambda r, w: _adaptive_ddp(r, 0, Trip(_oom, calls={3}, when=_rows_over(2))),
    "never fits on rank 1": lambda r, w: _adaptive_ddp(r, 1, Trip(_oom)),
    # rank 0 may not shrink below 4: both ranks give up together instead of one retrying alone
    "rank 0 at its floor": lambda r, w: _adaptive_ddp(r, 1, Trip(_oom, when=_rows_over(2)), floors=(4, 1)),
    "OOM on one rank, another error on the other": lambda r, w: _oom_and_error(r),
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Outcome]]:
    return scenario_outcomes(__name__)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["mid-window on rank 1", "last forward on rank 0"])
def test_item11_oom_on_one_rank_is_retried_on_every_rank_at_the_same_global_batch(
    outcomes: list[dict[str, Outcome]], name: str
) -> None:
    r0, r1 = ok_values(outcomes, name)
    for got in (r0, r1):
        assert got["error"] is None and got["applied"]
        assert got["used"] == 2, "every rank halves together, whichever ran out of memory"
        # The retried window starts with a synchronizing micro-batch (DDP had prepared a reduction
        # on the ranks that finished their last forward), so the sum is rounded differently from the
        # uninterrupted run: float64 tolerance, not bitwise.
        assert rel_err(got["params"], got["uninterrupted"]) < F64_RTOL
    assert same(r0["params"], r1["params"])
    want = full_batch_grads(models.mlp(), _global(), models.mlp_loss, models.count_rows)
    start = params(models.mlp())
    step = {n: (start[n] - r0["params"][n]) / 0.1 for n in start}  # SGD: the applied gradient
    assert rel_err(step, want) < 1e-9  # dividing a difference of O(1) weights by lr loses ~7 digits


@pytest.mark.distributed
def test_item11_oom_at_the_floor_raises_on_every_rank(outcomes: list[dict[str, Outcome]]) -> None:
    for got in ok_values(outcomes, "never fits on rank 1"):
        kind, message, is_oom = got["error"]
        assert kind == "WindowOutOfMemoryError" and is_oom
        assert "rank 1 failed in forward of micro-batch 0" in message and "min_micro_batch=1" in message
        assert same(got["params"], params(models.mlp()))


@pytest.mark.distributed
def test_item11_ranks_give_up_together_when_one_cannot_shrink(outcomes: list[dict[str, Outcome]]) -> None:
    for got in ok_values(outcomes, "rank 0 at its floor"):
        kind, message, is_oom = got["error"]
        assert kind == "WindowOutOfMemoryError" and is_oom and "or the smallest allowed on another" in message
        assert same(got["params"], params(models.mlp()))


@pytest.mark.distributed
def test_item11_an_oom_mixed_with_another_failure_is_not_retried(outcomes: list[dict[str, Outcome]]) -> None:
    r0, r1 = ok_values(outcomes, "OOM on one rank, another error on the other")
    assert r1["error"] == "ValueError"  # its own error surfaces on the rank that raised it
    assert r0["error"] == "RankFailedError" and not r0["oom"]
    assert "rank 1 failed in forward of micro-batch 1: ValueError: bad example" in r0["message"]
    assert "rank 0 failed in forward of micro-batch 1: OutOfMemoryError" in r0["message"]
    assert RankFailedError.__name__ == r0["error"]
