"""``train`` with a batch-size schedule that follows the measured noise scale (issue 26).

The regression example's noise scale is known exactly at any weights
(:meth:`RegressionPopulation.truth`), so the schedule's decisions can be checked against the truth:
with the weights held still (a learning rate of 1e-300 leaves float64 weights bit for bit unchanged),
B_noise is a constant and the batch the schedule settles on must lie within a declared factor of it.
Resume comparisons are exact (float64, one thread, same operations in the same order; see
``test_resume.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum.cli.main import main
from gradaccum.errors import PlanError, TrainError
from gradaccum.examples.regression import RegressionPopulation, regression
from gradaccum.plan import BatchPlan
from gradaccum.step.config import AccumConfig
from gradaccum.train import TrainConfig, read_metrics, train
from gradaccum.train.batch_schedule import CriticalBatchConfig, CriticalBatchSchedule
from gradaccum.train.schedule import ScheduleConfig
from tests.train.common import final_params

SETTLE_FACTOR = 2.0
"""The settled batch lies in [B_noise / 2, 2 B_noise]. Measured over 16 runs (seeds 0-7, two
weights, micro-batch 4, min_updates 20, 160 windows): settled / B_noise 1.11-1.61; the floor is the
rounding up to whole micro-batches (12 / 10.83 = 1.11 at the initial weights), the rest the spread
of an estimate over 20 windows of 2-4 micro-batches of 4 rows (heavy-tailed: see "The gradient
noise scale" in docs/design/training.md)."""


def _at(fraction: float) -> torch.nn.Module:
    """The regression model a ``fraction`` of the way from zero weights to the least-squares fit."""
    population = RegressionPopulation.build()
    model, fitted = population.model(), population.model(fitted=True)
    with torch.no_grad():
        model.weight.copy_(fraction * fitted.weight)
        model.bias.copy_(fraction * fitted.bias)
    return model


def _config(run_dir: Path, **kw: Any) -> TrainConfig:
    settings: dict[str, Any] = {
        "plan": BatchPlan(micro_batch=4, accum_steps=2),
        "run_dir": run_dir,
        "workload": "gradaccum.examples.regression:regression",
        "steps": 60,
        "optimizer": "sgd",
        "lr": 0.02,
        "precision": "float64",
        "schedule": ScheduleConfig(kind="constant", warmup=0),
        "accum": AccumConfig(noise_scale=True, track_grad_norm=True),
        "batch_schedule": CriticalBatchConfig(max_global_batch=256, min_updates=10),
        "checkpoint_every": None,
        "checkpoint_minutes": None,
    }
    settings.update(kw)
    return TrainConfig(**settings)


def _untimed(run_dir: Path) -> list[dict[str, Any]]:
    """The step and batch records of a run without their timings: what two runs must share."""
    timing = ("step_time_ms", "tokens_per_s")
    return [
        {k: v for k, v in r.items() if k not in timing}
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] in ("step", "batch")
    ]


def _records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


@pytest.mark.parametrize(("fraction", "seed"), [(0.0, 2), (0.6, 4)])
def test_the_batch_settles_within_a_declared_factor_of_the_true_noise_scale(
    tmp_path: Path, fraction: float, seed: int
) -> None:
    trace, grad_sq = RegressionPopulation.build().truth(_at(fraction))
    truth = trace / grad_sq  # examples: the regression counts rows
    workload = dataclasses.replace(regression(), build_model=lambda: _at(fraction))
    config = _config(
        tmp_path,
        steps=160,
        lr=1e-300,  # the weights stay put, so B_noise stays `truth`
        seed=seed,
        batch_schedule=CriticalBatchConfig(max_global_batch=1024, min_updates=20),
    )
    result = train(config, workload=workload)
    changes = _records(tmp_path, "batch")
    steps = _records(tmp_path, "step")
    assert changes, "the schedule never grew the batch from 8 toward B_noise"
    settled = steps[-1]["global_batch"]
    assert settled == changes[-1]["global_batch"]
    assert truth / SETTLE_FACTOR <= settled <= SETTLE_FACTOR * truth, (settled, truth)
    # it grew only while below its estimate, and the estimate at the end is near the truth
    # (the accumulator's estimate / truth after 160 windows, same 16 runs: 0.89-1.30)
    assert all(c["from_global_batch"] < c["global_batch"] <= math.ceil(c["target"] / 4) * 4 for c in changes)
    assert result.noise_scale is not None and result.noise_scale.b_simple is not None
    assert result.noise_scale.b_simple == pytest.approx(truth, rel=0.35)
    assert settled >= result.noise_scale.b_simple / SETTLE_FACTOR
    assert all(c["global_batch"] <= 2 * c["from_global_batch"] for c in changes)  # growth 2
    assert all(b["step"] - a["step"] >= 20 for a, b in itertools.pairwise(changes))


