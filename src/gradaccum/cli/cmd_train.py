"""``gradaccum train``: train with exact accumulation on one process, or many under torchrun.

    gradaccum train --steps 40                                  # the bundled tiny GPT, defaults
    gradaccum train --global-batch 64 --micro-batch 8 --schedule-clock tokens
    gradaccum train --runcard runs/accept-.../runcard.json      # exactly what accept verified
    torchrun --nproc_per_node 2 -m gradaccum train --fsdp       # DDP by default, FSDP2 with --fsdp
    gradaccum train --resume runs/train-...                     # continue from the latest checkpoint

This module is the only training code that reads environment variables (torchrun's RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), installs signal handlers (SIGUSR1: checkpoint at the
next boundary; SIGTERM / first Ctrl-C: checkpoint and stop there) and prints (rank 0 only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradaccum.cli.common import (
    DEFAULT_WORKLOAD,
    EXIT_FAILED,
    EXIT_OK,
    add_data_options,
    console,
    escape,
    workload_spec,
)
from gradaccum.distributed import dist
from gradaccum.errors import PlanError, TooManySkipsError, TrainError
from gradaccum.plan import BatchPlan

if TYPE_CHECKING:
    from rich.progress import Progress

    from gradaccum.train.config import TrainConfig
    from gradaccum.train.loop import TrainControl, TrainResult
    from gradaccum.train.records import StepRecord, TrainEvent, TrainStart

DEFAULT_GLOBAL_BATCH, DEFAULT_MICRO_BATCH, DEFAULT_STEPS = 32, 8, 200
# flags a run card fixes; given explicitly beside --runcard they are refused, not silently ignored
CARD_FLAGS = ("workload", "global_batch", "micro_batch", "precision", "seed", "max_grad_norm")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train with exact accumulation (one process, or DDP/FSDP2 under torchrun)",
        description="Train a workload with exact gradient accumulation. Every flag has a default that "
        "fits the bundled tiny GPT; under torchrun the same command runs data-parallel.",
    )
    what = p.add_argument_group("what to train")
    what.add_argument(
        "--workload",
        metavar="MODULE:FUNCTION",
        help=f"or hf:MODEL_DIR with --data (default {DEFAULT_WORKLOAD})",
    )
    what.add_argument("--runcard", type=Path, help="train exactly the plan/precision/accum of this run card")
    what.add_argument(
        "--global-batch", type=int, help=f"examples per optimizer step (default {DEFAULT_GLOBAL_BATCH})"
    )
    what.add_argument(
        "--micro-batch", type=int, help=f"examples per forward pass (default {DEFAULT_MICRO_BATCH})"
    )
    what.add_argument(
        "--precision", choices=("float32", "bfloat16", "float16", "float64"), help="(default float32)"
    )
    what.add_argument("--seed", type=int, help="data stream and dropout seed (default 0)")
    length = p.add_argument_group("how long")
    length.add_argument("--steps", type=int, help=f"optimizer boundaries to train (default {DEFAULT_STEPS})")
    length.add_argument("--tokens", type=int, help="stop once this many valid tokens were consumed")
    opt = p.add_argument_group("optimizer and schedule")
    opt.add_argument("--optimizer", choices=("adamw", "sgd", "workload"), default="adamw")
    opt.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    opt.add_argument("--weight-decay", type=float, default=0.0)
    opt.add_argument(
        "--max-grad-norm", type=float, help="clip the accumulated gradient (default 1.0; 0: off)"
    )
    opt.add_argument(
        "--max-consecutive-skips", type=int, default=10, help="stop after this many skips in a row"
    )
    opt.add_argument(
        "--noise-scale",
        action="store_true",
        help="estimate the gradient noise scale B_simple (the critical batch) from the micro-batches; "
        "logged per step and in the summary and run card; the update is unchanged",
    )
    opt.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    opt.add_argument(
        "--schedule-clock",
        choices=("steps", "tokens"),
        default="steps",
        help="advance the schedule per applied optimizer step or per consumed valid token",
    )
    opt.add_argument("--warmup", type=int, help="warmup in clock units (default 10%% of the horizon)")
    opt.add_argument("--horizon", type=int, help="where the cosine ends, in clock units (default: the run)")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor / peak (default 0.1)")
    where = p.add_argument_group("run")
    where.add_argument(
        "--device", default="auto", help="auto, cpu, cuda (default auto: cuda:LOCAL_RANK if any)"
    )
    where.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    where.add_argument("--run-dir", type=Path, help="run folder (default runs/train-<timestamp>)")
    where.add_argument("--resume", type=Path, help="a checkpoint folder or run folder to continue from")
    where.add_argument(
        "--checkpoint-every", type=int, help="checkpoint every N boundaries (default: end only)"
    )
    where.add_argument("--keep-checkpoints", type=int, default=2)
    where.add_argument("--eval-every", type=int, help="evaluate every N boundaries (default: never)")
    where.add_argument("--eval-examples", type=int, default=64)
    add_data_options(p)
    p.set_defaults(func=run)


# -- building the config -----------------------------------------------------------------------


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _plan_and_card(args: argparse.Namespace, world: int) -> tuple[BatchPlan, dict[str, Any]]:
    """The plan (solved against --global-batch, or the card's) and the settings the card fixes."""
    from gradaccum.runcard import read_runcard
    from gradaccum.step.config import AccumConfig

    if args.runcard is None:
        plan = BatchPlan.solve(
            global_batch=_given(args.global_batch, DEFAULT_GLOBAL_BATCH),
            micro_batch=_given(args.micro_batch, DEFAULT_MICRO_BATCH),
            dp=world,
        )
        max_norm = _given(args.max_grad_norm, 1.0)
        try:
            accum = AccumConfig(
                max_grad_norm=max_norm if max_norm != 0 else None,  # 0 turns clipping off
                track_grad_norm=True,
                max_consecutive_skips=args.max_consecutive_skips,
                noise_scale=args.noise_scale,
            )
        except ValueError as exc:
            raise TrainError(f"--max-grad-norm / --max-consecutive-skips: {exc}") from exc
        fixed = {
            "workload": _given(args.workload, DEFAULT_WORKLOAD),
            "precision": _given(args.precision, "float32"),
            "seed": _given(args.seed, 0),
            "accum": accum,
        }
        return plan, fixed
    given = [f"--{name.replace('_', '-')}" for name in CARD_FLAGS if getattr(args, name) is not None]
    if given:
        raise PlanError(f"--runcard fixes {', '.join(given)}; drop them, or train without the card")
    card = read_runcard(args.runcard)
    if card.plan.dp != world:
        raise PlanError(
            f"run card {args.runcard} was verified with dp={card.plan.dp} ({card.plan.equation()}), but "
            f"this job has {world} process(es). Launch with torchrun --nproc_per_node {card.plan.dp}, or "
            "verify a plan for this world size."
        )
    # track_grad_norm and noise_scale only add figures to the records; they do not change the update
    fixed = {
        "workload": card.workload,
        "precision": card.precision,
        "seed": card.seed,
        "accum": replace(
            card.accum, track_grad_norm=True, noise_scale=card.accum.noise_scale or args.noise_scale
        ),
    }
    return card.plan, fixed


def _build_config(args: argparse.Namespace, world: int, device: torch.device, run_dir: Path) -> TrainConfig:
    from gradaccum.train.config import TrainConfig
    from gradaccum.train.schedule import ScheduleConfig

    plan, fixed = _plan_and_card(args, world)
    steps = args.steps if args.steps is not None or args.tokens is not None else DEFAULT_STEPS
    return TrainConfig(
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
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        precision=fixed["precision"],
        accum=fixed["accum"],
        seed=fixed["seed"],
        device=str(device),
        fsdp=args.fsdp,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        eval_every=args.eval_every,
        eval_examples=args.eval_examples,
        resume=args.resume,
    )


# -- process group, device, run folder, signals -----------------------------------------------


def _device(choice: str) -> torch.device:
    """The training device; under torchrun ``cuda`` means ``cuda:LOCAL_RANK``."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(choice)
    except RuntimeError as exc:
        raise TrainError(
            f"--device {choice!r} is not a device ({exc}); use auto, cpu, cuda or cuda:N"
        ) from exc
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


def _run_dir(args: argparse.Namespace) -> Path:
    """The run folder, decided on rank 0 and shared, so every rank checkpoints into the same one."""
    from gradaccum.train.checkpoint import resolve_checkpoint

    if args.run_dir is not None:
        mine = args.run_dir
    elif args.resume is not None:
        mine = resolve_checkpoint(args.resume).parent.parent
    else:
        mine = Path("runs") / time.strftime("train-%Y%m%d-%H%M%S")
    return Path(dist.all_gather_objects(str(mine))[0])


@contextlib.contextmanager
def _signals(control: TrainControl) -> Iterator[None]:
    """SIGUSR1: checkpoint at the next boundary. SIGTERM, first Ctrl-C: checkpoint there and stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_interrupt(signum: int, frame: Any) -> None:
        control.request_stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C interrupts at once

    handlers = {signal.SIGTERM: lambda s, f: control.request_stop(), signal.SIGINT: on_interrupt}
    if hasattr(signal, "SIGUSR1"):
        handlers[signal.SIGUSR1] = lambda s, f: control.request_checkpoint()
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- rendering ---------------------------------------------------------------------------------


class _Renderer:
    """Rank 0's view of the run: start banner, progress bar (or periodic lines), events, summary."""

    def __init__(self, config: TrainConfig, args: argparse.Namespace) -> None:
        self.config = config
        self.args = args
        self.steps: list[StepRecord] = []
        self.progress: Progress | None = None
        self.task: Any = None
        self.every = max(1, (config.steps or 100) // 10)
        self.tokens, self.seconds = 0, 0.0

    def __call__(self, event: TrainEvent) -> None:
        from gradaccum.train.records import CheckpointRecord, EvalRecord, StepRecord, TrainStart

        if isinstance(event, TrainStart):
            self._start(event)
        elif isinstance(event, StepRecord):
            self._step(event)
        elif isinstance(event, EvalRecord):
            self._print(
                f"eval at step {event.step}: loss {_fmt(event.eval_loss)} over {event.eval_tokens:,} tokens"
            )
        elif isinstance(event, CheckpointRecord):
            self._print(f"checkpoint ({event.reason}) after {event.window} boundaries: {escape(event.path)}")

    def _print(self, text: str) -> None:
        (self.progress.console if self.progress is not None else console).print(text)

    def _start(self, start: TrainStart) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        cfg = self.config
        if self.args.runcard is not None:
            checked = f" (from run card {escape(str(self.args.runcard))})"
        else:
            checked = f" (checked against --global-batch {cfg.plan.global_batch})"
        console.print(f"batch equation: {start.equation}{checked}")
        sched = start.schedule
        per_step = max(start.tokens_per_step, 1)
        if sched["clock"] == "steps":
            warmup_steps, warmup_tokens = float(sched["warmup"]), sched["warmup"] * per_step
        else:
            warmup_steps, warmup_tokens = sched["warmup"] / per_step, sched["warmup"]
        layout = ", FSDP2" if cfg.fsdp else ", DDP" if start.world > 1 else ""
        console.print(
            f"{start.world} process(es) on {start.device}, precision {cfg.precision}{layout}; "
            f"workload {escape(cfg.workload)}"
        )
        console.print(
            f"schedule: {sched['kind']}, clock {sched['clock']}, warmup {sched['warmup']:,} and horizon "
            f"{sched['horizon']:,} {sched['clock']}; peak lr {cfg.lr:g}; ~{start.tokens_per_step:,} valid "
            f"tokens per step; skipped updates: {sched['skipped_updates']}"
        )
        if sched["clock"] == "steps":
            keeps = f"{warmup_steps:,.0f} steps (~{warmup_tokens:,.0f} valid tokens at this global batch)"
            moves = "a larger global batch keeps the steps and adds tokens"
        else:
            keeps = f"{warmup_tokens:,} valid tokens (~{warmup_steps:,.1f} steps at this global batch)"
            moves = "a larger global batch keeps the tokens and takes fewer steps"
        console.print(f"warmup: {keeps}; {moves}")
        if start.resumed_from:
            console.print(f"resumed from {escape(start.resumed_from)} at boundary {start.start_window}")
        if start.checkpoint_schedule is not None:
            was = start.checkpoint_schedule
            console.print(
                f"[yellow]note:[/yellow] the checkpoint's schedule was {was['kind']}, clock {was['clock']}, "
                f"warmup {was['warmup']:,}, horizon {was['horizon']:,}; from here the learning rate follows "
                "this run's"
            )
        console.print(f"run folder: {escape(start.run_dir)}")
        if console.is_terminal:
            self.progress = Progress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "loss {task.fields[loss]}  {task.fields[tps]} tok/s  skipped {task.fields[skipped]}"
                ),
                TimeElapsedColumn(),
                console=console,
            )
            total = start.total_windows if start.total_windows is not None else None
            self.task = self.progress.add_task(
                "train", total=total, completed=start.start_window, loss="-", tps="-", skipped=0
            )
            self.progress.start()

    def _step(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.tokens += record.window_tokens
        self.seconds += record.step_time_ms / 1e3
        rate = f"{self.tokens / self.seconds if self.seconds else 0.0:,.0f}"  # since start: less noisy
        if self.progress is not None:
            self.progress.update(
                self.task,
                completed=record.window + 1,
                loss=_fmt(record.loss),
                tps=rate,
                skipped=record.skipped,
            )
        elif (record.window + 1) % self.every == 0 or not record.applied:
            note = "" if record.applied else f"  SKIPPED: {escape(record.skip_reason or '')}"
            console.print(
                f"step {record.window + 1}: loss {_fmt(record.loss)}  lr {record.lr:.3g}  "
                f"tokens {record.tokens:,}  {rate} tok/s{note}"
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, result: TrainResult) -> None:
        from gradaccum.train.loop import RUNCARD_FILE
        from gradaccum.train.records import LOSS_PNG, METRICS_FILE

        losses = [r.loss for r in self.steps if r.loss is not None and r.applied]
        p = result.progress
        if losses:
            head, tail = losses[: min(5, len(losses))], losses[-min(5, len(losses)) :]
            console.print(
                f"start loss {statistics.fmean(head):.4f} -> end loss {statistics.fmean(tail):.4f} "
                f"(means of the first and last {len(tail)} updates; "
                f"first {losses[0]:.4f}, last {losses[-1]:.4f})"
            )
        if result.eval_loss is not None:
            console.print(f"eval loss {result.eval_loss:.4f}")
        if result.critical_batch is not None:
            console.print(escape(result.critical_batch))
        console.print(
            f"{result.stopped}: {p.windows} boundaries, {p.steps_applied} updates applied, {p.steps_skipped} "
            f"skipped; {p.tokens_consumed:,} tokens consumed; {result.tokens_per_s:,.0f} tok/s"
            + (f"; loss scale {result.loss_scale:g}" if result.loss_scale is not None else "")
        )
        run_dir = result.run_dir
        console.print(
            escape(
                f"records: {run_dir / RUNCARD_FILE}, {run_dir / METRICS_FILE}, {run_dir / LOSS_PNG}"
                + (f"; checkpoint {result.checkpoints[-1]}" if result.checkpoints else "")
            )
        )
        if result.stopped != "completed" and result.checkpoints:
            console.print(
                escape(f"resume with: gradaccum train --resume {result.checkpoints[-1]} (same flags)")
            )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def run(args: argparse.Namespace) -> int:
    from gradaccum.train.loop import TrainControl, train

    workload_spec(args)  # --workload hf:MODEL_DIR --data FILE ... as one spec, in args.workload
    device = _device(args.device)
    created = _init_distributed(device)
    try:
        world, rank = dist.world_size(), dist.rank()
        config = _build_config(args, world, device, _run_dir(args))
        control = TrainControl()
        renderer = _Renderer(config, args) if rank == 0 else None
        try:
            with _signals(control):
                result = train(config, control=control, on_event=renderer)
        except TooManySkipsError as exc:
            if renderer is not None:
                renderer.close()
                print(f"gradaccum train: training stopped: {exc}", file=sys.stderr)
            return EXIT_FAILED
        finally:
            if renderer is not None:
                renderer.close()
        if renderer is not None:
            renderer.summary(result)
        return EXIT_OK
    finally:
        if created and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
