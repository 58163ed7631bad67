"""``gradaccum train``: train with exact accumulation on one process, or many under torchrun.

    gradaccum train --steps 40                                  # the bundled tiny GPT, defaults
    gradaccum train --global-batch 64 --micro-batch 8 --schedule-clock tokens
    gradaccum train --global-batch 64 --max-tokens 256           # micro-batches by a token budget
    gradaccum train --runcard runs/accept-.../runcard.json      # exactly what accept verified
    torchrun --nproc_per_node 2 -m gradaccum train --fsdp       # DDP by default, FSDP2 with --fsdp
    gradaccum train --run-dir runs/x --resume auto              # continue, or start, runs/x

The data flow of every command: the flags are parsed into a :class:`~gradaccum.train.spec.TrainSpec`
(:func:`spec_from_args`), which :func:`~gradaccum.train.resolve.resolve_spec` resolves against the
launch into a ``TrainConfig``; :func:`~gradaccum.train.loop.train` runs it and rank 0 renders the
events and the result. This module holds the flags and that sequence; the decisions (defaults, the
plan, what a run card fixes) are in :mod:`gradaccum.train.spec` and :mod:`gradaccum.train.resolve`.

Adding a flag is a two-place change: add it to its group below (a
:class:`~gradaccum.cli.options.Flag` row, or an ``add_argument`` call for a switch or a choice;
``dest`` = the field's name, argparse default ``None``, the real default in the help) and add the
field to ``TrainSpec`` (its default, its check); :func:`spec_from_args` and ``resolve_spec`` carry it
from there (a field named like a ``TrainConfig`` field reaches the run unchanged).
``tests/cli/test_train_flags.py`` checks that every field has its flag.

The launch (device, torchrun's process group, the run folder, the resume command, a lost rank) is
:mod:`gradaccum.cli.train_launch`, the only training code that reads environment variables. Signals,
as job schedulers expect (SIGUSR1 checkpoints and carries on; the first SIGINT or SIGTERM checkpoints
at the boundary and exits 130 or 143; a second stops at once), are :mod:`gradaccum.cli.train_signals`;
what rank 0 prints is :mod:`gradaccum.cli.train_render`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from gradaccum.cli import train_launch as launch
from gradaccum.cli.common import (
    DEFAULT_WORKLOAD,
    EXIT_FAILED,
    EXIT_OK,
    Flag,
    add_command,
    add_data_options,
    add_flags,
    add_run_settings,
    add_threads_option,
    default_threads,
    int_at_least,
    number_above,
    output_folder,
    workload_spec,
)
from gradaccum.cli.train_render import TrainRenderer
from gradaccum.cli.train_signals import TrainSignals
from gradaccum.errors import (
    CheckpointWriteError,
    CollectiveError,
    GradAccumError,
    TooManySkipsError,
    TrainError,
)
from gradaccum.names import PARAM_DTYPES, PRECISIONS
from gradaccum.train import spec as train_spec
from gradaccum.train.batch_schedule import DEFAULT_GROWTH, DEFAULT_LR_RULE, DEFAULT_MIN_UPDATES, LR_RULES
from gradaccum.train.spec import TrainSpec

if TYPE_CHECKING:
    import torch

    from gradaccum.train.records import TrainEvent

__all__ = ["register", "run", "spec_from_args"]


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "train",
        "train with exact accumulation (one process, or DDP/FSDP2 under torchrun)",
        "Train a workload with exact gradient accumulation. Every flag has a default that "
        "fits the bundled tiny GPT; under torchrun the same command runs data-parallel. Exit codes: 0 "
        "done, 1 the run failed (a rank lost, a full disk, out of memory, diverged), 2 bad input, 130 "
        "stopped by SIGINT, 143 stopped by SIGTERM (both after a checkpoint: rerun with --resume auto).",
        _add_options,
        run,
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    _add_what(p.add_argument_group("what to train"))
    add_run_settings(
        p.add_argument_group("accumulation (recorded in the run card, replayed by --runcard)"), "train"
    )
    _add_length(p.add_argument_group("how long"))
    _add_optimizer(p.add_argument_group("optimizer and schedule"))
    _add_batch_schedule(p.add_argument_group("batch-size schedule (the critical batch)"))
    _add_run(p.add_argument_group("run"))
    add_data_options(p)


def _add_what(what: argparse._ArgumentGroup) -> None:
    add_flags(
        what,
        Flag(
            "--workload",
            "MODULE:FUNCTION",
            None,
            f"the function that returns a gradaccum.Workload (MODULE is imported from the current "
            f"directory or the import path), or hf:MODEL_DIR with --data FILE (default {DEFAULT_WORKLOAD})",
        ),
        Flag(
            "--runcard",
            "PATH",
            Path,
            "train exactly what this run card records: workload, plan, precision, seed, "
            "accumulation settings and optimizer (default: none, the flags below)",
        ),
        Flag(
            "--global-batch",
            "G",
            int_at_least(1),
            f"examples per optimizer step, all ranks (default {train_spec.DEFAULT_GLOBAL_BATCH})",
        ),
        Flag(
            "--micro-batch",
            "N",
            int_at_least(1),
            f"examples per forward pass on each rank (default {train_spec.DEFAULT_MICRO_BATCH})",
        ),
        Flag(
            "--accum-steps",
            "K",
            int_at_least(1),
            "micro-batches per optimizer step on each rank (gradient_accumulation_steps, "
            "accumulate_grad_batches); global batch = micro-batch x processes x K, checked against "
            "--global-batch and --micro-batch when given (default: --global-batch / (--micro-batch x "
            "processes); with K alone the micro-batch keeps its default and the global batch follows)",
        ),
        Flag(
            "--max-tokens",
            "N",
            int_at_least(1),
            "instead of --micro-batch: micro-batches of at most N tokens (rows x longest row), each "
            "window's rows sorted by length and balanced across ranks by tokens (default: none, fixed "
            "micro-batches)",
        ),
    )
    what.add_argument(
        "--balance-cost",
        action="store_true",
        help="with --max-tokens: balance the ranks by compute cost, attention's length-squared term "
        "included (d_model and layers read from the workload's model), not by tokens; the run card "
        "records it (default: by tokens)",
    )
    what.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="compute precision; bfloat16 and float16 run under autocast, float16 adds a GradScaler "
        "(default float32; the parameters' dtype is --param-dtype)",
    )
    what.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        help="the dtype the parameters are stored, trained and checkpointed in: saved (as the workload "
        "builds them: an hf: folder's saved dtype, float64 under --precision float64) or a dtype; "
        "bfloat16 parameters take --accum-dtype float32 for exact float32 sums of their gradients "
        "(default saved; the banner and the run card say which)",
    )
    add_flags(what, Flag("--seed", "S", int_at_least(0), "data stream and dropout seed (default 0)"))


def _add_length(length: argparse._ArgumentGroup) -> None:
    add_flags(
        length,
        Flag(
            "--steps",
            "N",
            int_at_least(1),
            f"optimizer boundaries to train, skipped ones included (default {train_spec.DEFAULT_STEPS}, "
            "or none with --tokens)",
        ),
        Flag(
            "--tokens",
            "T",
            int_at_least(1),
            "stop once this many valid tokens were consumed (default: no token limit)",
        ),
    )


def _add_optimizer(opt: argparse._ArgumentGroup) -> None:
    opt.add_argument(
        "--optimizer",
        choices=train_spec.OPTIMIZERS,
        help=f"adamw or sgd at --lr and --weight-decay, or the workload's own optimizer_factory "
        f"(default {train_spec.DEFAULT_OPTIMIZER})",
    )
    add_flags(
        opt,
        Flag(
            "--lr",
            "LR",
            number_above(0.0),
            f"peak learning rate; the schedule scales it (default {train_spec.DEFAULT_LR:g})",
        ),
        Flag(
            "--weight-decay",
            "W",
            number_above(0.0, inclusive=True),
            "decoupled weight decay (adamw) or L2 penalty (sgd) "
            f"(default {train_spec.DEFAULT_WEIGHT_DECAY:g})",
        ),
        Flag(
            "--max-grad-norm",
            "NORM",
            number_above(0.0, inclusive=True),
            f"clip the accumulated gradient to this norm; 0 turns clipping off "
            f"(default {train_spec.DEFAULT_MAX_GRAD_NORM:g})",
        ),
        Flag(
            "--max-consecutive-skips",
            "K",
            int_at_least(1),
            "stop when this many updates in a row were skipped as non-finite "
            f"(default {train_spec.DEFAULT_MAX_SKIPS})",
        ),
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
        "--scaling",
        choices=("pre", "post"),
        default=None,
        help="pre: count each window before its first backward (default, or the run card's); post: "
        "stream the micro-batches and scale the gradients once after the window (the same update, "
        "memory independent of the accumulation steps)",
    )
    opt.add_argument(
        "--schedule-clock",
        choices=("steps", "tokens"),
        default="steps",
        help="advance the schedule per applied optimizer step or per consumed valid token (default steps)",
    )
    add_flags(
        opt,
        Flag("--warmup", "N", int_at_least(0), "warmup in clock units (default 10%% of the horizon)"),
        Flag(
            "--horizon",
            "N",
            int_at_least(1),
            "where the cosine ends, in clock units (default: the run's length)",
        ),
        Flag(
            "--min-lr-ratio",
            "R",
            _ratio,
            "the cosine's floor as a fraction of the peak, 0 to 1 (default 0.1)",
            0.1,
        ),
    )


def _add_batch_schedule(batch: argparse._ArgumentGroup) -> None:
    batch.add_argument(
        "--batch-schedule",
        choices=("fixed", "critical"),
        help="critical: grow the global batch toward the measured noise scale B_simple by raising "
        "accum_steps (the micro-batch, and memory, stay fixed; turns --noise-scale on) (default fixed)",
    )
    add_flags(
        batch,
        Flag(
            "--max-global-batch",
            "G",
            int_at_least(1),
            "the largest global batch, examples over all ranks, a multiple of --micro-batch x "
            "processes (default: none; required with --batch-schedule critical)",
        ),
        Flag(
            "--batch-growth",
            "F",
            number_above(1.0),
            f"at most this factor per change (default {DEFAULT_GROWTH:g})",
        ),
        Flag(
            "--batch-min-updates",
            "N",
            int_at_least(1),
            f"applied updates before the first change and between changes; the decision reads the "
            f"last N windows' estimates (default {DEFAULT_MIN_UPDATES})",
        ),
    )
    batch.add_argument(
        "--batch-lr-rule",
        choices=LR_RULES,
        help=f"the learning rate when the batch grows from B0 to B: keep, sqrt (x sqrt(B/B0), Adam's "
        f"rule) or linear (x B/B0, SGD's) (default {DEFAULT_LR_RULE})",
    )
    add_flags(
        batch,
        Flag(
            "--batch-fraction",
            "R",
            number_above(0.0),
            "aim the global batch at R x B_simple; below 1 spends fewer tokens and more updates (default 1)",
        ),
    )


def _add_run(where: argparse._ArgumentGroup) -> None:
    where.add_argument(
        "--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: cuda:LOCAL_RANK if any)"
    )
    where.add_argument(
        "--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP (default DDP)"
    )
    where.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model in place before DDP, or each block after fully_shard with --fsdp "
        "(torch's default backend); a window that compiles says how many graphs, and the run card "
        "records it (default: eager)",
    )
    add_threads_option(where, per="process, printed at start, as bench and accept")
    add_flags(
        where,
        Flag(
            "--run-dir",
            "PATH",
            output_folder,
            "run folder; a fresh run refuses one that holds another run (default runs/train-<time>)",
        ),
        Flag(
            "--resume",
            "PATH|auto",
            None,
            "continue from a checkpoint folder, or from a run folder's newest intact checkpoint; "
            "auto (or latest): the newest intact checkpoint of --run-dir, or a fresh run there if it has "
            "none yet; without --run-dir, of the newest run under runs/ (default: a fresh run)",
        ),
        Flag(
            "--checkpoint-every",
            "N",
            int_at_least(0),
            "checkpoint every N applied updates; 0: not by count "
            f"(default {train_spec.DEFAULT_CHECKPOINT_EVERY})",
        ),
        Flag(
            "--checkpoint-minutes",
            "M",
            number_above(0.0, inclusive=True),
            "checkpoint at the first boundary M minutes after the last one, whichever of this and "
            "--checkpoint-every comes first; 0: not by time "
            f"(default {train_spec.DEFAULT_CHECKPOINT_MINUTES:g})",
        ),
        Flag(
            "--keep-checkpoints",
            "K",
            int_at_least(1),
            "intact checkpoints kept; older ones are deleted "
            f"(default {train_spec.DEFAULT_KEEP_CHECKPOINTS})",
        ),
        Flag(
            "--eval-every",
            "N",
            int_at_least(1),
            "evaluate on held-out examples every N boundaries and at the end (default: never)",
        ),
        Flag(
            "--eval-examples",
            "N",
            int_at_least(1),
            "held-out examples per evaluation, split across ranks (default 64)",
            64,
        ),
    )


def _ratio(text: str) -> float:
    value = number_above(0.0, inclusive=True)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, got {text}")
    return value


def spec_from_args(args: argparse.Namespace) -> TrainSpec:
    """The request the flags make: each :class:`TrainSpec` field from the flag of the same name; a
    flag not given (``None``) leaves the field's default."""
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainSpec)}
    return TrainSpec(**{name: value for name, value in given.items() if value is not None})


