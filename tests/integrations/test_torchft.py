"""``FaultTolerantAccumulator`` for real: a torchft lighthouse and two replica groups on 127.0.0.1.

Each group is its own process (tests/integrations/torchft_worker.py, torchft's environment
``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID``), a float64 MLP with SGD + momentum, global batches
of 12 rows with about a quarter masked out (so the groups' shares count unevenly), micro-batch 2.
The reference is one process taking each whole global batch (summed loss / its count, one step).

(a) the page's example, docs/examples/torchft_accumulate.py, under two ``torchrun --standalone
    --nproc-per-node 1`` (its own model and data of the same kind; it checks itself against its
    one-process reference and prints the distance); both groups throughout: each step's shares are
    6 + 6 rows, each group's gradient its share's part of grad(sum l) / N, summed over the two.
    Tolerance 1e-10: the float64 sums are regrouped (two shares and micro-batches of 2 rows instead
    of one batch of 12), each regrouping rounding by a few ulps (~1e-16) per step; over 6 steps of
    momentum SGD on an O(1) model that stays ~1e-15.
(b) group 1 is SIGKILLed in the middle of step 4 (its first collective done, its gradient sum not)
    and started again later with exactly its first command: group 0's gradient sum fails, so it tries
    step 4 again over the new quorum, keeping its own rows 0-5 and computing only the lost rows
    6-11 (3 micro-batches, not 6), trains alone, and group 1 heals from it
    (no file read) and both finish together. Tolerance 1e-9: the same regrouping over 12 steps, a
    ~1e-15 difference; 1e-9 is the bound the run must meet. The test steers only the timing (where
    the victim hangs, when the survivor waits) through a control file the worker reads.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.integrations import torchft_worker as worker

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="torchft is not installed (pip install gradaccum[torchft])",
)

WORKER = Path(worker.__file__).resolve()
ROOT = WORKER.parents[2]
DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lighthouse_binary() -> str:
    here = Path(sys.executable).parent / "torchft_lighthouse"
    return str(here) if here.exists() else "torchft_lighthouse"


class Job:
    """A lighthouse and its replica groups; every process it started is killed and reaped at exit."""

    def __init__(self, tmp: Path, min_replicas: int) -> None:
        self.tmp, self.procs = tmp, list[subprocess.Popen[str]]()
        self.port = _free_port()
        command = [
            _lighthouse_binary(), "--bind", f"127.0.0.1:{self.port}", "--min_replicas", str(min_replicas),
            "--join_timeout_ms", "1000", "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000",
        ]  # fmt: skip
        self._start(command, tmp / "lighthouse.log", dict(os.environ))

    def _start(self, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
        out = log.open("a")
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        out.close()
        self.procs.append(proc)
        return proc

    def group(self, group: int, steps: int) -> subprocess.Popen[str]:
        """Start the worker as replica group ``group``: the same command each time it is started."""
        return self.start(group, [sys.executable, str(WORKER), str(self.tmp), str(steps)])

    def start(self, group: int, command: list[str]) -> subprocess.Popen[str]:
        """Run ``command`` as replica group ``group``, with torchft's environment."""
        env = dict(os.environ)
        src = str(ROOT / "src")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, str(ROOT), env.get("PYTHONPATH")) if p)
        env |= {
            "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{self.port}",
            "REPLICA_GROUP_ID": str(group),
            "NUM_REPLICA_GROUPS": "2",
        }
        with self.log(group).open("a") as log:
            log.write("start\n")  # where each start's lines begin
        return self._start(command, self.log(group), env)

    def log(self, group: int) -> Path:
        return self.tmp / f"group{group}.log"

    def lines(self, group: int) -> list[str]:
        path = self.log(group)
        text = path.read_text(errors="replace") if path.exists() else ""
        marks = ("start", "step ", "stalled", "done", "TORCHFT READY")
        return [line for line in text.splitlines() if line.startswith(marks)]

    def wait_for(self, group: int, pattern: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not any(re.fullmatch(pattern, line) for line in self.lines(group)):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"group {group} never printed {pattern!r}:\n{self.log(group).read_text()[-3000:]}"
                )
            time.sleep(0.05)

    def wait_for_text(self, group: int, text: str) -> None:
        """Wait until the log of the group's last start holds ``text`` (torchft's own log lines)."""
        deadline = time.monotonic() + DEADLINE_S
        while text not in self.log(group).read_text(errors="replace").rsplit("\nstart\n", 1)[-1]:
            if time.monotonic() > deadline:
                raise AssertionError(f"group {group} never logged {text!r}")
            time.sleep(0.02)

    def finish(self, proc: subprocess.Popen[str], group: int) -> int:
        try:
            return proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"group {group} did not finish:\n{self.log(group).read_text()[-3000:]}"
            ) from None

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def job_factory(tmp_path: Path) -> Iterator[list[Job]]:
    jobs: list[Job] = []
    yield jobs
    for job in jobs:
        job.close()


