"""A disk that fills up while a checkpoint is written, made real with a file-size limit
(``RLIMIT_FSIZE``, what ``ulimit -f`` sets) in a ``gradaccum train`` subprocess: the write fails
with EFBIG exactly as it fails with ENOSPC on a full disk. The run exits 1 with a message naming
the checkpoint, the cause and the intact previous checkpoint; nothing half-written is left; the
metrics stay readable; resuming (with room again) ends bit for bit where an uninterrupted run ends.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import pytest

from gradaccum.cli.main import main
from gradaccum.train.records import read_metrics
from tests.faults.cli_runs import (
    WORKLOAD,
    assert_same_model,
    intact,
    leftovers,
    model_state,
    no_traceback,
    running,
    start,
    train_argv,
)

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX"),
]

# state.pt of the tiny GPT in float64 with AdamW's moments is ~0.8 MB; records, the run card, the
# loss curve and Python's own files are far smaller than 300 KB
LIMIT_BYTES = 300_000


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, LIMIT_BYTES))


def _argv(run_dir: Path, steps: int) -> list[str]:
    return train_argv(run_dir, steps, "--warmup", "1", "--horizon", "100", "--checkpoint-every", "2")


def test_a_checkpoint_that_does_not_fit_fails_clearly_and_keeps_the_previous_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    assert main(_argv(run_dir, 3)) == 0  # checkpoints after 2 and 3 windows
    (previous,) = intact(run_dir)[:1]
    assert previous.name == "step-00000003"

    with running(start([*_argv(run_dir, 6), "--resume", "auto"], tmp_path, preexec=_limit_file_size)) as run:
        assert run.wait(120) == 1, run.output()
    no_traceback(run.output())
    err = " ".join(run.stderr.split())
    assert (
        f"checkpoint step-00000005 of {run_dir} could not be written (writing its files: a file-size "
        "limit was reached ([Errno 27] File too large" in err
    ), err
    assert f"The previous checkpoint {previous} is intact." in err
    assert f"resume with: gradaccum train --workload {WORKLOAD}" in err and "--resume auto" in err
    assert [p.name for p in intact(run_dir)] == ["step-00000003", "step-00000002"]
    assert leftovers(run_dir) == [], "no temporary folder or file is left behind"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    windows = [r["window"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]
    assert windows == [0, 1, 2, 3, 4], "windows 3 and 4 trained before the failed checkpoint"

    capsys.readouterr()
    assert main([*_argv(run_dir, 6), "--resume", "auto"]) == 0
    assert f"resumed from {previous} at boundary 3" in capsys.readouterr().out
    reference = tmp_path / "reference"
    assert main(_argv(reference, 6)) == 0
    assert_same_model(model_state(intact(run_dir)[0]), model_state(intact(reference)[0]))
    windows = [r["window"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "step"]
    assert windows == list(range(6)), "each window recorded once: the failed segment's lines were replaced"
    assert json.loads((intact(run_dir)[0] / "manifest.json").read_text())["windows"] == 6
