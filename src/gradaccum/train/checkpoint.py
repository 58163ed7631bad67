"""Checkpoints at optimizer boundaries, written atomically and verified, for one process or many.

A checkpoint is a folder ``<run>/checkpoints/step-<windows>/`` holding

* ``state.pt`` (written by rank 0): the full (unsharded) model and optimizer state dicts, the
  GradScaler's state, the counters (windows, applied and skipped steps, consumed and seen tokens),
  the data position (the next window and the global rows drawn: the same on every layout), the
  plan and the layout it ran on (:mod:`gradaccum.train.layout`), precision, seed, workload,
  schedule and the run's earlier resumes;
* ``rng-rank<r>.pt`` (one per rank): that rank's torch CPU, CUDA and Python RNG states (a resume on
  another number of processes gives every rank rank 0's: every rank starts a run from the same
  seed);
* ``manifest.json`` (rank 0, written last): every file's size and SHA-256, hashed as it was
  written, the format and the counters.

State dicts go through ``torch.distributed.checkpoint.state_dict``: for FSDP2 the sharded
parameters and optimizer state are gathered into a full state dict on rank 0 on save, and every
rank re-shards the full state dict on load; DDP and plain modules take the same path. So a
checkpoint is not tied to the layout that wrote it: FSDP2 on N processes resumes on DDP or one
process and back, at any micro-batch, each rank taking its shard of the full state. (Every rank
reads ``state.pt``: a shared filesystem is assumed, as for the rank files.)

Atomicity: files are written into ``checkpoints/.tmp-step-<windows>/`` (each via a temporary file
and ``os.replace``); when every rank has written its part, rank 0 writes the manifest, checks the
sizes on disk against it and renames the folder into place, then points ``checkpoints/latest`` at
it. A checkpoint is intact exactly when its manifest verifies, so a crash, a full disk or an
interrupt at any moment leaves the previous checkpoints as they were and, at worst, a folder that
no resume accepts. Resuming verifies every checksum before reading a byte of state.

Nothing is ever saved mid-window: callers save at boundaries only, where no gradient is
accumulated, so the data position is always ``(window, 0)``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from gradaccum.atomic import (
    MANIFEST_FILE,
    FileDigest,
    atomic_save,
    atomic_write_text,
    check_manifest,
    is_temporary,
    write_manifest,
)
from gradaccum.distributed import dist
from gradaccum.errors import CheckpointError, CheckpointWriteError
from gradaccum.plan import BatchPlan
from gradaccum.train.data import DataPosition
from gradaccum.train.layout import Layout, check_resume, saved_layout

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "CheckpointWriteError",
    "ResumePoint",
    "TrainProgress",
    "checkpoint_dir",
    "checkpoint_problem",
    "checkpoints_of",
    "find_intact",
    "latest_checkpoint",
    "load_checkpoint",
    "remove_partial_checkpoints",
    "resolve_checkpoint",
    "run_folder_of",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = 2
STATE_FILE = "state.pt"
LATEST_FILE = "latest"
CHECKPOINTS = "checkpoints"
_TMP, _OLD = ".tmp-", ".old-"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainProgress:
    """The counters a run resumes from; all of them change only at optimizer boundaries."""

    windows: int = 0
    """Windows done (applied or skipped): the data position's window."""
    steps_applied: int = 0
    """Optimizer updates applied: the steps clock."""
    steps_skipped: int = 0
    """Windows whose update was skipped (non-finite, or no valid units)."""
    consecutive_skips: int = 0
    """Skips since the last applied update (for ``max_consecutive_skips``)."""
    tokens_consumed: int = 0
    """Valid units of applied windows (all ranks): the tokens clock."""
    tokens_seen: int = 0
    """Valid units of every window drawn, skipped ones included."""
    rows_seen: int = 0
    """Rows (examples) of the global stream drawn, every rank's together: the stream's cursor in
    global rows, the same whatever the layout (0 in checkpoints written before it was counted)."""

    @property
    def position(self) -> DataPosition:
        """Where the data stream continues: the next window, from its first micro-batch."""
        return DataPosition(window=self.windows, micro_batch=0)


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(run_dir: Path, windows: int) -> Path:
    """The folder of the checkpoint taken after ``windows`` windows."""
    return Path(run_dir) / CHECKPOINTS / f"step-{windows:08d}"


def _windows_of(folder: Path) -> int:
    try:
        return int(folder.name.removeprefix("step-"))
    except ValueError:
        return -1


