"""What ``train`` prints as it goes and at the end, without training: the renderer fed records."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gradaccum.cli import train_render
from gradaccum.cli.train_render import TrainRenderer, loss_summary


def _record(window: int, **changed: Any) -> Any:
    """A step record as the renderer reads it; ``changed`` overrides its fields."""
    return SimpleNamespace(**{
        "window": window, "window_tokens": 100, "step_time_ms": 10.0, "loss": 5.0 - window / 1000,
        "lr": 1e-3, "tokens": 100 * (window + 1), "applied": True, "skipped": 0, "skip_reason": None,
        "recompiles": 0, "micro_batches": None, "computed_tokens": None, "padding_tokens": None, **changed,
    })  # fmt: skip


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


def _timed(window: int, step_time_ms: float, recompiles: int = 0) -> Any:
    return _record(window, step_time_ms=step_time_ms, recompiles=recompiles)


def test_compile_time_is_the_compiling_windows_time_beyond_a_plain_window() -> None:
    steps = [_timed(0, 5010.0, recompiles=3), _timed(1, 10.0), _timed(2, 12.0), _timed(3, 10.0)]
    assert train_render.compile_seconds(steps) == pytest.approx(5.0)  # 5010 ms less the median 10 ms
    assert train_render.compile_seconds([_timed(0, 10.0)]) == 0.0  # eager: nothing compiled
    assert train_render.compile_seconds([_timed(0, 800.0, recompiles=1)]) == pytest.approx(0.8)


def test_the_summary_prints_compile_time_apart_and_keeps_it_out_of_tokens_per_second(
    capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    renderer = TrainRenderer(SimpleNamespace(steps=4, max_tokens=None), SimpleNamespace(), [])  # type: ignore[arg-type]
    for record in (_timed(0, 5010.0, recompiles=2), _timed(1, 10.0), _timed(2, 10.0), _timed(3, 10.0)):
        renderer._step(record)
    progress = SimpleNamespace(windows=4, steps_applied=4, steps_skipped=0, tokens_consumed=400)
    result = SimpleNamespace(
        progress=progress, eval_loss=None, critical_batch=None, batch_schedule=None, stopped="completed",
        tokens_per_s=400 / 6.0, wall_s=6.0, loss_scale=None, run_dir=tmp_path, checkpoints=[],
    )  # fmt: skip
    renderer.summary(result, "")  # type: ignore[arg-type]
    out = " ".join(capsys.readouterr().out.split())
    assert "compile time: 5.0 s (torch.compile, 2 graphs in 1 window" in out
    # 300 tokens over the 30 ms of the three plain windows; 400 tokens over 6.0 - 5.0 s of wall time
    assert "10,000 tok/s in the training windows that did not compile" in out
    assert "400 tok/s over the 1.0 s wall time without compiling" in out


def _window(window: int, global_batch: int, tokens: int, b_simple: float | None) -> Any:
    return _record(window, global_batch=global_batch, window_tokens=tokens, b_simple=b_simple)


def test_the_final_batch_and_the_last_estimate_are_stated_in_one_labelled_unit() -> None:
    # the case of the issue: the run's mean was 1,229 tokens per update, the final batch far larger
    steps = [_window(0, 16, 270, None), _window(99, 208, 3524, 1385.0)]
    change = SimpleNamespace(step=90, b_simple=4484.0)
    words = train_render.final_batch_words(steps, [change], "tokens")  # type: ignore[arg-type]
    assert words == (
        "final global batch 208 examples = 3,524 tokens (the last window) is 0.79x the last B_simple "
        "estimate ~ 4,484 tokens (B_recent at the change after step 90)"
    )
    # before any change: the smoothed estimate, said so; a workload counting examples says it once
    words = train_render.final_batch_words(steps, [], "examples")  # type: ignore[arg-type]
    assert words is not None and words.startswith("final global batch 3,524 examples (the last window) is")
    assert words.endswith("~ 1,385 examples (smoothed over the run, after the last window)")


def test_a_batch_change_line_labels_examples_and_the_workloads_unit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gradaccum.train.batch_schedule import BatchChange

    renderer = TrainRenderer(SimpleNamespace(steps=100), SimpleNamespace(), [])  # type: ignore[arg-type]
    renderer.unit = "tokens"
    change = BatchChange(
        window=40, step=40, from_global_batch=16, global_batch=32, accum_steps=4, b_simple=1234.0,
        target=30.5, lr_scale=1.41,
    )  # fmt: skip
    renderer(change)
    out = " ".join(capsys.readouterr().out.split())
    assert "global batch 16 -> 32 examples (accum_steps 4) after step 40" in out
    assert "B_simple over the last windows ~ 1,234 tokens, aiming at 30.5 examples" in out
