"""Checkpoints that cannot fool a resume, and runs that never overwrite each other (``gradaccum train``).

* every checkpoint holds a manifest, written last, with each file's size and SHA-256;
* ``--resume PATH`` on a partial, truncated or corrupted checkpoint exits 2 naming the problem and
  the newest intact checkpoint beside it, before anything is written;
* ``--resume auto`` takes the newest intact checkpoint of ``--run-dir`` (saying which it passed
  over), or starts a fresh run there when it holds none;
* a fresh run refuses a folder that holds another run, and a resume refuses to fork a run;
* periodic checkpoints count applied updates or minutes, whichever comes first; the newest
  ``--keep-checkpoints`` intact ones are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum.check.workload import Workload
from gradaccum.cli.main import main
from gradaccum.examples import tiny_gpt
from gradaccum.train import CheckpointRecord, TrainEvent, checkpoint_problem, train
from tests.train.common import config, gpt

BATCH = ["--global-batch", "8", "--micro-batch", "4", "--checkpoint-every", "1"]
QUICK = ["--steps", "3", *BATCH]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and its hash: what must not change when a command is refused."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A finished 3-window run with checkpoints after windows 1, 2 and 3."""
    folder = tmp_path / "run"
    assert main(["train", *QUICK, "--run-dir", str(folder)]) == 0
    capsys.readouterr()
    return folder


def test_a_checkpoint_lists_its_files_with_sizes_and_checksums(run_dir: Path) -> None:
    newest = run_dir / "checkpoints" / "step-00000003"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert (manifest["format"], manifest["windows"], manifest["steps_applied"], manifest["world"]) == (
        2,
        3,
        3,
        1,
    )
    assert sorted(manifest["files"]) == ["rng-rank00000.pt", "state.pt"]
    for name, entry in manifest["files"].items():
        data = (newest / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint_problem(newest) == ""


def _truncate(folder: Path) -> None:
    state = folder / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])


def _corrupt(folder: Path) -> None:
    state = folder / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, another checksum
    state.write_bytes(bytes(data))


def _partial(folder: Path) -> None:
    (folder / "manifest.json").unlink()  # the manifest is written last: a save that never finished