# -- the command ----------------------------------------------------------------------------------


def _err(text: str) -> None:
    print(f"gradaccum train: {text}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    args.started = time.monotonic()  # the summary sets the training loop's time beside the command's
    leader = int(os.environ.get("RANK", "0")) == 0
    # installed before torch and the training code import: a signal then exits at once (nothing
    # written yet)
    with TrainSignals(leader=leader) as signals:
        import torch

        threads_before = torch.get_num_threads()
        workload_spec(args)  # --workload hf:MODEL_DIR --data FILE ... as one spec, in args.workload
        spec = spec_from_args(args)
        device = launch.train_device(args.device)
        threads = default_threads(args.threads, device.type)
        if threads is not None:
            torch.set_num_threads(threads)
        created = launch.init_distributed(device)
        try:
            return _train(args, spec, device, signals)
        finally:
            if created and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            torch.set_num_threads(threads_before)


def _train(args: argparse.Namespace, spec: TrainSpec, device: torch.device, signals: TrainSignals) -> int:
    """Resolve ``spec`` on this launch, train, render; the exit code."""
    from gradaccum.distributed import dist
    from gradaccum.train.loop import TrainControl, train
    from gradaccum.train.resolve import resolve_spec

    control = signals.control = TrainControl()
    world, rank = dist.world_size(), dist.rank()
    run_dir, resume, note = _run_folder(args, rank)
    resolved = resolve_spec(spec, world=world, device=str(device), run_dir=run_dir, resume=resume)
    config = resolved.config
    args.configuration = f"{config.plan.equation()}, precision {config.precision}"
    resume_command = launch.resume_command(args, run_dir, world)
    signals.run_dir, signals.resume_command = run_dir, resume_command
    notes = [*resolved.notes, *([note] if note else [])]
    renderer = TrainRenderer(config, args, notes) if rank == 0 else None

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
            _err(f"failed: {exc}\n  free space (or lift the limit), then resume with: {resume_command}")
        return EXIT_FAILED
    except (CollectiveError, RuntimeError) as exc:
        if not (world > 1 and dist.looks_like_comm_failure(exc)):
            raise
        if renderer is not None:
            renderer.close()
        _err(f"failed: {launch.lost_rank_message(exc, world, rank, resume_command, run_dir)}")
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


def _run_folder(args: argparse.Namespace, rank: int) -> tuple[Path, Path | None, str | None]:
    """(run folder, what to resume or None, a note), decided on rank 0 and shared by every rank (an
    error there is raised on every rank)."""
    where: tuple[Path, Path | None, str | None] | None = None
    error: str | None = None
    if rank == 0:
        try:
            where = launch.where(args)
        except GradAccumError as exc:
            error = str(exc)
    where, error = launch.shared((where, error))
    if error is not None or where is None:
        raise TrainError(str(error))
    return where