def checkpoints_of(run_dir: Path) -> list[Path]:
    """Every ``checkpoints/step-*`` folder of ``run_dir``, intact or not, newest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if p.is_dir() and _windows_of(p) >= 0]
    return sorted(found, key=_windows_of, reverse=True)


def checkpoint_problem(folder: Path, *, checksums: bool = True) -> str:
    """Why ``folder`` cannot be resumed from (``""`` when it is intact): no manifest (never
    completed), a missing, truncated or altered file, or another checkpoint format."""
    manifest, problem = check_manifest(folder, checksums=checksums)
    if problem:
        return problem
    if manifest.get("format") != CHECKPOINT_FORMAT:
        return (
            f"it has checkpoint format {manifest.get('format')}; this gradaccum reads format "
            f"{CHECKPOINT_FORMAT}"
        )
    if STATE_FILE not in manifest["files"]:
        return f"its manifest does not list {STATE_FILE}"
    return ""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """The checkpoint a run continues from, and the newer ones passed over because they are broken."""

    path: Path
    """The intact checkpoint folder."""
    skipped: tuple[tuple[Path, str], ...] = ()
    """Newer checkpoint folders that are not intact, each with its problem."""


def find_intact(run_dir: Path, *, checksums: bool = True) -> ResumePoint | None:
    """The newest intact checkpoint of ``run_dir`` (None if it holds none), with the broken newer ones."""
    skipped: list[tuple[Path, str]] = []
    for folder in checkpoints_of(run_dir):
        problem = checkpoint_problem(folder, checksums=checksums)
        if not problem:
            return ResumePoint(folder, tuple(skipped))
        skipped.append((folder, problem))
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest intact checkpoint of ``run_dir``, or None.

    Intact means that its manifest verifies (sizes and checksums); ``checkpoints/latest`` names the
    newest one written, for people and tools, but is not trusted: a crash may leave it behind.
    """
    point = find_intact(run_dir)
    return point.path if point is not None else None


def run_folder_of(path: Path) -> Path:
    """The run folder that ``--resume PATH`` continues: PATH itself, or the run holding checkpoint PATH."""
    path = Path(path)
    if path.name.startswith("step-") and path.parent.name == CHECKPOINTS:
        return path.parent.parent
    if path.name == CHECKPOINTS:
        return path.parent
    return path


def _newest_hint(run_dir: Path, *, besides: Path | None = None) -> str:
    point = find_intact(run_dir)
    if point is None or point.path == besides:
        return f"No intact checkpoint is left in {run_dir}; start a new run (a new --run-dir)."
    return f"The newest intact checkpoint is {point.path}: resume with --resume {point.path}."


def resolve_checkpoint(path: Path) -> ResumePoint:
    """The intact checkpoint ``path`` names: a checkpoint folder, verified as it is; or a run folder
    (or its ``checkpoints/``), whose newest intact checkpoint is taken, passing over broken ones.

    Raises :class:`CheckpointError` naming the problem and the newest intact checkpoint beside it.
    """
    path = Path(path)
    run_dir = run_folder_of(path)
    names_one = path.name.startswith(("step-", f"{_TMP}step-")) or any(
        (path / name).exists() for name in (MANIFEST_FILE, STATE_FILE)
    )
    if names_one:
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at {path}. {_newest_hint(run_dir)}")
        problem = checkpoint_problem(path)
        if problem:
            raise CheckpointError(
                f"checkpoint {path} cannot be resumed: {problem}. {_newest_hint(run_dir, besides=path)}"
            )
        return ResumePoint(path)
    found = checkpoints_of(run_dir)
    if not found:
        raise CheckpointError(
            f"no checkpoint at {path}: expected a checkpoint folder (RUN/checkpoints/step-N) or a run "
            f"folder holding {CHECKPOINTS}/"
        )
    point = find_intact(run_dir)
    if point is None:
        problems = "; ".join(f"{p.name}: {problem}" for p, problem in _problems(found))
        raise CheckpointError(
            f"run folder {run_dir} holds no intact checkpoint ({problems}); start a new run (a new --run-dir)"
        )
    return point


def _problems(folders: Sequence[Path]) -> list[tuple[Path, str]]:
    return [(p, checkpoint_problem(p)) for p in folders]


