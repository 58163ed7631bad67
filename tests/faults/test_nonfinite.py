"""Items 6 and 7: a non-finite loss or gradient on one rank, and a GradScaler overflow on one rank.

Every rank must skip together (the loss is all-reduced and the norm is taken on synchronized
gradients, so a NaN anywhere is seen everywhere), leave parameters, optimizer state, scheduler and
counters as they were, clear the window's gradients, and, with a GradScaler, back the scale off
exactly once on every rank so that the ranks' scales never drift apart.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator, split
from gradaccum.batch import take
from tests.faults.common import AGREED_WITHIN_S, Outcome, ddp_mlp, params, same, scenario_outcomes
from tests.helpers import models

pytestmark = pytest.mark.distributed

BOUNDS = [0, 6, 10]
INIT_SCALE = 2.0**10


def _window(rank: int, seed: int) -> list[Any]:
    local = take(models.mlp_batch(10, seed=seed), BOUNDS[rank], BOUNDS[rank + 1])
    return split(local, sizes={0: [2, 2, 2], 1: [2, 2]}[rank])


def _poisoned(rank: int, bad_rank: int, bad_mb: int, how: str) -> Any:
    """loss_fn that makes micro-batch ``bad_mb`` of ``bad_rank`` non-finite: loss and gradient
    (``nan``/``inf`` times the loss), the loss alone (``+inf`` added, gradient finite), or one
    gradient alone (a hook multiplies it by inf, the loss stays finite)."""
    seen = {"n": 0}

    def loss_fn(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        seen["n"] += 1
        loss = models.mlp_loss(model, mb)
        if rank == bad_rank and seen["n"] == bad_mb + 1:
            if how == "loss only":
                return loss + torch.tensor(float("inf"), dtype=loss.dtype)
            if how == "gradient only":
                weight = model.module[2].weight
                handle = weight.register_hook(lambda g: (handle.remove(), g * float("inf"))[1])
                return loss
            return loss * float(how)
        return loss

    return loss_fn


def _state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict()["state"])


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(
        all(torch.equal(torch.as_tensor(a[k][f]), torch.as_tensor(b[k][f])) for f in a[k])
        and a[k].keys() == b[k].keys()
        for k in a
    )


def _skip_one_rank(rank: int, how: str, bad_rank: int = 1, bad_mb: int = 1) -> dict[str, Any]:
    """A good step, a step poisoned on one rank, then a good step; and the same without the bad one."""
    ddp = ddp_mlp()
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    acc = Accumulator(ddp, opt, sched, max_grad_norm=1.0)
    acc.step(_window(rank, 1), models.mlp_loss, models.count_rows)
    before = (params(ddp), _state(opt), sched.last_epoch, sched.get_last_lr())
    bad = acc.step(_window(rank, 2), _poisoned(rank, bad_rank, bad_mb, how), models.count_rows)
    after = (params(ddp), _state(opt), sched.last_epoch, sched.get_last_lr())
    cleared = all(p.grad is None for p in ddp.parameters())
    counters = (acc.steps_applied, acc.steps_skipped, acc.consecutive_skips)
    acc.step(_window(rank, 3), models.mlp_loss, models.count_rows)
    # the uninterrupted run: the same two good windows, without the skipped one
    ref = ddp_mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    ref_acc = Accumulator(ref, ref_opt, torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5), max_grad_norm=1.0)
    for seed in (1, 3):
        ref_acc.step(_window(rank, seed), models.mlp_loss, models.count_rows)
    return {
        "result": bad,
        "params kept": same(before[0], after[0]),
        "optimizer state kept": _same_state(before[1], after[1]),
        "scheduler kept": before[2:] == after[2:],
        "cleared": cleared,
        "counters": counters,
        "final": params(ddp),
        "uninterrupted": params(ref),
    }


def _too_many_skips(rank: int) -> dict[str, Any]:
    ddp = ddp_mlp()
    acc = Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), max_consecutive_skips=2)
    seen = []
    for seed in (1, 2, 3):
        try:
            seen.append(
                acc.step(_window(rank, seed), _poisoned(rank, 0, 0, "nan"), models.count_rows).skipped
            )
        except Exception as exc:
            seen.append((type(exc).__name__, str(exc)))
    return {"seen": seen}


def _scaler(rank: int, how: str) -> dict[str, Any]:
    """float32 with a GradScaler: one rank overflows in one micro-batch, then a clean step."""
    ddp = DDP(models.mlp(dtype=torch.float32))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    acc = Accumulator(ddp, opt, scaler=scaler)
    before = params(ddp)
    window = [
        {k: v.float() if v.is_floating_point() else v for k, v in mb.items()} for mb in _window(rank, 4)
    ]
    bad = acc.step(window, _poisoned(rank, 1, 1, how), models.count_rows)
    scale_after_skip = scaler.get_scale()
    kept = same(before, params(ddp))
    good = acc.step(window, models.mlp_loss, models.count_rows)
    return {
        "result": bad,
        "kept": kept,
        "scale after skip": scale_after_skip,
        "scale after good step": scaler.get_scale(),
        "good applied": good.applied,
        "final": params(ddp),
    }


SCENARIOS = {
    "nan loss on one rank": lambda r, w: _skip_one_rank(r, "nan"),
    "inf gradient, finite loss, on one rank": lambda r, w: _skip_one_rank(
        r, "gradient only", bad_rank=0, bad_mb=0
    ),
    "too many skips": lambda r, w: _too_many_skips(r),
    "scaler: gradient overflow on one rank": lambda r, w: _scaler(r, "inf"),
    "scaler: loss overflow with finite gradients on one rank": lambda r, w: _scaler(r, "loss only"),
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Outcome]]:
    return scenario_outcomes(__name__)


def _values(outcomes: list[dict[str, Outcome]], name: str) -> list[dict[str, Any]]:
    pair = [outcomes[r][name] for r in (0, 1)]
    for o in pair:
        assert o.ok, o.message
        assert o.seconds < AGREED_WITHIN_S
    return [o.value for o in pair]


@pytest.mark.parametrize("name", ["nan loss on one rank", "inf gradient, finite loss, on one rank"])
def test_item6_non_finite_on_one_rank_skips_on_every_rank_and_changes_nothing(
    outcomes: list[dict[str, Outcome]], name: str
) -> None:
    for got in _values(outcomes, name):
        result = got["result"]
        assert result.skipped and "non-finite loss or gradient" in (result.skip_reason or "")
        if name.startswith("inf gradient"):
            assert result.loss is not None and torch.isfinite(torch.tensor(result.loss)), result.skip_reason
        assert got["params kept"] and got["optimizer state kept"] and got["scheduler kept"]
        assert got["cleared"], "the skipped window's gradients must not leak into the next step"
        assert got["counters"] == (1, 1, 1)  # one applied before, one skipped, no update counted
    r0, r1 = _values(outcomes, name)
    # the run goes on as if the bad window had never been drawn: same operations, so bitwise equal
    assert same(r0["final"], r0["uninterrupted"]) and same(r1["final"], r1["uninterrupted"])
    assert same(r0["final"], r1["final"])


def test_item6_repeated_skips_stop_every_rank_with_a_clear_message(
    outcomes: list[dict[str, Outcome]],
) -> None:
    for got in _values(outcomes, "too many skips"):
        assert got["seen"][:2] == [True, True]
        kind, message = got["seen"][2]
        assert kind == "TooManySkipsError"
        assert "3 consecutive updates were skipped (limit max_consecutive_skips=2)" in message
        assert "non-finite" in message


@pytest.mark.parametrize(
    "name",
    ["scaler: gradient overflow on one rank", "scaler: loss overflow with finite gradients on one rank"],
)
def test_item7_scaler_overflow_on_one_rank_skips_everywhere_and_backs_off_once(
    outcomes: list[dict[str, Outcome]], name: str
) -> None:
    r0, r1 = _values(outcomes, name)
    for got in (r0, r1):
        assert got["result"].skipped and got["kept"]
        # GradScaler's default backoff_factor is 0.5: backed off once, on every rank
        assert got["scale after skip"] == INIT_SCALE * 0.5
        assert got["good applied"] and got["scale after good step"] == INIT_SCALE * 0.5
    assert same(r0["final"], r1["final"])