def _max_diff(path: Path, steps: int) -> float:
    """Max abs parameter difference from the one-process reference (printed: ``pytest -s``)."""
    got = torch.load(path)
    want = worker.reference(steps)
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    print(f"{path.stem} after {steps} steps: max |param - reference| = {diff:.1e}")
    return diff


def _participants(lines: list[str]) -> list[int]:
    return [int(line.split()[3]) for line in lines if line.startswith("step ")]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_pages_example_under_two_torchruns_takes_the_whole_global_batch_exactly(
    tmp_path: Path, job_factory: list[Job]
) -> None:
    """docs/examples/torchft_accumulate.py as docs/elastic-torchft.md launches it (it checks itself)."""
    page = (ROOT / "docs" / "elastic-torchft.md").read_text(encoding="utf-8")
    assert "BEGIN generated: include examples/torchft_accumulate.py " in page
    job = Job(tmp_path, min_replicas=2)  # the first step waits for both groups
    job_factory.append(job)
    script = ROOT / "docs" / "examples" / "torchft_accumulate.py"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    procs = [job.start(g, [*launch, str(script)]) for g in (0, 1)]
    assert [job.finish(p, g) for g, p in enumerate(procs)] == [0, 0]
    shown = {  # each step's 12 rows cut 6 + 6; "k of N": the unmasked rows here, of the whole batch
        0: ["5 of 7", "5 of 10", "3 of 6", "4 of 9", "4 of 8", "5 of 10"],
        1: ["2 of 7", "5 of 10", "3 of 6", "5 of 9", "4 of 8", "5 of 10"],
    }
    for g in (0, 1):
        lines = [line for line in job.log(g).read_text().splitlines() if line.startswith(f"group {g}")]
        steps = [f"group {g} step {s + 1}: 2 groups, {rows} rows here" for s, rows in enumerate(shown[g])]
        assert lines[:-1] == steps
        print(lines[-1])
        head, diff = lines[-1].rsplit("= ", 1)
        assert head == f"group {g}: max |param - one-process reference| " and float(diff) <= 1e-10


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_killed_mid_step_and_restarted_heals_from_its_peer_on_the_reference(
    tmp_path: Path, job_factory: list[Job]
) -> None:
    steps = 12
    job = Job(tmp_path, min_replicas=1)
    job_factory.append(job)
    (tmp_path / "control-group1").write_text("stall 4")  # hang in step 4, after its count
    (tmp_path / "control-group0").write_text("hold 8")  # and the survivor waits after step 8
    first, victim = job.group(0, steps), job.group(1, steps)
    job.wait_for(1, r"stalled in step 4")
    victim.send_signal(signal.SIGKILL)  # mid-step: its share of step 4 is lost
    victim.wait(timeout=30)
    job.wait_for(0, r"step 8 .*")
    (tmp_path / "control-group1").unlink()
    returned = job.group(1, steps)  # exactly its first command
    job.wait_for(1, r"TORCHFT READY")
    job.wait_for_text(1, "Start quorum")  # its first quorum request is in
    # the survivor's next request meets it: a quorum of both (the lighthouse waits 1 s for a
    # heartbeating group; a survivor held longer would let the returned group form a quorum alone)
    (tmp_path / "control-group0").unlink()
    assert job.finish(first, 0) == 0 and job.finish(returned, 1) == 0
    survivor, back = job.lines(0), job.lines(1)
    assert survivor[-1] == "done" and back[-1] == "done"
    # step 4 broke under the survivor (the victim died before the gradient sum), so it was done
    # again over the new quorum, the whole batch its own; it trained alone until the return
    # and it kept what it had done of step 4 (rows 0-5), recomputing only the lost rows 6-11
    step4 = next(line for line in survivor if line.startswith("step 4 "))
    assert step4.startswith("step 4 participants 1 attempts 2 ") and step4.endswith(" micro-batches 3")
    assert _participants(survivor)[4:8] == [1] * 4 and _participants(survivor)[-1] == 2
    restarted = back[len(back) - back[::-1].index("start") :]
    first_back = int(restarted[1].split()[1])  # the restarted run's first step
    assert first_back > 8  # it healed from the peer's step, not from step 0 or from disk
    assert _max_diff(tmp_path / "group0.pt", steps) <= 1e-9
    assert _max_diff(tmp_path / "group1.pt", steps) <= 1e-9
