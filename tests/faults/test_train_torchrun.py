"""A real two-process ``torchrun`` job of ``gradaccum train`` (gloo) whose rank 1 is killed with
SIGKILL mid-run: the surviving rank exits within seconds with its own message naming the lost rank
and the resume command, every checkpoint written stays intact, and resuming with that command ends
bit for bit where an uninterrupted two-process run ends.

Each launch runs under a deadline; torchrun's whole session is killed if a test fails midway.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.faults.cli_runs import (
    EXACT,
    WORKLOAD,
    assert_same_model,
    intact,
    leftovers,
    model_state,
    running,
    start,
    train_argv,
    wait_until,
    windows_of,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

SCHEDULE = ["--warmup", "2", "--horizon", "1000"]


def _argv(run_dir: Path, steps: int) -> list[str]:
    return train_argv(run_dir, steps, *SCHEDULE)


def test_a_rank_killed_mid_run_is_named_by_the_survivor_and_the_run_resumes_exactly(tmp_path: Path) -> None:
    run_dir, mark = tmp_path / "run", tmp_path / "mark"
    mark.mkdir()
    env = {"GRADACCUM_TEST_SLEEP": "0.05", "GRADACCUM_TEST_MARK": str(mark)}
    argv = [*_argv(run_dir, 1000), "--checkpoint-every", "3"]
    with running(start(argv, tmp_path, env=env, torchrun=2, name="killed")) as job:
        wait_until(lambda: any(windows_of(p) >= 6 for p in intact(run_dir)), job, 180, "a second checkpoint")
        os.kill(int((mark / "building-1").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        code = job.wait(60)
        took = time.monotonic() - killed
    assert code != 0, job.output()
    err = job.stderr
    assert (
        "gradaccum train: failed: rank 0: rank 1 of 2 stopped answering (its process died or hangs)" in err
    ), err
    resume = (
        f"resume with: torchrun --nproc-per-node 2 -m gradaccum train --workload {WORKLOAD} "
        f"{' '.join([*EXACT, *SCHEDULE])} --steps 1000 --checkpoint-every 3 --run-dir {run_dir} --resume auto"
    )
    assert resume in err, err
    assert took < 20, f"the job took {took:.1f} s to end after the kill"
    # every checkpoint left verifies; nothing half-written
    checkpoints = intact(run_dir)
    assert checkpoints and len(checkpoints) == len(list((run_dir / "checkpoints").glob("step-*")))
    assert leftovers(run_dir) == []
    newest = windows_of(checkpoints[0])
    assert f"the newest complete checkpoint is {checkpoints[0]}" in err

    total = newest + 2
    resumed_argv = [*_argv(run_dir, total), "--checkpoint-every", "3", "--resume", "auto"]
    with running(start(resumed_argv, tmp_path, torchrun=2, name="resumed")) as resumed:
        assert resumed.wait(180) == 0, resumed.output()
    assert f"resumed from {checkpoints[0]} at boundary {newest}" in resumed.stdout
    reference = tmp_path / "reference"
    with running(start(_argv(reference, total), tmp_path, torchrun=2, name="reference")) as ref:
        assert ref.wait(180) == 0, ref.output()
    assert_same_model(model_state(intact(run_dir)[0]), model_state(intact(reference)[0]))
