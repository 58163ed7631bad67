"""Schedules with a declared clock: milestones, derived lengths, and steps vs tokens across batches."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gradaccum.loss import valid_tokens
from gradaccum.train import StepRecord, TrainEvent, train
from gradaccum.train.data import train_seed
from gradaccum.train.schedule import Schedule, ScheduleConfig, ScheduleError, apply_lr, resolve_schedule
from tests.train.common import config, gpt

# Schedule factors are a few float operations: 1e-12 relative covers their rounding.
REL = 1e-12


def test_warmup_cosine_milestones_on_the_steps_clock() -> None:
    s = Schedule(kind="cosine", clock="steps", warmup=4, horizon=24, min_lr_ratio=0.1)
    assert s.factor(1) == pytest.approx(0.25, rel=REL)  # the first update is never at lr 0
    assert s.factor(2) == pytest.approx(0.5, rel=REL)
    assert s.factor(4) == pytest.approx(1.0, rel=REL)  # warmup ends exactly at update 4
    assert s.factor(14) == pytest.approx(0.55, rel=REL)  # half-way down: 0.1 + 0.9 * 0.5
    assert s.factor(19) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75)), rel=REL)
    assert s.factor(24) == pytest.approx(0.1, rel=REL)
    assert s.factor(1000) == pytest.approx(0.1, rel=REL)  # the floor holds past the horizon


def test_constant_and_no_warmup() -> None:
    constant = Schedule(kind="constant", clock="tokens", warmup=1000, horizon=1000, min_lr_ratio=0.1)
    assert constant.factor(250) == pytest.approx(0.25, rel=REL)
    assert constant.factor(1000) == constant.factor(10**9) == 1.0
    cold = Schedule(kind="cosine", clock="steps", warmup=0, horizon=10, min_lr_ratio=0.0)
    assert cold.factor(0) == 1.0 and cold.factor(10) == pytest.approx(0.0, abs=1e-15)


def test_lengths_are_derived_from_the_run_in_the_clocks_unit() -> None:
    by_steps = resolve_schedule(ScheduleConfig(), steps=200, tokens=None, tokens_per_step=500)
    assert (by_steps.clock, by_steps.horizon, by_steps.warmup) == ("steps", 200, 20)
    tokens_for_steps = resolve_schedule(
        ScheduleConfig(clock="tokens"), steps=200, tokens=None, tokens_per_step=500
    )
    assert (tokens_for_steps.horizon, tokens_for_steps.warmup) == (100_000, 10_000)
    steps_for_tokens = resolve_schedule(ScheduleConfig(), steps=None, tokens=10_001, tokens_per_step=500)
    assert steps_for_tokens.horizon == 21  # ceil(10001 / 500)
    given = resolve_schedule(ScheduleConfig(warmup=7, horizon=70), steps=5, tokens=None, tokens_per_step=1)
    assert (given.warmup, given.horizon) == (7, 70)
    assert "not advance" in given.to_dict()["skipped_updates"]


def test_impossible_schedules_are_refused() -> None:
    with pytest.raises(ScheduleError, match="warmup=50 is longer than its horizon=40"):
        resolve_schedule(ScheduleConfig(warmup=50), steps=40, tokens=None, tokens_per_step=1)
    with pytest.raises(ScheduleError, match="clock must be 'steps' or 'tokens'"):
        ScheduleConfig(clock="epochs")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="min_lr_ratio must be in"):
        ScheduleConfig(min_lr_ratio=1.5)


def test_apply_lr_scales_every_groups_peak() -> None:
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}])
    apply_lr(opt, 0.5)
    apply_lr(opt, 0.5)  # from the peak each time, not compounding
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.005], rel=REL)


def _window_tokens(global_batch: int, window: int) -> int:
    return int(valid_tokens(gpt().make_batch(global_batch, train_seed(0, window))["labels"], shift=False))


def _lrs(tmp: Path, global_batch: int, clock: str, warmup: int) -> list[StepRecord]:
    events: list[TrainEvent] = []
    schedule = ScheduleConfig(kind="constant", clock=clock, warmup=warmup)  # type: ignore[arg-type]
    cfg = config(tmp, global_batch=global_batch, steps=6, lr=1.0, schedule=schedule, optimizer="sgd")
    train(cfg, on_event=events.append)
    return [e for e in events if isinstance(e, StepRecord)]


def test_token_clock_holds_milestones_at_the_same_data_across_global_batches(tmp_path: Path) -> None:
    # The recipe: warm up over 4 optimizer steps at global batch 8, i.e. over W valid tokens.
    warmup_tokens = sum(_window_tokens(8, w) for w in range(4))
    runs = {
        (batch, clock): _lrs(
            tmp_path / f"{clock}{batch}", batch, clock, 4 if clock == "steps" else warmup_tokens
        )
        for batch in (8, 16)
        for clock in ("steps", "tokens")
    }
    for (batch, clock), steps in runs.items():
        tokens_after = [sum(_window_tokens(batch, w) for w in range(i + 1)) for i in range(6)]
        assert [s.tokens for s in steps] == tokens_after  # counted independently from the data
        clock_after = [s.step for s in steps] if clock == "steps" else tokens_after
        want = [min(1.0, c / (4 if clock == "steps" else warmup_tokens)) for c in clock_after]
        assert [s.lr for s in steps] == pytest.approx(want, rel=REL), (batch, clock)

    def tokens_at_peak(steps: list[StepRecord]) -> int:
        return next(s.tokens for s in steps if s.lr == 1.0)

    # steps clock: the peak comes at update 4 whatever the batch, so doubling the batch doubles
    # the data seen in warmup (the seeds' warning: more samples before each milestone)
    assert [s.lr for s in runs[8, "steps"]] == [s.lr for s in runs[16, "steps"]]
    assert tokens_at_peak(runs[16, "steps"]) > 1.7 * tokens_at_peak(runs[8, "steps"])
    # tokens clock: the peak comes at the first update that completes W tokens at either batch,
    # which takes half as many updates at the doubled batch
    for batch, updates in ((8, 4), (16, 2)):
        steps = runs[batch, "tokens"]
        peak = next(i for i, s in enumerate(steps) if s.lr == 1.0)
        assert steps[peak].step == updates
        assert steps[peak - 1].tokens < warmup_tokens <= steps[peak].tokens