def _describe_failure(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({exc})"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return f"a file-size limit was reached ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _remove(folder: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(folder)


def save_checkpoint(
    run_dir: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    accumulator: Any,
    progress: TrainProgress,
    plan: BatchPlan,
    meta: dict[str, Any],
    keep: int,
    device: torch.device,
    batch_schedule: dict[str, Any] | None = None,
    layout: Layout | None = None,
) -> Path:
    """Write a checkpoint of the current boundary on every rank together; returns its folder.

    Collective: every rank must call it at the same boundary. ``meta`` (workload, precision,
    schedule) is stored for the resumed run to compare against. A failure to write on any rank
    (a full disk, a file-size limit) raises :class:`CheckpointWriteError` on every rank, after
    removing the temporary folder; the previous checkpoints are untouched. Afterwards only the
    newest ``keep`` intact checkpoints remain. ``batch_schedule``: a batch-size schedule's state
    (the plan stored is the run's starting plan; the schedule's state says where it grew to).
    ``layout``: how this run is cut (recorded for the resumes on other layouts; the plan's, without
    FSDP2 or a token budget, when None).
    """
    rank = dist.rank()
    final = checkpoint_dir(run_dir, progress.windows)
    tmp = final.parent / f"{_TMP}{final.name}"
    # collective under FSDP2: gathers the shards; with cpu_offload only rank 0 keeps the result.
    # An optimizer that has not stepped yet is saved as None: torch would initialize its state
    # with a zero-lr step, and Adam's step count would then differ from an uninterrupted run's.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else None
    renamed = False
    try:
        error: BaseException | None = None
        if rank == 0:
            try:
                _remove(tmp)
                tmp.mkdir(parents=True)
            except OSError as exc:
                error = exc
        created = dist.all_gather_objects(
            None if error is None else _describe_failure(error), what="whether the checkpoint folder exists"
        )
        _raise_if_failed(final, "creating its folder", created[:1])
        digests: dict[str, FileDigest] = {}
        try:
            digests[_rng_file(rank)] = atomic_save({"rank": rank, "rng": _rng_state()}, tmp / _rng_file(rank))
            if rank == 0:
                state = {
                    "format": CHECKPOINT_FORMAT,
                    "model": model_state,
                    "optimizer": optim_state,
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "accumulator": accumulator.state_dict(),
                    "progress": asdict(progress),
                    "data_position": progress.position.to_dict(),
                    "plan": {"micro_batch": plan.micro_batch, "accum_steps": plan.accum_steps, "dp": plan.dp},
                    "layout": (layout or Layout.of(plan, max_tokens=None, fsdp=False)).to_dict(),
                    "meta": meta,
                    "batch_schedule": batch_schedule,
                }
                digests[STATE_FILE] = atomic_save(state, tmp / STATE_FILE)
        except (OSError, RuntimeError) as exc:
            error = exc
        reports = dist.all_gather_objects(
            (None if error is None else _describe_failure(error), digests),
            what="the checkpoint files written",
        )
        _raise_if_failed(final, "writing its files", [failure for failure, _ in reports])
        if rank == 0:
            try:
                files = {name: digest for _, written in reports for name, digest in written.items()}
                write_manifest(
                    tmp,
                    files,
                    format=CHECKPOINT_FORMAT,
                    windows=progress.windows,
                    steps_applied=progress.steps_applied,
                    world=dist.world_size(),
                )
                problem = checkpoint_problem(tmp, checksums=False)
                if problem:
                    raise OSError(f"the written checkpoint does not verify: {problem}")
                _install(tmp, final)
                renamed = True
                atomic_write_text(final.parent / LATEST_FILE, final.name + "\n")
                _prune(Path(run_dir), keep)
            except OSError as exc:
                error = exc
        done = dist.all_gather_objects(
            None if error is None else _describe_failure(error), what="whether the checkpoint was completed"
        )
        _raise_if_failed(final, "completing it", done[:1], installed=renamed)
        return final
    except BaseException:
        if rank == 0 and not renamed:
            _remove(tmp)  # an interrupt or failure: no half-written folder is left behind
        raise


def _install(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; a checkpoint of the same boundary already there (a resumed run
    that reached it again) is swapped aside first and dropped only once the new one is in place."""
    aside = final.parent / f"{_OLD}{final.name}"
    if final.exists():
        _remove(aside)
        os.replace(final, aside)
    os.replace(tmp, final)
    _remove(aside)


def _raise_if_failed(
    final: Path, what: str, failures: Sequence[str | None], *, installed: bool = False
) -> None:
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if not failed:
        return
    rank_text = "; ".join(f"rank {r}: {f}" for r, f in failed) if len(failures) > 1 else failed[0][1]
    run_dir = final.parent.parent
    if installed:
        kept = f"{final} itself is complete."
    else:
        point = find_intact(run_dir, checksums=False)
        kept = (
            f"The previous checkpoint {point.path} is intact."
            if point is not None
            else "No earlier checkpoint of this run exists."
        )
    raise CheckpointWriteError(
        f"checkpoint {final.name} of {run_dir} could not be written ({what}: {rank_text}). {kept}"
    )


def _prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` intact checkpoints; remove every other checkpoint folder."""
    kept = 0
    for folder in checkpoints_of(run_dir):
        if kept < keep and not checkpoint_problem(folder, checksums=False):
            kept += 1
        else:
            _remove(folder)


def remove_partial_checkpoints(run_dir: Path) -> list[Path]:
    """Remove what an interrupted save leaves in ``run_dir``: temporary checkpoint folders and files.

    A checkpoint swapped aside for a new one of the same boundary comes back if the new one never
    arrived. Returns what was removed. Safe to call when nothing is being written.
    """
    folder = Path(run_dir) / CHECKPOINTS
    removed: list[Path] = []
    if folder.is_dir():
        for aside in sorted(folder.glob(f"{_OLD}step-*")):
            final = folder / aside.name.removeprefix(_OLD)
            if final.exists():
                _remove(aside)
                removed.append(aside)
            else:
                with contextlib.suppress(OSError):
                    os.replace(aside, final)
        for tmp in sorted(folder.glob(f"{_TMP}step-*")):
            _remove(tmp)
            removed.append(tmp)
        removed.extend(_remove_temporary_files(folder, LATEST_FILE))
    for name in ("metrics.jsonl", "runcard.json"):
        removed.extend(_remove_temporary_files(Path(run_dir), name))
    return removed


def _remove_temporary_files(folder: Path, target: str) -> list[Path]:
    out = []
    if folder.is_dir():
        for path in folder.iterdir():
            if is_temporary(path.name, target) and path.is_file():
                with contextlib.suppress(OSError):
                    path.unlink()
                    out.append(path)
    return out


def load_checkpoint(
    path: Path | ResumePoint,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    accumulator: Any,
    plan: BatchPlan,
    precision: str,
    layout: Layout | None = None,
    seed: int | None = None,
    workload: str | None = None,
) -> tuple[TrainProgress, dict[str, Any]]:
    """Restore model, optimizer, scaler, the accumulator's counters and this rank's RNG; returns the
    run's counters and the meta (with ``path``, ``skipped``, the broken newer checkpoints,
    ``batch_schedule``, a batch-size schedule's state or None, ``layout``, the layout the
    checkpoint was written on, and ``moved``, whether this run's ``layout`` differs from it).

    Every file is checked against the manifest before any is read (a :class:`ResumePoint` from
    :func:`resolve_checkpoint` has been). Collective under FSDP2 (every
    rank re-shards). Another layout (processes, micro-batch, token budget, FSDP2) resumes; what
    would change the trajectory (global batch, precision, ``seed``, ``workload``) is refused by
    :func:`gradaccum.train.layout.check_resume`, showing both, before touching any state.
    """
    point = path if isinstance(path, ResumePoint) else resolve_checkpoint(path)
    folder = point.path
    try:
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # the checksum matched, so this is not damage on disk
        raise CheckpointError(
            f"checkpoint {folder}: {STATE_FILE} matches its checksum but cannot be read by this torch "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {folder} has format {state.get('format')}; this gradaccum reads format "
            f"{CHECKPOINT_FORMAT}"
        )
    layout = layout or Layout.of(plan, max_tokens=None, fsdp=False)
    moved = check_resume(
        folder, state, plan=plan, layout=layout, precision=precision, seed=seed, workload=workload
    )
    written_on = saved_layout(state)
    # one's own RNG on the layout that wrote it; else rank 0's (every rank starts from one seed)
    rng_path = folder / _rng_file(dist.rank() if written_on["world"] == dist.world_size() else 0)
    if not rng_path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no RNG state {rng_path.name}: it is incomplete")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    if state["optimizer"] is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=True)["rng"])
    progress = TrainProgress(**state["progress"])
    accumulator.load_state_dict(state["accumulator"])
    skipped = [f"{p}: {problem}" for p, problem in point.skipped]
    return progress, {
        **state["meta"],
        "path": str(folder),
        "skipped": skipped,
        "batch_schedule": state.get("batch_schedule"),
        "layout": written_on,
        "moved": moved,
    }
