"""Under torchrun every rank runs the same command: an error every rank raises alike is printed once,
by rank 0, and every rank still exits with its code. Errors rank 0 may not have printed (a failed
collective, a failure of rank 0 itself, an error of this process alone) are printed where they
happen."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gradaccum.cli import once
from gradaccum.cli.main import _report
from gradaccum.errors import CollectiveError, RankFailedError, RankFailure, WorkloadError
from tests.faults.cli_runs import running, start

REFUSED = (["verify", "--workload", "no_such_module_xyz:build"], "cannot import workload module")
BAD_FLAG = (["verify", "--no-such-flag"], "unrecognized arguments: --no-such-flag")


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("argv", "message", "monitor_s"),
    [(*REFUSED, 5), (*BAD_FLAG, 5), (*REFUSED, None)],
    ids=["refused-input", "bad-flag", "refused-input-default-monitor"],
)
def test_an_error_every_rank_raises_is_printed_once_under_torchrun(
    tmp_path: Path, argv: list[str], message: str, monitor_s: int | None
) -> None:
    # torchrun stops the other workers as soon as one exits with an error: checking every 5 s lets
    # every rank that would print do so (each printed its own copy before); at the default interval
    # rank 0 must still get its message out before a silent rank's exit stops it
    extra = [f"--monitor-interval={monitor_s}"] if monitor_s is not None else []
    with running(start(argv, tmp_path, torchrun=2, torchrun_args=extra)) as run:
        code = run.wait(150)
    assert code != 0, run.output()
    assert run.stderr.count(message) == 1, run.output()  # before: once per rank
    assert run.stderr.count(": error:") == 1, run.output()


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], None]]:
    """A two-rank torchrun job's environment around a store this process serves; ``job(rank)``
    makes this process that rank."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, value in {
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-once")
    monkeypatch.setattr(once, "WAIT_S", 0.5)  # how long rank 1 waits for a message that never comes
    yield lambda rank: monkeypatch.setenv("RANK", str(rank))
    del store


def _printed(capsys: pytest.CaptureFixture[str], exc: Exception) -> tuple[int, str]:
    code = _report(argparse.Namespace(command="train"), exc)
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


def test_rank_one_leaves_rank_zeros_message_to_rank_zero_and_keeps_its_exit_code(
    job: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    job(0)
    refused = WorkloadError("no such workload")
    assert _printed(capsys, refused) == (2, "gradaccum train: error: no such workload\n")
    job(1)
    assert _printed(capsys, refused) == (2, "")  # rank 0 said it
    code, err = _printed(capsys, WorkloadError("another text"))
    assert code == 2 and "another text" in err  # not what rank 0 said: printed
    code, err = _printed(capsys, CollectiveError("all_reduce failed: another rank stopped taking part"))
    assert code == 1 and "gradaccum train: failed: all_reduce failed" in err  # rank 0 may be the lost one
    code, err = _printed(capsys, OSError(28, "No space left on device", "/runs/x"))
    assert code == 1 and "No space left on device (/runs/x)" in err  # this rank's own disk


def test_rank_one_prints_an_agreed_error_that_rank_zero_never_said(
    job: Callable[[int], None], capsys: pytest.CaptureFixture[str]
) -> None:
    job(1)
    failure = RankFailure(0, "backward", 1, "RuntimeError", "boom", False)
    code, err = _printed(capsys, RankFailedError("rank 0 failed in backward", [failure]))
    assert code == 1 and "gradaccum train: failed: rank 0 failed in backward" in err
