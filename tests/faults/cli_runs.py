"""``gradaccum train`` as a real subprocess (or a real torchrun job), for the tests that signal, kill
or starve it: start it, watch its run folder, wait for it under a deadline, read what it left.

Every wait has a deadline and a process that outlives its test is killed, so no test can hang CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradaccum.train.checkpoint import checkpoint_problem, checkpoints_of

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = "tests.faults.train_workloads:slow_gpt"
# float64 on one thread: a resumed run repeats an uninterrupted one's operations exactly, so their
# parameters are compared bit for bit (any difference is a resume bug, not rounding)
EXACT = ["--precision", "float64", "--threads", "1", "--global-batch", "16", "--micro-batch", "4"]
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train_argv(run_dir: Path, steps: int, *settings: str) -> list[str]:
    """``train`` of the slow workload in float64 for ``steps`` windows into ``run_dir``; ``settings``
    stand between the precision flags and ``--steps``, where a resume hint repeats them."""
    return [
        "train",
        "--workload",
        WORKLOAD,
        *EXACT,
        *settings,
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
    ]


@dataclass
class Run:
    """A started command: its process, and where its output goes."""

    process: subprocess.Popen[bytes]
    out: Path
    err: Path
    started: float
    own_group: bool = False

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def output(self) -> str:
        return f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"

    def signal(self, signum: int) -> float:
        """Send ``signum``; returns when it was sent (``time.monotonic``)."""
        self.process.send_signal(signum)
        return time.monotonic()

    def wait(self, timeout_s: float) -> int:
        """The exit code; the process is killed (and the test fails) past the deadline."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout_s} s:\n{self.output()}") from None

    def kill(self) -> None:
        """SIGKILL the process (a torchrun job: its whole session, launcher and ranks)."""
        with contextlib.suppress(ProcessLookupError):
            if self.own_group:
                os.killpg(self.process.pid, signal.SIGKILL)
            else:
                self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    env.update(extra or {})
    return env


def start(
    argv: Sequence[str],
    tmp: Path,
    *,
    env: dict[str, str] | None = None,
    torchrun: int | None = None,
    preexec: Callable[[], Any] | None = None,
    name: str = "run",
    torchrun_args: Sequence[str] = (),
) -> Run:
    """``python -m gradaccum ARGV`` (or ``torchrun --nproc-per-node N [TORCHRUN_ARGS] -m gradaccum
    ARGV``) in the repository root, output to files under ``tmp``."""
    if torchrun is None:
        command = [sys.executable, "-m", "gradaccum", *argv]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={torchrun}",
            *torchrun_args,
            "-m",
            "gradaccum",
            *argv,
        ]
    out, err = tmp / f"{name}.out", tmp / f"{name}.err"
    with out.open("wb") as o, err.open("wb") as e:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=o,
            stderr=e,
            env=_env(env),
            preexec_fn=preexec,
            start_new_session=torchrun is not None,
        )
    return Run(process, out, err, time.monotonic(), own_group=torchrun is not None)


@contextlib.contextmanager
def running(run: Run) -> Iterator[Run]:
    """Kill ``run`` on the way out if the test left it running (a failed assertion mid-test)."""
    try:
        yield run
    finally:
        if run.process.poll() is None:
            run.kill()


def wait_until(check: Callable[[], bool], run: Run, timeout_s: float, what: str) -> None:
    """Poll ``check`` every 10 ms until true; fail if the process exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if run.process.poll() is not None:
            raise AssertionError(f"exited ({run.process.returncode}) before {what}:\n{run.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout_s} s:\n{run.output()}")
        time.sleep(0.01)


def steps_recorded(run_dir: Path) -> int:
    """Step records in the run's ``metrics.jsonl`` (0 before it exists)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"kind": "step"' in line)


def windows_of(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "manifest.json").read_text())["windows"])


def intact(run_dir: Path) -> list[Path]:
    """The run's checkpoints whose manifest verifies (checksums included), newest first."""
    return [p for p in checkpoints_of(run_dir) if not checkpoint_problem(p)]


def leftovers(run_dir: Path) -> list[str]:
    """Temporary folders and files an interrupted save could leave behind."""
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) if folder.is_dir() else []


def model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=True)["model"]


def assert_same_model(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs"


def no_traceback(text: str) -> None:
    assert "Traceback" not in text, text
