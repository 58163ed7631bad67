"""The run folder before a run starts: a fresh run refuses a folder that holds another run's records
or checkpoints, and a resumed run continues its own folder from its newest intact checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from gradaccum.train.checkpoint import (
    ResumePoint,
    checkpoint_problem,
    checkpoints_of,
    resolve_checkpoint,
    run_folder_of,
)
from gradaccum.train.config import TrainConfig, TrainError
from gradaccum.train.records import METRICS_FILE

__all__ = ["RUNCARD_FILE", "check_run_folder", "run_files", "same_path"]

RUNCARD_FILE = "runcard.json"
"""The run card a run writes into its folder."""

_RUN_FILES = (RUNCARD_FILE, METRICS_FILE)


def run_files(run_dir: Path) -> list[str]:
    """What of a run ``run_dir`` already holds (its records, any checkpoint folder)."""
    found = [name for name in _RUN_FILES if (run_dir / name).exists()]
    if checkpoints_of(run_dir):
        found.append("checkpoints/")
    return found


def check_run_folder(config: TrainConfig) -> ResumePoint | None:
    """Refuse to write over another run's files; the verified checkpoint to resume from, if any.

    A fresh run needs a folder without records or checkpoints. A resumed run continues its own
    folder, from its newest intact checkpoint (resuming an older one while a newer intact one
    exists would fork the run and leave two histories in one folder), or starts a new folder.
    """
    run_dir = Path(config.run_dir)
    if config.resume is None:
        found = run_files(run_dir)
        if found:
            raise TrainError(
                f"run folder {run_dir} already holds another run ({', '.join(found)}); continue it with "
                f"--resume auto --run-dir {run_dir}, or train into a new folder (another --run-dir)"
            )
        return None
    point = resolve_checkpoint(config.resume)
    source = run_folder_of(point.path)
    if same_path(source, run_dir):
        passed_over = {folder for folder, _ in point.skipped}
        folders = checkpoints_of(run_dir)
        newer = folders[: folders.index(point.path)] if point.path in folders else []
        newest = next((f for f in newer if f not in passed_over and not checkpoint_problem(f)), None)
        if newest is not None:
            raise TrainError(
                f"run folder {run_dir} holds a newer intact checkpoint ({newest.name}) than "
                f"{point.path.name}: resuming the older one would give the run two histories. Resume "
                f"{newest} (--resume auto), or resume {point.path.name} into a new folder (another "
                "--run-dir)"
            )
    else:
        found = run_files(run_dir)
        if found:
            raise TrainError(
                f"run folder {run_dir} already holds another run ({', '.join(found)}); resume "
                f"{point.path} into its own run folder {source} or into a new one (another --run-dir)"
            )
    return point


def same_path(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