BREAKS = {
    "partial": (_partial, "it has no manifest.json (written last, so the checkpoint was never completed)"),
    "truncated": (_truncate, "state.pt holds 1,000 bytes, the manifest says"),
    "corrupt": (_corrupt, "state.pt does not match its checksum in the manifest (corrupted on disk)"),
}


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_resume_from_a_broken_checkpoint_exits_2_naming_the_problem_and_the_intact_one(
    kind: str, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    breaks, problem = BREAKS[kind]
    newest = run_dir / "checkpoints" / "step-00000003"
    breaks(newest)
    before = _tree(run_dir)
    code, text = _run(["train", *QUICK, "--resume", str(newest)], capsys)
    assert code == 2, text
    assert f"checkpoint {newest} cannot be resumed: {problem}" in text
    earlier = run_dir / "checkpoints" / "step-00000002"
    assert f"The newest intact checkpoint is {earlier}: resume with --resume {earlier}." in text
    assert "Traceback" not in text
    assert _tree(run_dir) == before, "a refused resume writes nothing, the metrics included"


def test_resume_auto_passes_over_a_broken_newest_checkpoint_and_says_so(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _corrupt(run_dir / "checkpoints" / "step-00000003")
    code, text = _run(
        ["train", *BATCH, "--steps", "4", "--run-dir", str(run_dir), "--resume", "auto"], capsys
    )
    assert code == 0, text
    assert (
        "note: passed over a checkpoint that is not intact:" in text
        and "step-00000003: state.pt does not match" in text
    )
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000002'} at boundary 2" in text
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert names == ["step-00000002", "step-00000003", "step-00000004"], "the broken one was rewritten"
    assert checkpoint_problem(run_dir / "checkpoints" / "step-00000003") == ""


def test_resume_auto_in_a_new_folder_starts_a_fresh_run_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "requeued"
    code, text = _run(["train", *QUICK, "--run-dir", str(folder), "--resume", "latest"], capsys)
    assert code == 0, text
    assert f"--resume latest: {folder} holds no checkpoint yet; starting a new run there" in text
    code, text = _run(["train", *BATCH, "--steps", "4", "--run-dir", str(folder), "--resume", "auto"], capsys)
    assert code == 0 and "at boundary 3" in text, text


def test_resume_auto_without_a_run_folder_takes_the_newest_run_under_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, text = _run(["train", *QUICK, "--resume", "auto"], capsys)
    assert code == 2 and "found no run folder with an intact checkpoint under runs/" in text, text
    assert not (tmp_path / "runs").exists()
    assert main(["train", *QUICK]) == 0
    (first,) = (tmp_path / "runs").iterdir()
    capsys.readouterr()
    code, text = _run(["train", *BATCH, "--steps", "4", "--resume", "auto"], capsys)
    assert (
        code == 0 and f"resumed from {Path('runs') / first.name / 'checkpoints' / 'step-00000003'}" in text
    ), text


def test_a_fresh_run_refuses_a_folder_holding_another_run_and_changes_nothing(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(run_dir)
    code, text = _run(["train", *QUICK, "--run-dir", str(run_dir)], capsys)
    assert code == 2, text
    assert (
        f"run folder {run_dir} already holds another run (runcard.json, metrics.jsonl, checkpoints/)" in text
    )
    assert f"continue it with --resume auto --run-dir {run_dir}" in text
    assert _tree(run_dir) == before


def test_a_run_that_crashed_before_its_first_checkpoint_is_not_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"kind": "step", "window": 0}\n')
    code, text = _run(["train", *QUICK, "--run-dir", str(folder)], capsys)
    assert code == 2 and "already holds another run (metrics.jsonl)" in text, text
    assert (folder / "metrics.jsonl").read_text() == '{"kind": "step", "window": 0}\n'


def test_two_default_run_folders_started_in_the_same_second_are_different(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "train-20250101-000000")
    assert main(["train", *QUICK]) == 0
    assert main(["train", *QUICK]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "train-20250101-000000",
        "train-20250101-000000-2",
    ]


def test_resuming_an_older_checkpoint_into_its_own_run_is_refused(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    older = run_dir / "checkpoints" / "step-00000002"
    code, text = _run(["train", *BATCH, "--steps", "4", "--resume", str(older)], capsys)
    assert code == 2, text
    assert "holds a newer intact checkpoint (step-00000003) than step-00000002" in text
    code, text = _run(
        [
            "train",
            *BATCH,
            "--steps",
            "4",
            "--resume",
            str(older),
            "--run-dir",
            str(run_dir.parent / "fork"),
        ],
        capsys,
    )
    assert code == 0, text


def test_a_partial_checkpoint_folder_is_cleaned_up_by_the_next_resume(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = run_dir / "checkpoints" / ".tmp-step-00000004"
    tmp.mkdir()
    (tmp / "state.pt").write_bytes(b"half")
    (run_dir / "checkpoints" / ".latest.abc123").write_text("step-0")
    code, text = _run(
        ["train", *BATCH, "--steps", "4", "--run-dir", str(run_dir), "--resume", "auto"], capsys
    )
    assert code == 0, text
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")) == []


# -- the cadence and retention (library entry point) ---------------------------------------------


def _reasons(events: list[TrainEvent]) -> list[tuple[int, str]]:
    return [(e.window, e.reason) for e in events if isinstance(e, CheckpointRecord)]


def _skips_window(workload: Workload, window: int, accum: int) -> Workload:
    calls = [0]
    inner = workload.loss_fn

    def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        w = calls[0] // accum
        calls[0] += 1
        loss = inner(model, micro_batch)
        return loss * float("inf") if w == window else loss

    return dataclasses.replace(workload, loss_fn=loss_fn)


def test_periodic_checkpoints_count_applied_updates_not_skipped_windows(tmp_path: Path) -> None:
    events: list[TrainEvent] = []
    workload = _skips_window(gpt(), 1, accum=4)  # window 1 is non-finite: skipped on every rank
    result = train(
        config(tmp_path, steps=5, checkpoint_every=2, keep_checkpoints=9),
        workload=workload,
        on_event=events.append,
    )
    assert result.progress.steps_skipped == 1
    # applied updates after windows 1..5: 1, 1, 2, 3, 4 -> periodic at windows 3 and 5 (final)
    assert _reasons(events) == [(3, "periodic"), (5, "final")]


def test_timed_checkpoints_come_when_the_minutes_pass(tmp_path: Path) -> None:
    slow = gpt()
    inner = slow.loss_fn

    def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
        time.sleep(0.02)
        return inner(model, micro_batch)

    events: list[TrainEvent] = []
    cfg = config(tmp_path, steps=4, checkpoint_every=None, checkpoint_minutes=0.05 / 60, keep_checkpoints=9)
    train(cfg, workload=dataclasses.replace(slow, loss_fn=loss_fn), on_event=events.append)
    # each window sleeps 4 x 20 ms > 50 ms: every boundary is due
    assert _reasons(events) == [(1, "timed"), (2, "timed"), (3, "timed"), (4, "final")]


def test_defaults_checkpoint_every_100_updates_or_30_minutes_and_keep_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, text = _run(["train", "--steps", "2", "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 0, text
    assert (
        "checkpoints: every 100 applied updates or every 30 minutes, whichever comes first, and at the end "
        "(and on SIGUSR1, SIGINT or SIGTERM); the newest 3 kept in" in text
    )
    code, text = _run(
        [
            "train",
            "--steps",
            "2",
            "--checkpoint-every",
            "0",
            "--checkpoint-minutes",
            "0",
            "--run-dir",
            str(tmp_path / "b"),
        ],
        capsys,
    )
    assert code == 0 and "checkpoints: at the end only" in text, text


def test_only_the_newest_intact_checkpoints_are_kept(tmp_path: Path) -> None:
    train(config(tmp_path, steps=3, checkpoint_every=1, keep_checkpoints=2))
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-00000002",
        "step-00000003",
    ]
    # a broken newest one does not count towards the kept ones, and is removed at the next save
    (tmp_path / "checkpoints" / "step-00000003" / "manifest.json").unlink()
    train(
        config(tmp_path, steps=4, checkpoint_every=1, keep_checkpoints=2, resume=tmp_path),
        workload=tiny_gpt(),
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == [
        "step-00000003",
        "step-00000004",
    ]
    for folder in (tmp_path / "checkpoints").glob("step-*"):
        assert checkpoint_problem(folder) == ""
