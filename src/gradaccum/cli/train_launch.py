"""How ``gradaccum train`` is launched: the device, torchrun's process group, the run folder, the
command that resumes a run, and which rank was lost when one stopped answering.

This is the only training code that reads environment variables (torchrun's RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and TORCHELASTIC_*), which is why it is in the command
line and not in :mod:`gradaccum.train`. torch is imported inside the functions, after the parser
was built: ``gradaccum train --help`` imports none of it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradaccum.cli.common import check_output_folder
from gradaccum.errors import CollectiveError, TrainError

if TYPE_CHECKING:
    import torch

__all__ = [
    "AUTO",
    "JOIN_TIMEOUT_S",
    "PROBE_S",
    "init_distributed",
    "lost_rank_message",
    "resume_command",
    "shared",
    "train_device",
    "where",
]

PROBE_S = 2.0
"""How long a surviving rank waits for the others to answer after a collective failed."""
JOIN_TIMEOUT_S = 300.0
"""How long a rank waits for the process group to form, and for its first collective, before it
stops with an error naming the missing ranks (instead of waiting for torch's 30 minutes)."""
AUTO = ("auto", "latest")


def train_device(choice: str) -> torch.device:
    """The training device; under torchrun ``cuda`` means ``cuda:LOCAL_RANK``."""
    import torch

    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(choice)
    except RuntimeError:
        raise TrainError(f"--device {choice} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise TrainError(f"--device {choice} is not supported by train; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainError(f"--device {choice} but this torch sees no CUDA device; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def init_distributed(device: torch.device) -> bool:
    """Join torchrun's process group when launched by it (NCCL for CUDA, gloo for CPU); True if
    this call created it."""
    import torch

    from gradaccum.distributed import dist

    if torch.distributed.is_initialized() or not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return False
    env = os.environ
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        host=env.get("MASTER_ADDR", "127.0.0.1"),
        port=int(env.get("MASTER_PORT", "29500")),
        rank=int(env["RANK"]),
        world=int(env["WORLD_SIZE"]),
        # torchrun keeps its agent's store on one port for every restart round: each round's group
        # keys under its own prefix (docs/design/distributed-and-mesh.md, "Restart rounds")
        restart_round=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        timeout_s=JOIN_TIMEOUT_S,
        device_id=device if device.type == "cuda" else None,
    )
    return True


def _new_run_dir(root: Path) -> Path:
    """``root/train-<time>``, with a suffix when another run already took that name."""
    base = root / time.strftime("train-%Y%m%d-%H%M%S")
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


def _newest_run_with_checkpoint(root: Path) -> Path | None:
    from gradaccum.train.checkpoint import find_intact

    runs = sorted(
        (p for p in root.glob("train-*") if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True
    )
    return next((run for run in runs if find_intact(run, checksums=False) is not None), None)


def where(args: argparse.Namespace) -> tuple[Path, Path | None, str | None]:
    """(run folder, what to resume or None, a note): decided on rank 0 and shared by all ranks."""
    from gradaccum.train.checkpoint import checkpoints_of, find_intact, run_folder_of

    note = None
    if args.resume is None:
        run_dir = args.run_dir if args.run_dir is not None else _new_run_dir(Path("runs"))
        resume = None
    elif args.resume in AUTO:
        if args.run_dir is None:
            found = _newest_run_with_checkpoint(Path("runs"))
            if found is None:
                raise TrainError(
                    f"--resume {args.resume} found no run folder with an intact checkpoint under runs/; "
                    "give the run's folder with --run-dir (a fresh run starts there if it holds none yet)"
                )
            run_dir, resume = found, found
        elif find_intact(args.run_dir) is not None or checkpoints_of(args.run_dir):
            run_dir, resume = args.run_dir, args.run_dir  # broken-only folders are refused with details
        else:
            run_dir, resume = args.run_dir, None
            note = f"--resume {args.resume}: {args.run_dir} holds no checkpoint yet; starting a new run there"
    else:
        resume = Path(args.resume)
        run_dir = args.run_dir if args.run_dir is not None else run_folder_of(resume)
    check_output_folder(Path(run_dir), "--run-dir")
    return Path(run_dir), resume, note


def shared(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (an error on rank 0 is raised on every rank)."""
    from gradaccum.distributed import dist

    return dist.all_gather_objects(value, what="the run folder")[0]


def resume_command(args: argparse.Namespace, run_dir: Path, world: int) -> str:
    """The command that continues this run: the same flags, ``--run-dir RUN --resume auto``."""
    argv = list(getattr(args, "argv", None) or ["train"])
    kept: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        if token in ("--resume", "--run-dir"):
            skip = True
            continue
        if token.startswith(("--resume=", "--run-dir=")):
            continue
        kept.append(token)
    kept += ["--run-dir", str(run_dir), "--resume", "auto"]
    if world > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        launch = (
            f"torchrun --nproc-per-node {world}" if local == world else "torchrun <the same launch flags>"
        )
        return f"{launch} -m gradaccum {shlex.join(kept)}"
    return f"gradaccum {shlex.join(kept)}"


def _lost_ranks(world: int, rank: int) -> list[int] | None:
    """Which ranks stopped answering, found by each survivor checking in with torchrun's store and
    waiting :data:`PROBE_S` for the others; None when it cannot be told."""
    import torch

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        try:
            store = torch.distributed.TCPStore(
                addr, int(port), is_master=False, timeout=timedelta(seconds=PROBE_S), wait_for_workers=False
            )
            prefix = (
                f"gradaccum/lost/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
            )
            store.set(f"{prefix}{rank}", "alive")
            deadline = time.monotonic() + PROBE_S
            missing = [r for r in range(world) if r != rank]
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
                if missing:
                    time.sleep(0.1)
            return missing
        except Exception:  # no store to ask (it went with the lost rank's node): say what is known
            pass
    return [1 - rank] if world == 2 else None


def lost_rank_message(exc: BaseException, world: int, rank: int, resume: str, run_dir: Path) -> str:
    from gradaccum.train.checkpoint import find_intact

    lost = _lost_ranks(world, rank)
    if lost:
        who = f"rank {lost[0]}" if len(lost) == 1 else "ranks " + ", ".join(map(str, lost))
        head = f"rank {rank}: {who} of {world} stopped answering (its process died or hangs)"
    else:
        head = f"rank {rank}: another rank of {world} stopped answering (its process died or hangs)"
    point = find_intact(run_dir, checksums=False)
    kept = f"the newest complete checkpoint is {point.path}" if point else "no checkpoint was written yet"
    detail = str(exc).split(" (")[0] if isinstance(exc, CollectiveError) else type(exc).__name__
    return (
        f"{head}, so this rank stops too ({detail}). The lost rank's own log holds its first error; "
        f"{kept}.\n  resume with: {resume}"
    )
