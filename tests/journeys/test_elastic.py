"""Journey: a run stopped on one layout goes on on another (docs/elastic.md, "Resume on another layout").

The user trains 4 steps at micro-batch 6, then continues to 8 at micro-batch 2 (a smaller one after
an out-of-memory error, say): the same global batch, so the run resumes, and the start banner says
from where and on what. Another global batch is refused, naming the flag that resumes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradaccum.cli.main import main

FLAGS = ["train", "--precision", "float64", "--global-batch", "12", "--seed", "3", "--schedule", "constant"]
FLAGS += ["--warmup", "1", "--checkpoint-every", "2", "--threads", "1"]


def test_a_smaller_micro_batch_resumes_the_run_and_the_banner_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main([*FLAGS, "--micro-batch", "6", "--steps", "4", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert (
        main([*FLAGS, "--micro-batch", "2", "--steps", "8", "--run-dir", str(run), "--resume", "auto"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(f"resumed from {run}/checkpoints/step-00000004 at boundary 4")
    assert lines[start + 1] == (
        "resumed on another layout: written on 1 process (no wrapper), micro-batch 6 x 2 accumulation "
        "steps; now 1 process (no wrapper), micro-batch 2 x 6 accumulation steps; the same global batch, "
        "so the same trajectory"
    )
    assert lines[0] == (
        "batch equation: global_batch = micro_batch 2 x dp 1 x accum_steps 6 = 12 "
        "(checked against --global-batch 12)"
    )
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == [
        f"step {n}" for n in range(5, 9)
    ]


def test_another_global_batch_is_refused_naming_what_would_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main([*FLAGS, "--micro-batch", "6", "--steps", "2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    flags = [*FLAGS, "--micro-batch", "6", "--steps", "4", "--run-dir", str(run), "--resume", "auto"]
    flags[flags.index("--global-batch") + 1] = "24"
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert "with global batch 12 (global_batch = micro_batch 6 x dp 1 x accum_steps 2 = 12)" in err
    assert "Resuming would change the data and the size of every update from here on." in err
    assert "Resume with --global-batch 12 (any --micro-batch, --max-tokens or number of processes)" in err
