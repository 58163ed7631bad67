"""Fresh worker processes: a record comes back for bad input, a run past its time, a failed rank.

These start real ``python -m gradaccum.bench.worker`` processes (about a second each to import
torch); successful runs through them are tested by tests/cli/test_bench_cli.py and
test_accept_cli.py. The test workloads are imported by the workers from the repository root.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gradaccum.bench.runner import run_isolated
from gradaccum.bench.spec import MeasureSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _at_repository_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # python -m puts the working directory on the workers' sys.path


def test_a_bad_workload_is_a_failed_record_not_an_exception() -> None:
    spec = MeasureSpec(workload="gradaccum.examples:no_such_workload", micro_batch=1, accum_steps=1)
    record = run_isolated(spec, timeout_s=120)
    assert record.status == "failed" and record.measurement is None
    assert "no callable 'no_such_workload'" in (record.error or "")


def test_a_run_past_its_time_is_killed_and_marked() -> None:
    spec = MeasureSpec(workload="gradaccum.examples:tiny_gpt", micro_batch=1, accum_steps=1)
    start = time.monotonic()
    record = run_isolated(spec, timeout_s=0.3)  # less than it takes to import torch
    assert record.status == "timeout" and "0.3 s" in (record.error or "")
    assert time.monotonic() - start < 30


def test_a_failed_rank_stops_the_others_instead_of_leaving_them_waiting() -> None:
    spec = MeasureSpec(
        workload="tests.bench.workloads:rank1_fails", micro_batch=1, accum_steps=1, dp=2, threads=1
    )
    start = time.monotonic()
    record = run_isolated(spec, timeout_s=120)
    # rank 0 would wait in a collective until the 120 s group timeout; it is killed instead
    assert time.monotonic() - start < 60
    assert record.status == "failed"
    assert "rank 1 cannot build its model" in (record.error or "")


def test_the_rank_that_failed_speaks_for_the_group_not_the_peer_its_death_broke() -> None:
    from gradaccum.bench.runner import STOPPED, _first_problem
    from gradaccum.bench.spec import RunRecord

    spec = MeasureSpec(workload="tests.bench.workloads:rank1_fails", micro_batch=1, accum_steps=1, dp=3)
    broken = RunRecord(
        spec=spec,
        status="failed",
        error="RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:9395. This is typically "
        "caused by a remote worker crashing.",
    )
    stopped = RunRecord(spec=spec, status="failed", error=STOPPED)
    cause = RunRecord(spec=spec, status="failed", error="RuntimeError: rank 1 cannot build its model")
    # whichever rank exits first, the cause is chosen
    assert _first_problem([broken, cause, stopped]) is cause
    assert _first_problem([stopped, broken, cause]) is cause
    assert _first_problem([broken, stopped]) is broken  # no cause reported: still a failed record
