"""Checkpoints at optimizer boundaries, written atomically, for one process or many.

A checkpoint is a folder ``<run>/checkpoints/step-<windows>/`` holding

* ``state.pt`` (written by rank 0): the full (unsharded) model and optimizer state dicts, the
  GradScaler's state, the counters (windows, applied and skipped steps, consumed and seen tokens),
  the data position, the plan, precision, workload and schedule;
* ``rng-rank<r>.pt`` (one per rank): that rank's torch CPU, CUDA and Python RNG states.

State dicts go through ``torch.distributed.checkpoint.state_dict``: for FSDP2 the sharded
parameters and optimizer state are gathered into a full state dict on rank 0 on save, and every
rank re-shards the full state dict on load; DDP and plain modules take the same path. (Every rank
reads ``state.pt``: a shared filesystem is assumed, as for the rank files.)

Atomicity: files are written to a temporary folder (each via a temporary file and ``os.replace``),
and only when every rank has written its part does rank 0 rename the folder into place and then
point ``checkpoints/latest`` at it. A crash at any moment leaves either the previous checkpoint or
the new one, never half of one. Nothing is ever saved mid-window: callers save at boundaries only,
where no gradient is accumulated, so the data position is always ``(window, 0)``.
"""

from __future__ import annotations

import os
import random
import shutil
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

from gradaccum.atomic import atomic_save, atomic_write_text
from gradaccum.distributed import dist
from gradaccum.errors import CheckpointError
from gradaccum.plan import BatchPlan
from gradaccum.train.data import DataPosition

__all__ = [
    "CHECKPOINT_FORMAT",
    "CheckpointError",
    "TrainProgress",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
]

CHECKPOINT_FORMAT = 1
STATE_FILE = "state.pt"
LATEST_FILE = "latest"


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

    @property
    def position(self) -> DataPosition:
        """Where the data stream continues: the next window, from its first micro-batch."""
        return DataPosition(window=self.windows, micro_batch=0)


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def _barrier(device: torch.device, failed: bool = False) -> int:
    """Wait for every rank; returns how many ranks reported ``failed`` (so all can raise together)."""
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    return int(dist.all_reduce_sum_(flag).item())


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
    return Path(run_dir) / "checkpoints" / f"step-{windows:08d}"


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
) -> Path:
    """Write a checkpoint of the current boundary on every rank together; returns its folder.

    Collective: every rank must call it at the same boundary. ``meta`` (workload, precision,
    schedule) is stored for the resumed run to compare against.
    """
    rank = dist.rank()
    final = checkpoint_dir(run_dir, progress.windows)
    tmp = final.parent / f".tmp-{final.name}"
    # collective under FSDP2: gathers the shards; with cpu_offload only rank 0 keeps the result.
    # An optimizer that has not stepped yet is saved as None: torch would initialize its state
    # with a zero-lr step, and Adam's step count would then differ from an uninterrupted run's.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer.state else None
    error: BaseException | None = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            error = exc
    if _barrier(device, error is not None):
        raise CheckpointError(f"cannot create checkpoint folder {tmp}: {error}")
    try:
        atomic_save({"rank": rank, "rng": _rng_state()}, tmp / _rng_file(rank))
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
                "meta": meta,
            }
            atomic_save(state, tmp / STATE_FILE)
    except (OSError, RuntimeError) as exc:
        error = exc
    failed = _barrier(device, error is not None)
    if failed:
        raise CheckpointError(f"{failed} rank(s) failed to write checkpoint {final}: {error}")
    if rank == 0:
        aside = final.parent / f".old-{final.name}"
        if final.exists():  # the same boundary saved again (e.g. by a resumed run): swap, then drop
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        atomic_write_text(final.parent / LATEST_FILE, final.name + "\n")
        shutil.rmtree(aside, ignore_errors=True)
        _prune(final.parent, keep)
    _barrier(device)
    return final


def _prune(folder: Path, keep: int) -> None:
    done = sorted(p for p in folder.glob("step-*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None.

    ``checkpoints/latest`` names it; should a crash have left the pointer naming a folder that is
    mid-swap, the newest complete ``step-*`` folder is used instead.
    """
    folder = Path(run_dir) / "checkpoints"
    pointer = folder / LATEST_FILE
    if pointer.is_file():
        named = folder / pointer.read_text(encoding="utf-8").strip()
        if (named / STATE_FILE).is_file():
            return named
    complete = sorted(p for p in folder.glob("step-*") if (p / STATE_FILE).is_file())
    return complete[-1] if complete else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder as given, or the latest checkpoint of a run folder."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    for run_dir in (path, path.parent):
        found = latest_checkpoint(run_dir)
        if found is not None:
            return found
    raise CheckpointError(
        f"no checkpoint at {path}: expected a checkpoint folder holding {STATE_FILE}, or a run folder "
        f"with checkpoints/{LATEST_FILE}"
    )


def load_checkpoint(
    path: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    accumulator: Any,
    plan: BatchPlan,
    precision: str,
) -> tuple[TrainProgress, dict[str, Any]]:
    """Restore model, optimizer, scaler, the accumulator's counters and this rank's RNG; returns the
    run's counters and the meta.

    Collective under FSDP2 (every rank re-shards). Refuses a checkpoint written for another plan or
    precision, showing both, before touching any state.
    """
    folder = resolve_checkpoint(path)
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {folder} has format {state.get('format')!r}; "
            f"this gradaccum reads format {CHECKPOINT_FORMAT}"
        )
    saved_plan = BatchPlan(**state["plan"])
    if saved_plan != plan:
        raise CheckpointError(
            f"checkpoint {folder} was written by a run with a different plan:\n"
            f"  checkpoint: {saved_plan.equation()}\n"
            f"  this run:   {plan.equation()}\n"
            "Resuming would change the data each optimizer step sees. Resume with the checkpoint's "
            "--global-batch, --micro-batch and world size, or start a new run."
        )
    saved_precision = state["meta"].get("precision")
    if saved_precision != precision:
        raise CheckpointError(
            f"checkpoint {folder} was written in precision {saved_precision!r}, this run uses "
            f"{precision!r}; resume with --precision {saved_precision}"
        )
    rng_path = folder / _rng_file(dist.rank())
    if not rng_path.is_file():
        raise CheckpointError(
            f"checkpoint {folder} has no RNG state for rank {dist.rank()} ({rng_path.name})"
        )
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, state["model"], options=options)
    if state["optimizer"] is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=True)["rng"])
    progress = TrainProgress(**state["progress"])
    accumulator.load_state_dict(
        state.get("accumulator")
        or {  # written before the accumulator had a state_dict: the same counters
            "steps_applied": progress.steps_applied,
            "steps_skipped": progress.steps_skipped,
            "consecutive_skips": progress.consecutive_skips,
        }
    )
    return progress, {**state["meta"], "path": str(folder)}
