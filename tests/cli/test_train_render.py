"""What ``train`` prints as it goes and at the end, without training: the renderer fed records."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gradaccum.cli import train_render
from gradaccum.cli.train_render import TrainRenderer, loss_summary


def _record(window: int) -> Any:
    return SimpleNamespace(
        window=window, window_tokens=100, step_time_ms=10.0, loss=5.0 - window / 1000, lr=1e-3,
        tokens=100 * (window + 1), applied=True, skipped=0, skip_reason=None, recompiles=0,
    )  # fmt: skip


def test_progress_lines_come_by_time_as_well_as_by_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    now = [0.0]
    monkeypatch.setattr(train_render.time, "monotonic", lambda: now[0])
    renderer = TrainRenderer(SimpleNamespace(steps=5000), SimpleNamespace(), [])  # type: ignore[arg-type]
    for window in range(40):  # the step cadence is every 500 steps; each of these takes 1 s
        renderer._step(_record(window))
        now[0] += 1.0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    # the first loss at once, then one line at least every 10 s
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 11", "step 21", "step 31"]


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([], "no update applied"),
        ([5.5358], "one update applied: loss 5.5358 (too short to show a trend)"),
        (
            [5.5358, 5.4, 5.2, 5.1],
            "start loss 5.4679 -> end loss 5.1500 (-0.3179; means of the first and last 2 updates of 4; "
            "every loss: 5.5358, 5.4000, 5.2000, 5.1000)",
        ),
    ],
)
def test_a_short_run_s_summary_means_something(losses: list[float], expected: str) -> None:
    assert loss_summary(losses).startswith(expected)


def test_a_long_run_s_summary_compares_the_first_and_last_five() -> None:
    text = loss_summary([float(20 - i) for i in range(20)])
    assert text.startswith("start loss 18.0000 -> end loss 3.0000 (-15.0000; means of the first and last 5")


@pytest.mark.parametrize("stop_written", [True, False])
def test_the_second_signal_says_what_was_written_and_what_was_removed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, stop_written: bool
) -> None:
    import time

    from gradaccum.cli.train_signals import TrainSignals
    from gradaccum.train import checkpoint

    folder = tmp_path / "checkpoints" / "step-00000004"
    folder.mkdir(parents=True)
    leftover = tmp_path / "checkpoints" / ".tmp-step-00000005"
    monkeypatch.setattr(checkpoint, "find_intact", lambda run_dir, checksums: SimpleNamespace(path=folder))
    monkeypatch.setattr(
        checkpoint, "remove_partial_checkpoints", lambda run_dir: [] if stop_written else [leftover]
    )
    signals = TrainSignals(leader=True)
    signals.run_dir = tmp_path
    signals._first_wall = time.time() - 60 if stop_written else time.time() + 60
    text = signals._stopped_now("SIGINT")
    if stop_written:
        assert text == (
            "second signal (SIGINT): stopped at once, after the stop checkpoint was written; written: the "
            f"stop checkpoint, {folder}, intact; nothing was being written, so nothing was removed"
        )
    else:
        assert text.startswith("second signal (SIGINT): stopped at once, mid-window; the newest complete")
        assert text.endswith("removed, unfinished: .tmp-step-00000005")
