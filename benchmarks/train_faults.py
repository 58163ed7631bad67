"""How fast ``gradaccum train`` reacts to what a scheduler or a crash does to it, in real processes.

Prints the seconds from the first SIGINT to the exit (the window finishes, the stop checkpoint and
the records are written), from a second SIGINT to the exit (stop at once), and from SIGKILL of rank
1 of a two-process torchrun job to the job's end (the survivor names the lost rank). Uses the test
suite's subprocess helpers and slowed tiny GPT; run from the repository root:

    .venv/bin/python benchmarks/train_faults.py
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults.cli_runs import (  # after the repository root is on the path
    EXACT,
    WORKLOAD,
    intact,
    start,
    steps_recorded,
    wait_until,
    windows_of,
)


def first_signal(tmp: Path) -> tuple[int, float]:
    run_dir = tmp / "run"
    argv = ["train", "--workload", WORKLOAD, *EXACT, "--steps", "1000", "--run-dir", str(run_dir)]
    run = start(argv, tmp, env={"GRADACCUM_TEST_SLEEP": "0.05"})
    wait_until(lambda: steps_recorded(run_dir) >= 3, run, 120, "three windows")
    sent = run.signal(signal.SIGINT)
    return run.wait(60), time.monotonic() - sent


def second_signal(tmp: Path) -> tuple[int, float]:
    run_dir = tmp / "run"
    argv = ["train", "--workload", WORKLOAD, *EXACT, "--steps", "100", "--checkpoint-every", "1"]
    run = start([*argv, "--run-dir", str(run_dir)], tmp, env={"GRADACCUM_TEST_SLEEP": "0.6"})
    wait_until(lambda: bool(intact(run_dir)), run, 120, "a checkpoint")
    run.signal(signal.SIGINT)
    time.sleep(1.3)
    sent = run.signal(signal.SIGINT)
    return run.wait(60), time.monotonic() - sent


def lost_rank(tmp: Path) -> tuple[int, float]:
    run_dir, mark = tmp / "run", tmp / "mark"
    mark.mkdir()
    argv = ["train", "--workload", WORKLOAD, *EXACT, "--steps", "1000", "--checkpoint-every", "3"]
    env = {"GRADACCUM_TEST_SLEEP": "0.05", "GRADACCUM_TEST_MARK": str(mark)}
    run = start([*argv, "--run-dir", str(run_dir)], tmp, env=env, torchrun=2)
    wait_until(lambda: any(windows_of(p) >= 6 for p in intact(run_dir)), run, 180, "two checkpoints")
    os.kill(int((mark / "building-1").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    return run.wait(60), time.monotonic() - killed


def main() -> None:
    cases = (
        ("first SIGINT -> exit", first_signal),
        ("second SIGINT -> exit", second_signal),
        ("SIGKILL of rank 1 -> end of the torchrun job", lost_rank),
    )
    for name, case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            code, seconds = case(Path(tmp))
        print(f"{name}: exit {code} after {seconds:.2f} s")


if __name__ == "__main__":
    main()
