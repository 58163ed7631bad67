"""``gradaccum train``: train with exact accumulation on one process, or many under torchrun.

    gradaccum train --steps 40                                  # the bundled tiny GPT, defaults
    gradaccum train --global-batch 64 --micro-batch 8 --schedule-clock tokens
    gradaccum train --runcard runs/accept-.../runcard.json      # exactly what accept verified
    torchrun --nproc_per_node 2 -m gradaccum train --fsdp       # DDP by default, FSDP2 with --fsdp
    gradaccum train --run-dir runs/x --resume auto              # continue, or start, runs/x

This module is the only training code that reads environment variables (torchrun's RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), installs signal handlers and prints (rank 0 only).

Signals, as job schedulers expect (SIGUSR1 checkpoints and carries on; the first SIGINT or SIGTERM
checkpoints at the boundary and exits 130 or 143; a second stops at once), are
:mod:`gradaccum.cli.train_signals`; what rank 0 prints is :mod:`gradaccum.cli.train_render`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradaccum.cli.common import (
    DEFAULT_WORKLOAD,
    EXIT_FAILED,
    EXIT_OK,
    add_data_options,
    add_threads_option,
    check_output_folder,
    default_threads,
    int_at_least,
    number_above,
    output_folder,
    workload_spec,
)
from gradaccum.cli.train_render import TrainRenderer, count
from gradaccum.cli.train_signals import TrainSignals
from gradaccum.distributed import dist
from gradaccum.errors import (
    CheckpointWriteError,
    CollectiveError,
    GradAccumError,
    PlanError,
    RunCardError,
    TooManySkipsError,
    TrainError,
)
from gradaccum.plan import BatchPlan

if TYPE_CHECKING:
    from gradaccum.runcard import RunCard
    from gradaccum.train.config import TrainConfig
    from gradaccum.train.records import TrainEvent

DEFAULT_GLOBAL_BATCH, DEFAULT_MICRO_BATCH, DEFAULT_STEPS = 32, 8, 200
DEFAULT_OPTIMIZER, DEFAULT_LR, DEFAULT_WEIGHT_DECAY = "adamw", 1e-2, 0.0
DEFAULT_MAX_GRAD_NORM, DEFAULT_MAX_SKIPS = 1.0, 10
# the defaults of TrainConfig, repeated in the help (imported lazily: the parser stays light)
DEFAULT_CHECKPOINT_EVERY, DEFAULT_CHECKPOINT_MINUTES, DEFAULT_KEEP = 100, 30.0, 3
PROBE_S = 2.0
"""How long a surviving rank waits for the others to answer after a collective failed."""
AUTO = ("auto", "latest")

# flags that change what a run card fixes (the plan, the arithmetic of the update, the optimizer);
# beside --runcard they are refused, naming the card's value, never silently ignored
CARD_FLAGS = (
    "workload",
    "global_batch",
    "micro_batch",
    "precision",
    "seed",
    "optimizer",
    "lr",
    "weight_decay",
    "max_grad_norm",
    "max_consecutive_skips",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train with exact accumulation (one process, or DDP/FSDP2 under torchrun)",
        description="Train a workload with exact gradient accumulation. Every flag has a default that "
        "fits the bundled tiny GPT; under torchrun the same command runs data-parallel. Exit codes: 0 "
        "done, 1 the run failed (a rank lost, a full disk, out of memory, diverged), 2 bad input, 130 "
        "stopped by SIGINT, 143 stopped by SIGTERM (both after a checkpoint: rerun with --resume auto).",
    )
    what = p.add_argument_group("what to train")
    what.add_argument(
        "--workload",
        metavar="MODULE:FUNCTION",
        help=f"the function that returns a gradaccum.Workload (MODULE is imported from the current "
        f"directory or the import path), or hf:MODEL_DIR with --data FILE (default {DEFAULT_WORKLOAD})",
    )
    what.add_argument(
        "--runcard",
        type=Path,
        metavar="PATH",
        help="train exactly what this run card records: workload, plan, precision, seed, "
        "accumulation settings and optimizer (default: none, the flags below)",
    )
    what.add_argument(
        "--global-batch",
        type=int_at_least(1),
        metavar="G",
        help=f"examples per optimizer step, all ranks (default {DEFAULT_GLOBAL_BATCH})",
    )
    what.add_argument(
        "--micro-batch",
        type=int_at_least(1),
        metavar="N",
        help=f"examples per forward pass on each rank (default {DEFAULT_MICRO_BATCH})",
    )
    what.add_argument(
        "--precision",
        choices=("float32", "bfloat16", "float16", "float64"),
        help="compute precision; float16 adds a GradScaler (default float32)",
    )
    what.add_argument(
        "--seed", type=int_at_least(0), metavar="S", help="data stream and dropout seed (default 0)"
    )
    length = p.add_argument_group("how long")
    length.add_argument(
        "--steps",
        type=int_at_least(1),
        metavar="N",
        help=f"optimizer boundaries to train, skipped ones included (default {DEFAULT_STEPS}, or none "
        "with --tokens)",
    )
    length.add_argument(
        "--tokens",
        type=int_at_least(1),
        metavar="T",
        help="stop once this many valid tokens were consumed (default: no token limit)",
    )
    opt = p.add_argument_group("optimizer and schedule")
    opt.add_argument(
        "--optimizer",
        choices=("adamw", "sgd", "workload"),
        help=f"adamw or sgd at --lr and --weight-decay, or the workload's own optimizer_factory "
        f"(default {DEFAULT_OPTIMIZER})",
    )
    opt.add_argument(
        "--lr",
        type=number_above(0.0),
        metavar="LR",
        help=f"peak learning rate; the schedule scales it (default {DEFAULT_LR:g})",
    )
    opt.add_argument(
        "--weight-decay",
        type=number_above(0.0, inclusive=True),
        metavar="W",
        help=f"decoupled weight decay (adamw) or L2 penalty (sgd) (default {DEFAULT_WEIGHT_DECAY:g})",
    )
    opt.add_argument(
        "--max-grad-norm",
        type=number_above(0.0, inclusive=True),
        metavar="NORM",
        help=f"clip the accumulated gradient to this norm; 0 turns clipping off "
        f"(default {DEFAULT_MAX_GRAD_NORM:g})",
    )
    opt.add_argument(
        "--max-consecutive-skips",
        type=int_at_least(1),
        metavar="K",
        help=f"stop when this many updates in a row were skipped as non-finite (default {DEFAULT_MAX_SKIPS})",
    )
    opt.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="linear warmup, then cosine decay to --min-lr-ratio, or then flat (default cosine)",
    )
    opt.add_argument(
        "--noise-scale",
        action="store_true",
        help="estimate the gradient noise scale B_simple (the critical batch) from the micro-batches; "
        "logged per step and in the summary and run card; the update is unchanged",
    )
    opt.add_argument(
        "--schedule-clock",
        choices=("steps", "tokens"),
        default="steps",
        help="advance the schedule per applied optimizer step or per consumed valid token (default steps)",
    )
    opt.add_argument(
        "--warmup",
        type=int_at_least(0),
        metavar="N",
        help="warmup in clock units (default 10%% of the horizon)",
    )
    opt.add_argument(
        "--horizon",
        type=int_at_least(1),
        metavar="N",
        help="where the cosine ends, in clock units (default: the run's length)",
    )
    opt.add_argument(
        "--min-lr-ratio",
        type=_ratio,
        default=0.1,
        metavar="R",
        help="the cosine's floor as a fraction of the peak, 0 to 1 (default 0.1)",
    )
    where = p.add_argument_group("run")
    where.add_argument(
        "--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: cuda:LOCAL_RANK if any)"
    )
    where.add_argument(
        "--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP (default DDP)"
    )
    add_threads_option(where, per="process, printed at start, as bench and accept")
    where.add_argument(
        "--run-dir",
        type=output_folder,
        metavar="PATH",
        help="run folder; a fresh run refuses one that holds another run (default runs/train-<time>)",
    )
    where.add_argument(
        "--resume",
        metavar="PATH|auto",
        help="continue from a checkpoint folder, or from a run folder's newest intact checkpoint; "
        "auto (or latest): the newest intact checkpoint of --run-dir, or a fresh run there if it has "
        "none yet; without --run-dir, of the newest run under runs/ (default: a fresh run)",
    )
    where.add_argument(
        "--checkpoint-every",
        type=int_at_least(0),
        metavar="N",
        help=f"checkpoint every N applied updates; 0: not by count (default {DEFAULT_CHECKPOINT_EVERY})",
    )
    where.add_argument(
        "--checkpoint-minutes",
        type=number_above(0.0, inclusive=True),
        metavar="M",
        help=f"checkpoint at the first boundary M minutes after the last one, whichever of this and "
        f"--checkpoint-every comes first; 0: not by time (default {DEFAULT_CHECKPOINT_MINUTES:g})",
    )
    where.add_argument(
        "--keep-checkpoints",
        type=int_at_least(1),
        metavar="K",
        help=f"intact checkpoints kept; older ones are deleted (default {DEFAULT_KEEP})",
    )
    where.add_argument(
        "--eval-every",
        type=int_at_least(1),
        metavar="N",
        help="evaluate on held-out examples every N boundaries and at the end (default: never)",
    )
    where.add_argument(
        "--eval-examples",
        type=int_at_least(1),
        default=64,
        metavar="N",
        help="held-out examples per evaluation, split across ranks (default 64)",
    )
    add_data_options(p)
    p.set_defaults(func=run)


def _ratio(text: str) -> float:
    value = number_above(0.0, inclusive=True)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text}")
    return value


# -- building the config -----------------------------------------------------------------------


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _card_value(card: RunCard, name: str) -> str:
    values = {
        "workload": card.workload,
        "global_batch": f"{card.plan.global_batch} ({card.plan.equation()})",
        "micro_batch": f"{card.plan.micro_batch} ({card.plan.equation()})",
        "precision": card.precision,
        "seed": card.seed,
        "optimizer": card.optimizer,
        "lr": "none (the workload's optimizer)" if card.lr is None else f"{card.lr:g}",
        "weight_decay": "none (the workload's optimizer)"
        if card.weight_decay is None
        else f"{card.weight_decay:g}",
        "max_grad_norm": _word(card.accum.max_grad_norm),
        "max_consecutive_skips": _word(card.accum.max_consecutive_skips),
    }
    return str(values[name])


def _word(value: Any) -> str:
    """A setting as a person writes it: no Python ``None``/``True``."""
    if value is None:
        return "off"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _from_card(args: argparse.Namespace, world: int) -> tuple[BatchPlan, dict[str, Any], list[str]]:
    """The plan and settings a run card fixes, and the lines that say what was taken from it."""
    from gradaccum.runcard import read_runcard

    card = read_runcard(args.runcard)
    given = [name for name in CARD_FLAGS if getattr(args, name) is not None]
    if given:
        clashes = "; ".join(
            f"{_flag(name)} {_word(getattr(args, name))} (the card has {_card_value(card, name)})"
            for name in given
        )
        raise PlanError(
            f"--runcard {args.runcard} fixes what was verified, and these flags would change it: "
            f"{clashes}. Drop them, or train without --runcard."
        )
    if card.plan.dp != world:
        raise PlanError(
            f"run card {args.runcard} was verified with dp={card.plan.dp} ({card.plan.equation()}), but "
            f"this job has {count(world, 'process')}. Launch with torchrun --nproc-per-node "
            f"{card.plan.dp}, or verify a plan for this world size."
        )
    if card.optimizer in ("adamw", "sgd") and card.lr is None:
        raise RunCardError(
            f"run card {args.runcard} names optimizer {card.optimizer} but no lr; it cannot be trained "
            "as recorded (write lr into the card, or run accept again)"
        )
    # track_grad_norm and noise_scale only add figures to the records; they do not change the update
    fixed = {
        "workload": card.workload,
        "precision": card.precision,
        "seed": card.seed,
        "accum": replace(
            card.accum, track_grad_norm=True, noise_scale=card.accum.noise_scale or args.noise_scale
        ),
        "optimizer": card.optimizer,
        "lr": card.lr if card.lr is not None else DEFAULT_LR,
        "weight_decay": card.weight_decay if card.weight_decay is not None else DEFAULT_WEIGHT_DECAY,
    }
    if card.optimizer == "workload":
        optimizer = "the workload's own optimizer_factory (its learning rates are the schedule's peak)"
    else:
        optimizer = f"{card.optimizer}, lr {card.lr:g}, weight decay {_word(fixed['weight_decay'])}"
    accum = ", ".join(f"{k} {_word(v)}" for k, v in card.accum.to_dict().items() if k != "track_grad_norm")
    lines = [
        f"from run card {args.runcard}: workload {card.workload}; {card.plan.equation()}; precision "
        f"{card.precision}"
        + (" (with a GradScaler)" if card.precision == "float16" else "")
        + f"; seed {card.seed}",
        f"from run card: optimizer {optimizer}",
        f"from run card: accumulation {accum}",
    ]
    return card.plan, fixed, lines


def _from_flags(args: argparse.Namespace, world: int) -> tuple[BatchPlan, dict[str, Any]]:
    from gradaccum.step.config import AccumConfig

    plan = BatchPlan.solve(
        global_batch=_given(args.global_batch, DEFAULT_GLOBAL_BATCH),
        micro_batch=_given(args.micro_batch, DEFAULT_MICRO_BATCH),
        dp=world,
    )
    max_norm = _given(args.max_grad_norm, DEFAULT_MAX_GRAD_NORM)
    accum = AccumConfig(
        max_grad_norm=max_norm if max_norm != 0 else None,  # 0 turns clipping off
        track_grad_norm=True,
        max_consecutive_skips=_given(args.max_consecutive_skips, DEFAULT_MAX_SKIPS),
        noise_scale=args.noise_scale,
    )
    fixed = {
        "workload": _given(args.workload, DEFAULT_WORKLOAD),
        "precision": _given(args.precision, "float32"),
        "seed": _given(args.seed, 0),
        "accum": accum,
        "optimizer": _given(args.optimizer, DEFAULT_OPTIMIZER),
        "lr": _given(args.lr, DEFAULT_LR),
        "weight_decay": _given(args.weight_decay, DEFAULT_WEIGHT_DECAY),
    }
    return plan, fixed


def _build_config(
    args: argparse.Namespace, world: int, device: torch.device, run_dir: Path, resume: Path | None
) -> tuple[TrainConfig, list[str]]:
    from gradaccum.train.config import TrainConfig
    from gradaccum.train.schedule import ScheduleConfig

    lines: list[str] = []
    if args.runcard is not None:
        plan, fixed, lines = _from_card(args, world)
    else:
        plan, fixed = _from_flags(args, world)
    steps = args.steps if args.steps is not None or args.tokens is not None else DEFAULT_STEPS
    every = _given(args.checkpoint_every, DEFAULT_CHECKPOINT_EVERY)
    minutes = _given(args.checkpoint_minutes, DEFAULT_CHECKPOINT_MINUTES)
    warmup, horizon = args.warmup, args.horizon
    if args.schedule == "cosine" and warmup is not None and horizon is not None and warmup > horizon:
        raise PlanError(
            f"--warmup {warmup} is longer than --horizon {horizon} ({args.schedule_clock}); "
            "shorten the warmup or lengthen the horizon"
        )
    config = TrainConfig(
        plan=plan,
        run_dir=run_dir,
        workload=fixed["workload"],
        steps=steps,
        tokens=args.tokens,
        schedule=ScheduleConfig(
            kind=args.schedule,
            clock=args.schedule_clock,
            warmup=args.warmup,
            horizon=args.horizon,
            min_lr_ratio=args.min_lr_ratio,
        ),
        optimizer=fixed["optimizer"],
        lr=fixed["lr"],
        weight_decay=fixed["weight_decay"],
        precision=fixed["precision"],
        accum=fixed["accum"],
        seed=fixed["seed"],
        device=str(device),
        fsdp=args.fsdp,
        checkpoint_every=every if every > 0 else None,
        checkpoint_minutes=minutes if minutes > 0 else None,
        keep_checkpoints=_given(args.keep_checkpoints, DEFAULT_KEEP),
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        resume=resume,
    )
    return config, lines


# -- process group, device, run folder -------------------------------------------------------------


def _device(choice: str) -> torch.device:
    """The training device; under torchrun ``cuda`` means ``cuda:LOCAL_RANK``."""
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


def _init_distributed(device: torch.device) -> bool:
    """Join torchrun's process group when launched by it (NCCL for CUDA, gloo for CPU); True if
    this call created it."""
    if torch.distributed.is_initialized() or not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl", device_id=device)
    else:
        torch.distributed.init_process_group("gloo")
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


def _where(args: argparse.Namespace) -> tuple[Path, Path | None, str | None]:
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


def _shared(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (an error on rank 0 is raised on every rank)."""
    return dist.all_gather_objects(value, what="the run folder")[0]


