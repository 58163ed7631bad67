"""``torchrun --max-restarts 2 ... --resume auto`` recovers from a SIGKILLed worker by itself.

A real two-process torchrun job (gloo) of the tiny GPT (the bundled default workload, slowed down),
float64, global batch 12, seed 3, a constant schedule, a checkpoint every 2 steps: rank 1's worker is
SIGKILLed once a checkpoint after 4 windows is intact. torchrun's agent stops the survivor and
starts both workers again; they form the group of the new restart round (its keys under their own
prefix: docs/design/distributed-and-mesh.md, "Restart rounds"), resume from the newest complete
checkpoint and finish. The job exits 0 and its final parameters are those of an uninterrupted
two-process run, bit for bit: the restarted run repeats the same operations on the same layout.

Shrink: two torchrun agents of one job (``--nnodes 1:2 --rdzv-backend c10d``, one worker each) on
127.0.0.1; the second agent's whole session is SIGKILLed after a checkpoint (a lost node). The
survivor's agent re-forms the job with one node and restarts its worker, which resumes the 2-process
checkpoint on 1 process, the same global batch, and finishes on the reference to 1e-10 (another cut
of each window only reorders float64 sums: measured 4.7e-13 after 16 steps).

Each job runs under a deadline (its session is killed if the test fails midway), so a hang in
a restart round fails the test instead of stalling it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.faults.cli_runs import (
    REPO,
    Run,
    assert_same_model,
    intact,
    model_state,
    start,
    wait_until,
    windows_of,
)
from tests.helpers.launcher import free_port

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final parameters of an uninterrupted two-process torchrun run of the same flags."""
    tmp = tmp_path_factory.mktemp("reference")
    with _job(start(_argv("gradaccum.examples:tiny_gpt", tmp / "run"), tmp, torchrun=2)) as ref:
        assert ref.wait(180) == 0, ref.output()
    return model_state(intact(tmp / "run")[0])


def test_a_worker_killed_mid_run_is_restarted_and_the_job_finishes_on_the_reference(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
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
    assert_same_model(model_state(newest), reference)


def _agent(tmp: Path, name: str, port: int, run_dir: Path) -> Run:
    """One node's torchrun agent of a ``--nnodes 1:2`` job (one worker), its own session."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "shrink"]
    command += ["--rdzv-conf", "last_call_timeout=5", "--max-restarts", "2", "-m", "gradaccum"]
    command += _argv("tests.faults.train_workloads:slow_gpt", run_dir)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    env["GRADACCUM_TEST_SLEEP"] = "0.05"
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    with out.open("wb") as o, err.open("wb") as e:
        process = subprocess.Popen(command, cwd=REPO, stdout=o, stderr=e, env=env, start_new_session=True)
    return Run(process, out, err, time.monotonic(), own_group=True)


def test_a_lost_node_shrinks_the_job_and_the_survivor_finishes_on_the_reference(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    run_dir, port = tmp_path / "run", free_port()
    with _job(_agent(tmp_path, "first", port, run_dir)) as first:
        time.sleep(1)  # the first agent hosts the rendezvous: the node that is lost is the other one
        with _job(_agent(tmp_path, "second", port, run_dir)) as second:
            wait_until(lambda: any(windows_of(p) >= 4 for p in intact(run_dir)), first, 180, "a checkpoint")
        # leaving the block killed the second node: its agent and its worker
        code = first.wait(240)
    assert code == 0, f"{first.output()}\n--- the lost node\n{second.output()}"
    out = first.stdout
    assert "now 1 process (no wrapper), micro-batch 3 x 4 accumulation steps" in out, out
    newest = intact(run_dir)[0]
    assert windows_of(newest) == STEPS
    got = model_state(newest)
    err = max((got[k] - reference[k]).abs().max().item() for k in reference)
    assert err <= 1e-10, f"max abs parameter difference {err:.2e} from the uninterrupted run"
