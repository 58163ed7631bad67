"""``gradaccum train`` under real signals, in a subprocess, as a job scheduler or a person sends them.

* The first SIGINT/SIGTERM finishes the window, checkpoints at its boundary, exits 130/143 and
  prints the resume command; resuming with it ends where an uninterrupted run ends, bit for bit.
* A second signal a second later stops at once (exit 130), mid-window or inside the checkpoint
  write, removing the temporary folder; the newest complete checkpoint stays intact.
* A signal during start-up (imports, building the workload) exits 130/143 with one line and
  leaves no run folder.

Each process runs under a deadline (``cli_runs.Run.wait``) and pytest-timeout bounds each test.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from tests.faults.cli_runs import (
    EXACT,
    WORKLOAD,
    assert_same_model,
    intact,
    leftovers,
    model_state,
    no_traceback,
    running,
    start,
    steps_recorded,
    train_argv,
    wait_until,
    windows_of,
)

pytestmark = pytest.mark.timeout(180)

# a window of 4 micro-batches: about 0.2 s of sleep plus the tiny GPT's compute
SLEEP_S = "0.05"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_finishes_the_window_checkpoints_and_exits_with_the_schedulers_code(
    signum: int, code: int, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # an explicit schedule: the resumed run and the reference are shorter, and must follow the same
    schedule = ["--warmup", "2", "--horizon", "1000"]
    argv = train_argv(run_dir, 1000, *schedule)
    with running(start(argv, tmp_path, env={"GRADACCUM_TEST_SLEEP": SLEEP_S})) as run:
        wait_until(lambda: steps_recorded(run_dir) >= 3, run, 120, "three trained windows")
        sent = run.signal(signum)
        assert run.wait(60) == code, run.output()
        took = time.monotonic() - sent
    no_traceback(run.output())
    name = "SIGINT" if signum == signal.SIGINT else "SIGTERM"
    assert f"{name}: finishing this window, then checkpointing and stopping" in run.stderr
    newest = intact(run_dir)
    assert newest, run.output()
    windows = windows_of(newest[0])
    assert steps_recorded(run_dir) == windows, "the window in progress finished; none began after it"
    assert leftovers(run_dir) == []
    assert f"checkpoint (stop) after {windows} boundaries" in run.stdout
    flags = " ".join([*EXACT, *schedule])
    resume = f"resume with: gradaccum train --workload {WORKLOAD} {flags} --steps 1000 --run-dir"
    assert resume in run.stdout and "--resume auto" in run.stdout, run.stdout
    assert took < 30, f"{took:.1f} s from the signal to the exit"
    if signum != signal.SIGINT:
        return
    # resume with the printed command (shorter), and compare with an uninterrupted run in this process
    total = windows + 2
    again = [*argv[:-4], "--steps", str(total), "--run-dir", str(run_dir), "--resume", "auto"]
    with running(start(again, tmp_path, name="resumed")) as resumed:
        assert resumed.wait(120) == 0, resumed.output()
    assert f"resumed from {newest[0]} at boundary {windows}" in resumed.stdout
    reference = tmp_path / "reference"
    assert main([*argv[:-4], "--steps", str(total), "--run-dir", str(reference)]) == 0
    assert_same_model(model_state(intact(run_dir)[0]), model_state(intact(reference)[0]))


def test_second_signal_mid_window_stops_at_once_and_keeps_the_newest_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--workload", WORKLOAD, *EXACT, "--steps", "100", "--checkpoint-every", "1"]
    # windows of about 4 x 0.6 s: both signals land inside one window
    env = {"GRADACCUM_TEST_SLEEP": "0.6"}
    with running(start([*argv, "--run-dir", str(run_dir)], tmp_path, env=env)) as run:
        wait_until(lambda: bool(intact(run_dir)), run, 120, "a first checkpoint")
        run.signal(signal.SIGINT)
        time.sleep(1.3)  # a repeat within a second is the same request (torchrun forwards Ctrl-C)
        sent = run.signal(signal.SIGINT)
        assert run.wait(30) == 130, run.output()
        took = time.monotonic() - sent
    no_traceback(run.output())
    assert "second signal (SIGINT): stopped at once, mid-window" in run.stderr, run.stderr
    assert took < 5, f"{took:.1f} s from the second signal to the exit"
    newest = intact(run_dir)
    assert newest and f"the newest complete checkpoint, {newest[0]}, is intact" in run.stderr
    assert leftovers(run_dir) == []
    assert "resume with: gradaccum train" in run.stderr


def test_second_signal_inside_the_checkpoint_write_removes_it_and_keeps_the_previous(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--workload", WORKLOAD, *EXACT, "--steps", "100", "--checkpoint-every", "2"]
    argv += ["--keep-checkpoints", "1", "--run-dir", str(run_dir)]
    # 64 MiB of buffer (128 MiB in float64) make each checkpoint write take ~0.5-1 s; windows ~1.6 s
    env = {"GRADACCUM_TEST_SLEEP": "0.4", "GRADACCUM_TEST_BUFFER_MB": "64"}
    checkpoints = run_dir / "checkpoints"
    with running(start(argv, tmp_path, env=env)) as run:
        wait_until(lambda: bool(intact(run_dir)), run, 120, "a first checkpoint")
        first = intact(run_dir)[0]
        run.signal(signal.SIGINT)  # now window 3 trains (~1.6 s), then its stop checkpoint starts
        wait_until(lambda: any(checkpoints.glob(".tmp-step-*")), run, 60, "the stop checkpoint's write")
        run.signal(signal.SIGINT)
        assert run.wait(30) == 130, run.output()
    no_traceback(run.output())
    assert "stopped at once" in run.stderr, run.output()
    assert leftovers(run_dir) == [], "the half-written checkpoint folder is removed"
    assert intact(run_dir) == [first], "the previous checkpoint is intact and still the newest"


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_exits_with_one_line_and_writes_nothing(
    signum: int, code: int, tmp_path: Path
) -> None:
    mark = tmp_path / "mark"
    mark.mkdir()
    run_dir = tmp_path / "run"
    env = {"GRADACCUM_TEST_MARK": str(mark), "GRADACCUM_TEST_BUILD_SLEEP": "30"}
    argv = ["train", "--workload", WORKLOAD, "--steps", "5", "--run-dir", str(run_dir)]
    # while the workload is being built (after torch and the commands loaded)
    with running(start(argv, tmp_path, env=env)) as run:
        wait_until(lambda: (mark / "building-0").exists(), run, 120, "the workload's factory")
        run.signal(signum)
        assert run.wait(20) == code, run.output()
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "during start-up; nothing was trained or written" in lines[0], run.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_the_commands_load_exits_with_one_line(signum: int, code: int, tmp_path: Path) -> None:
    # half a second in, python is importing torch (--help alone takes ~2 s on this machine). Raising
    # KeyboardInterrupt there was swallowed by torch's guarded import of numpy, and the run went on.
    with running(start(["train", "--steps", "5", "--run-dir", str(tmp_path / "run")], tmp_path)) as run:
        time.sleep(0.5)
        run.signal(signum)
        assert run.wait(30) == code, run.output()
    lines = run.stderr.strip().splitlines()
    name = "SIGINT" if signum == signal.SIGINT else "SIGTERM"
    assert len(lines) == 1, run.output()
    # on a very fast machine the workload may already be building: the other start-up path
    assert lines[0] in (
        f"gradaccum train: interrupted ({name}) while starting; nothing was done",
        f"gradaccum train: interrupted ({name}) during start-up; nothing was trained or written",
    ), run.output()
    assert run.stdout == ""
    assert not (tmp_path / "run").exists()