def test_each_window_is_drawn_at_the_decided_batch_with_the_lr_rule(tmp_path: Path) -> None:
    train(_config(tmp_path))
    steps, changes = _records(tmp_path, "step"), _records(tmp_path, "batch")
    assert len(changes) >= 2
    batch = 8
    for step in steps:
        grown = [c for c in changes if c["window"] <= step["window"]]
        want = grown[-1]["global_batch"] if grown else batch
        assert step["global_batch"] == want and step["accum_steps"] == want // 4
        assert step["window_tokens"] == want  # every row counts: the window held exactly that batch
        assert step["lr"] == pytest.approx(0.02 * math.sqrt(want / batch), rel=1e-15)  # sqrt, the default
    card = json.loads((tmp_path / "runcard.json").read_text())["extra"]["batch_schedule"]
    assert card["lr_rule"] == "sqrt" and card["start_global_batch"] == batch
    assert [c["global_batch"] for c in card["changes"]] == [c["global_batch"] for c in changes]


def test_the_loss_plot_marks_each_batch_change(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gradaccum.train.records import loss_figure

    train(_config(tmp_path, steps=40))
    changes = _records(tmp_path, "batch")
    assert changes and (tmp_path / "loss.png").stat().st_size > 0
    figure = loss_figure(tmp_path / "metrics.jsonl")
    axes = figure.axes[0]
    marked = [line.get_xdata()[0] for line in axes.lines if line.get_linestyle() == "--"]
    # between the last window at the old batch (x = window) and the first at the new (x = window + 1)
    assert marked == [c["window"] + 0.5 for c in changes]
    assert [t.get_text() for t in axes.texts] == [f"batch {c['global_batch']}" for c in changes]
    assert f"{len(changes)} batch changes" in axes.get_title()


def test_a_resumed_run_equals_an_uninterrupted_one_bitwise_across_a_batch_change(tmp_path: Path) -> None:
    whole = train(_config(tmp_path / "whole", checkpoint_every=None))
    changes = _records(tmp_path / "whole", "batch")
    assert len(changes) >= 2
    cut = changes[0]["window"]  # stop right after the first change was decided
    first = train(_config(tmp_path / "cut", steps=cut))
    assert first.progress.windows == cut
    state = torch.load(first.checkpoints[-1] / "state.pt", weights_only=True)
    assert state["batch_schedule"]["accum_steps"] == changes[0]["accum_steps"]
    assert state["accumulator"]["noise"]["samples"] == cut  # the estimate travels too
    resumed = train(_config(tmp_path / "cut", resume=tmp_path / "cut"))
    assert resumed.resumed_from == first.checkpoints[-1]

    got, want = final_params(resumed), final_params(whole)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert resumed.noise_scale == whole.noise_scale

    # the same decisions, in the same windows
    assert _untimed(tmp_path / "cut") == _untimed(tmp_path / "whole")


def test_a_checkpoint_with_a_schedule_resumes_only_with_the_same_schedule(tmp_path: Path) -> None:
    first = train(_config(tmp_path, steps=12))
    with pytest.raises(TrainError, match="written by a run with --batch-schedule critical"):
        train(_config(tmp_path, resume=tmp_path, batch_schedule=None, accum=AccumConfig(noise_scale=True)))
    other = CriticalBatchConfig(max_global_batch=128, min_updates=10)
    with pytest.raises(PlanError, match="--max-global-batch"):
        train(_config(tmp_path, resume=tmp_path, batch_schedule=other))
    assert first.checkpoints


@pytest.mark.parametrize(
    ("settings", "plan", "match"),
    [
        (
            {"max_global_batch": 4},
            BatchPlan(micro_batch=4, accum_steps=2),
            r"--max-global-batch\) 4 is below",
        ),
        ({"max_global_batch": 30}, BatchPlan(micro_batch=4, accum_steps=2), "use 28 or 32"),
        ({"max_global_batch": 8}, BatchPlan(micro_batch=4, accum_steps=2), "could never change it"),
        ({"max_global_batch": 64}, BatchPlan(micro_batch=4, accum_steps=1), "accum_steps x dp >= 2"),
        ({"max_global_batch": 64, "growth": 1.0}, None, r"--batch-growth\) must be a number above 1"),
        ({"max_global_batch": 64, "min_updates": 0}, None, r"--batch-min-updates\) must be a positive"),
        ({"max_global_batch": 64, "lr_rule": "cubic"}, None, r"--batch-lr-rule\) must be one of keep"),
        ({"max_global_batch": 64, "fraction": 0}, None, r"--batch-fraction\) must be a number above 0"),
    ],
)
def test_bounds_that_contradict_the_plan_are_refused_naming_the_flag(
    settings: dict[str, Any], plan: BatchPlan | None, match: str
) -> None:
    with pytest.raises(PlanError, match=match):
        CriticalBatchConfig(**settings).check(plan or BatchPlan(micro_batch=4, accum_steps=2))


def test_the_schedule_needs_the_noise_scale(tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="set accum.noise_scale=True"):
        _config(tmp_path, accum=AccumConfig())


# -- the command line ---------------------------------------------------------------------------

_CLI = [
    "train",
    "--workload",
    "gradaccum.examples.regression:regression",
    "--global-batch",
    "8",
    "--micro-batch",
    "4",
    "--optimizer",
    "sgd",
    "--lr",
    "0.02",
    "--schedule",
    "constant",
    "--warmup",
    "0",
    "--steps",
    "40",
    "--checkpoint-every",
    "0",
]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--batch-schedule", "critical", "--max-global-batch", "4"], r"--max-global-batch\) 4 is below"),
        (["--batch-schedule", "critical", "--max-global-batch", "30"], "use 28 or 32"),
        (["--batch-schedule", "critical"], "give --max-global-batch"),
        (["--max-global-batch", "64"], "add --batch-schedule critical"),
        (["--batch-lr-rule", "keep"], "add --batch-schedule critical"),
        (
            ["--batch-schedule", "critical", "--max-global-batch", "64", "--batch-growth", "1"],
            "--batch-growth",
        ),
        (
            ["--batch-schedule", "critical", "--max-global-batch", "64", "--batch-lr-rule", "x"],
            "--batch-lr-rule",
        ),
        (
            ["--batch-schedule", "critical", "--max-global-batch", "64", "--global-batch", "4"],
            r"accum_steps x dp >= 2",
        ),
    ],
)
def test_the_command_line_refuses_bad_bounds_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], match: str
) -> None:
    argv = [*_CLI, *flags, "--run-dir", str(tmp_path / "run")]  # a flag given twice: the last wins
    with contextlib.suppress(SystemExit):
        assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(match, err), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_run_card_replays_the_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schedule = ["--batch-schedule", "critical", "--max-global-batch", "64", "--batch-min-updates", "10"]
    assert main([*_CLI, *schedule, "--run-dir", str(tmp_path / "first")]) == 0
    out = capsys.readouterr().out
    changes = _records(tmp_path / "first", "batch")
    assert changes and "global batch 8 -> " in out and "batch schedule: global batch 8 -> " in out
    # the units labelled: the batch in examples, B_simple in the workload's unit (the regression's rows)
    assert re.search(
        r"global batch 8 -> \d+ examples \(accum_steps \d+\) after step \d+: B_simple over "
        r"the last windows ~ [\d,]+ examples, aiming at",
        out,
    ), out
    final = _records(tmp_path / "first", "step")[-1]["global_batch"]
    last = changes[-1]
    assert (
        f"final global batch {final:,} examples (the last window) is" in out
        and f"(B_recent at the change after step {last['step']})" in out
    ), out
    assert "over the whole run, the mean per update: global batch" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "first" / "batch.png").stat().st_size > 0 and "batch.png" in out
    card = tmp_path / "first" / "runcard.json"
    recorded = json.loads(card.read_text())["extra"]["batch_schedule"]
    assert recorded["max_global_batch"] == 64 and recorded["min_updates"] == 10
    assert [c["global_batch"] for c in recorded["changes"]] == [c["global_batch"] for c in changes]

    replay = ["train", "--runcard", str(card), "--steps", "40", "--schedule", "constant", "--warmup", "0"]
    assert main([*replay, "--checkpoint-every", "0", "--run-dir", str(tmp_path / "again")]) == 0
    assert "from run card: batch schedule critical, up to 64" in capsys.readouterr().out

    assert _untimed(tmp_path / "again") == _untimed(tmp_path / "first")
    # beside the card, a batch flag would change what it fixes: refused, naming the card's value
    assert main([*replay, "--max-global-batch", "128", "--run-dir", str(tmp_path / "third")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--max-global-batch 128 (the card has 64)" in err, err


def _state(**changes: Any) -> dict[str, Any]:
    schedule = CriticalBatchSchedule(
        CriticalBatchConfig(max_global_batch=64), BatchPlan(micro_batch=4, accum_steps=2)
    )
    return {**schedule.state_dict(), **changes}


@pytest.mark.parametrize(
    ("state", "match"),
    [
        (_state(accum_steps=17), r"outside \[2, 16\]"),
        (_state(accum_steps=1), r"outside \[2, 16\]"),
        (_state(recent=[[1.0]]), "pairs of finite floats"),
        (_state(recent=[[1.0, float("nan")]]), "pairs of finite floats"),
        (_state(base={"micro_batch": 2, "accum_steps": 4, "dp": 1}), "started from"),
        ({"accum_steps": 2}, "holds exactly"),
    ],
)
def test_a_bad_schedule_state_is_refused_and_changes_nothing(state: dict[str, Any], match: str) -> None:
    schedule = CriticalBatchSchedule(
        CriticalBatchConfig(max_global_batch=64), BatchPlan(micro_batch=4, accum_steps=2)
    )
    with pytest.raises(PlanError, match=match):
        schedule.load_state_dict(state)
    assert schedule.state_dict() == _state()