# -- the resume command and a lost rank ---------------------------------------------------------------


def _resume_command(args: argparse.Namespace, run_dir: Path, world: int) -> str:
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


def _lost_rank_message(exc: BaseException, world: int, rank: int, resume: str, run_dir: Path) -> str:
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


# -- the command ----------------------------------------------------------------------------------


def _err(text: str) -> None:
    print(f"gradaccum train: {text}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    leader = int(os.environ.get("RANK", "0")) == 0
    threads_before = torch.get_num_threads()
    # installed before the training code imports: a signal then exits at once (nothing written yet)
    with TrainSignals(leader=leader) as signals:
        from gradaccum.train.loop import TrainControl, train

        workload_spec(args)  # --workload hf:MODEL_DIR --data FILE ... as one spec, in args.workload
        control = signals.control = TrainControl()
        device = _device(args.device)
        threads = default_threads(args.threads, device.type)
        if threads is not None:
            torch.set_num_threads(threads)
        created = _init_distributed(device)
        try:
            world, rank = dist.world_size(), dist.rank()
            where: Any = None
            error: str | None = None
            if rank == 0:
                try:
                    where = _where(args)
                except GradAccumError as exc:
                    error = str(exc)
            where, error = _shared((where, error))
            if error is not None:
                raise TrainError(error)
            run_dir, resume, note = where
            config, lines = _build_config(args, world, device, run_dir, resume)
            args.configuration = f"{config.plan.equation()}, precision {config.precision}"
            resume_command = _resume_command(args, run_dir, world)
            signals.run_dir, signals.resume_command = run_dir, resume_command
            renderer = TrainRenderer(config, args, [*lines, *([note] if note else [])]) if rank == 0 else None

            def on_event(event: TrainEvent) -> None:
                signals.training = True  # from the start record on, a signal stops at a boundary
                if renderer is not None:
                    renderer(event)

            try:
                result = train(config, control=control, on_event=on_event)
            except TooManySkipsError as exc:
                if renderer is not None:
                    renderer.close()
                    _err(f"training stopped: {exc}")
                return EXIT_FAILED
            except CheckpointWriteError as exc:
                if renderer is not None:
                    renderer.close()
                    _err(
                        f"failed: {exc}\n  free space (or lift the limit), then resume with: {resume_command}"
                    )
                return EXIT_FAILED
            except (CollectiveError, RuntimeError) as exc:
                if not (world > 1 and dist.looks_like_comm_failure(exc)):
                    raise
                if renderer is not None:
                    renderer.close()
                _err(f"failed: {_lost_rank_message(exc, world, rank, resume_command, run_dir)}")
                return EXIT_FAILED
            finally:
                if renderer is not None:
                    renderer.close()
            signals.training = False
            if result.stopped == "interrupted before the first window":
                if renderer is not None:
                    _err("interrupted before the first window; nothing was trained or written")
                return signals.exit_code
            if renderer is not None:
                renderer.summary(result, resume_command)
            return EXIT_OK if result.stopped == "completed" else signals.exit_code
        finally:
            if created and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            torch.set_num_threads(threads_before)
