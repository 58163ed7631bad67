"""``torchrun --max-restarts 2 ... --resume auto`` recovers from a SIGKILLed worker by itself.

A real two-process torchrun job (gloo) of the tiny GPT (the bundled default workload, slowed down),
float64, global batch 12, seed 3, a constant schedule, a checkpoint every 2 steps: rank 1's worker is
SIGKILLed once a checkpoint after 4 windows is intact. torchrun's agent stops the survivor and
starts both workers again; they form the group of the new restart round (its keys under their own
prefix: docs/design/distributed-and-mesh.md, "Restart rounds"), resume from the newest complete
checkpoint and finish. The job exits 0 and its final parameters are those of an uninterrupted
two-process run, bit for bit: the restarted run repeats the same operations on the same layout.

The whole job runs under a deadline (its session is killed if the test fails midway), so a hang in
a restart round fails the test instead of stalling it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.cli_runs import (
    Run,
    assert_same_model,
    intact,
    model_state,
    running,
    start,
    wait_until,
    windows_of,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

STEPS = 12
FLAGS = [
    "--precision",
    "float64",
    "--threads",
    "1",
    "--global-batch",
    "12",
    "--micro-batch",
    "3",
    "--seed",
    "3",
    "--schedule",
    "constant",
    "--checkpoint-every",
    "2",
    "--steps",
    str(STEPS),
]


def _argv(workload: str, run_dir: Path) -> list[str]:
    return ["train", "--workload", workload, *FLAGS, "--run-dir", str(run_dir), "--resume", "auto"]


@contextlib.contextmanager
def _job(run: Run) -> Iterator[Run]:
    """``running``, with torchrun's workers killed too if the job is left running (each worker has a
    session of its own: killing the agent's would leave a hung restart round behind)."""
    try:
        yield run
    finally:
        if run.process.poll() is None:
            agent = run.process.pid
            with contextlib.suppress(OSError):
                for pid in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
            run.kill()


def test_a_worker_killed_mid_run_is_restarted_and_the_job_finishes_on_the_reference(tmp_path: Path) -> None:
    run_dir, mark = tmp_path / "run", tmp_path / "mark"
    mark.mkdir()
    env = {"GRADACCUM_TEST_SLEEP": "0.05", "GRADACCUM_TEST_MARK": str(mark)}
    argv = _argv("tests.faults.train_workloads:slow_gpt", run_dir)
    job = start(argv, tmp_path, env=env, torchrun=2, torchrun_args=["--max-restarts", "2"], name="restarted")
    with _job(job):
        wait_until(lambda: any(windows_of(p) >= 4 for p in intact(run_dir)), job, 180, "a checkpoint")
        os.kill(int((mark / "building-1").read_text()), signal.SIGKILL)
        code = job.wait(240)
    assert code == 0, job.output()
    out = job.stdout
    assert out.count("resumed from ") >= 1, job.output()  # a restart round continued the run
    assert f"step {STEPS}:" in out
    newest = intact(run_dir)[0]
    assert windows_of(newest) == STEPS

    reference = tmp_path / "reference"
    ref = start(_argv("gradaccum.examples:tiny_gpt", reference), tmp_path, torchrun=2, name="reference")
    with running(ref):
        assert ref.wait(180) == 0, ref.output()
    assert_same_model(model_state(newest), model_state(intact(reference)[0]))
