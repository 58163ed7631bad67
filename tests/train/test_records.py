"""Run records: metrics lines survive crashes and resumes without duplicates; the loss curve; a run
that fails before its first window writes nothing, one that fails later keeps what it wrote."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gradaccum.train import CheckpointRecord, EvalRecord, StepRecord, plot_loss, read_metrics, train
from gradaccum.train.records import MetricsLog
from tests.train.common import config, gpt, on_loss_call

ACCUM = 4  # common.config: global batch 16 in micro-batches of 4


def _crash() -> None:
    raise RuntimeError("crash in the workload's loss")


def _step(window: int, loss: float | None = 1.0, applied: bool = True) -> StepRecord:
    return StepRecord(
        window=window, step=window + 1, loss=loss, grad_norm=float("inf") if not applied else 0.5, lr=0.1,
        tokens=10 * (window + 1), window_tokens=10, applied=applied, skipped=0 if applied else 1,
        skip_reason=None if applied else "non-finite", loss_scale=None, step_time_ms=1.0, tokens_per_s=1e4,
    )  # fmt: skip


def test_resume_drops_the_records_of_windows_it_will_train_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for w in range(5):
        log.write(_step(w))
        if w == 2:
            log.write(CheckpointRecord(window=3, step=3, path="ckpt", reason="periodic"))
            log.write(EvalRecord(window=3, step=3, eval_loss=1.5, eval_tokens=40))
    log.close()
    with path.open("a") as handle:
        handle.write('{"window": 5, "ki')  # a line cut short by a crash

    resumed = MetricsLog(path, resume_window=3)  # the checkpoint after 3 windows
    resumed.write(_step(3))
    resumed.close()
    records = read_metrics(path)
    assert [(r["kind"], r["window"]) for r in records] == [
        ("step", 0), ("step", 1), ("step", 2), ("checkpoint", 3), ("eval", 3), ("step", 3),
    ]  # fmt: skip


def test_non_finite_figures_are_written_as_null(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write(_step(0, loss=float("nan"), applied=False))
    log.close()
    record = json.loads((tmp_path / "m.jsonl").read_text())
    assert record["loss"] is None and record["grad_norm"] is None and record["applied"] is False


def test_loss_curve_is_a_png_and_nothing_is_drawn_without_losses(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "m.jsonl")
    for w in range(4):
        log.write(_step(w, loss=2.0 - 0.1 * w, applied=w != 2))
    log.write(EvalRecord(window=4, step=3, eval_loss=1.8, eval_tokens=40))
    log.close()
    png = plot_loss(tmp_path / "m.jsonl", tmp_path / "loss.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    MetricsLog(tmp_path / "empty.jsonl").close()
    assert plot_loss(tmp_path / "empty.jsonl", tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_a_run_that_fails_before_its_first_window_leaves_the_run_folder_empty(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash in the workload's loss"):
        train(config(run_dir, steps=2), workload=on_loss_call(gpt(), ACCUM - 1, _crash))  # window 0
    assert not run_dir.exists() or not any(run_dir.iterdir()), sorted(run_dir.rglob("*"))


def test_a_run_that_fails_after_some_windows_keeps_its_card_and_records(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="crash in the workload's loss"):
        train(config(tmp_path, steps=4), workload=on_loss_call(gpt(), 2 * ACCUM + 1, _crash))  # window 2
    card = json.loads((tmp_path / "runcard.json").read_text())
    assert card["accum_steps"] == ACCUM
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["kind"], r["window"]) for r in records] == [("step", 0), ("step", 1)]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn on the way out


def test_a_resume_that_fails_before_its_first_window_keeps_the_earlier_records(tmp_path: Path) -> None:
    first = train(config(tmp_path, steps=3, checkpoint_every=2))
    assert len(first.checkpoints) == 2  # periodic after window 2, final after window 3
    before = (tmp_path / "metrics.jsonl").read_text()
    (first.checkpoints[-1] / "manifest.json").unlink()  # the newest is broken: resume passes over it
    resume = replace(config(tmp_path, steps=4), resume=tmp_path)  # would drop window 2's lines
    with pytest.raises(RuntimeError, match="crash in the workload's loss"):
        train(resume, workload=on_loss_call(gpt(), 0, _crash))
    assert (tmp_path / "metrics.jsonl").read_text() == before
