"""Whether ``torchrun --max-restarts 2 ... --resume auto`` recovers after a worker is SIGKILLed.

Each try starts a two-process torchrun job of the slowed tiny GPT (float64), SIGKILLs rank 1's worker
once a checkpoint after 4 windows is intact, and waits for the job (at most ``--deadline`` seconds).
Printed per try: the job's exit code, the restart rounds (each restarted round prints its resume), whether a
restarted worker met gloo's "Connection refused" or ``connectFullMesh`` failure, and the seconds
from the kill to the end; then how many tries ended with exit 0 and a complete run. Uses the test
suite's subprocess helpers; run from the repository root:

    .venv/bin/python benchmarks/train_restarts.py --tries 6
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults.cli_runs import (  # after the repository root is on the path
    intact,
    start,
    train_argv,
    wait_until,
    windows_of,
)

STEPS = 16


def kill_workers(agent: int) -> None:
    """SIGKILL torchrun's workers (each in its own session: killing the agent's leaves them)."""
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def one_try(tmp: Path, deadline_s: float) -> tuple[int, int, bool, float, bool]:
    """(exit code, restart rounds, a connect error seen, seconds from the kill to the end, finished)."""
    run_dir, mark = tmp / "run", tmp / "mark"
    mark.mkdir()
    argv = [*train_argv(run_dir, STEPS, "--checkpoint-every", "2"), "--resume", "auto"]
    env = {"GRADACCUM_TEST_SLEEP": "0.05", "GRADACCUM_TEST_MARK": str(mark)}
    run = start(argv, tmp, env=env, torchrun=2, torchrun_args=["--max-restarts", "2"])
    try:
        wait_until(lambda: any(windows_of(p) >= 4 for p in intact(run_dir)), run, 180, "a checkpoint")
        os.kill(int((mark / "building-1").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = run.process.wait(timeout=deadline_s)
        except Exception:
            kill_workers(run.process.pid)
            run.kill()
            code = -999  # still running at the deadline: a hang
        took = time.monotonic() - killed
    finally:
        if run.process.poll() is None:
            run.kill()
    err = run.stderr
    rounds = run.stdout.count("resumed from ")  # each restarted round resumes
    refused = "Connection refused" in err or "connectFullMesh" in err
    finished = bool(intact(run_dir)) and windows_of(intact(run_dir)[0]) == STEPS
    return code, rounds, refused, took, finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tries", type=int, default=6)
    parser.add_argument("--deadline", type=float, default=150.0, help="seconds a job may run after the kill")
    parser.add_argument("--keep", type=Path, help="keep each try's run folder and output under this folder")
    args = parser.parse_args()
    recovered = 0
    for n in range(args.tries):
        with tempfile.TemporaryDirectory() as scratch:
            tmp = Path(scratch) if args.keep is None else args.keep / f"try{n + 1}"
            tmp.mkdir(parents=True, exist_ok=True)
            code, rounds, refused, took, finished = one_try(tmp, args.deadline)
        ok = code == 0 and finished
        recovered += ok
        print(
            f"try {n + 1}: exit {code}, {rounds} restart round(s), connect error "
            f"{'yes' if refused else 'no'}, {took:.1f} s after the kill, "
            f"{'recovered' if ok else 'NOT recovered'}",
            flush=True,
        )
    print(f"recovered: {recovered} of {args.tries}")


if __name__ == "__main__":
    main()
