"""Run records: metrics lines survive crashes and resumes without duplicates; the loss curve."""

from __future__ import annotations

import json
from pathlib import Path

from gradaccum.train import CheckpointRecord, EvalRecord, StepRecord, plot_loss, read_metrics
from gradaccum.train.records import MetricsLog


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
