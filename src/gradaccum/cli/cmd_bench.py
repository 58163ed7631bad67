"""``gradaccum bench``: measure every factorization of a fixed global batch.

Also the home of what ``accept`` shares with it beyond its options (those are in
:mod:`gradaccum.cli.args`): device and launcher choice (a fresh local process group per run, or,
under torchrun, one worker per launched rank), the progress bar and the tables.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gradaccum.bench.report import comm_rows, fmt_bytes, memory_rows, time_rows
from gradaccum.bench.runner import TORCHRUN_VARIABLES, Launch, run_isolated, run_joined
from gradaccum.bench.spec import MeasureSpec, RunRecord
from gradaccum.bench.sweep import ProgressEvent, SweepSpec, run_sweep
from gradaccum.check.workload import load_workload
from gradaccum.cli.args import add_measure_options, measure_settings, parse_plan, parse_size
from gradaccum.cli.render import console
from gradaccum.errors import BenchError, PlanError

EXIT_OK, EXIT_FAILED = 0, 1


def resolve_device(name: str, dp: int) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; refuses what cannot run."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", name):
        raise BenchError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {name} was asked for but torch sees no CUDA device; use --device cpu")
    if name.startswith("cuda:") and dp > 1:
        raise BenchError(
            f"--device {name} names one GPU but dp={dp} ranks each need their own; use --device cuda "
            "(rank r runs on cuda:LOCAL_RANK)"
        )
    return name


@dataclass(frozen=True)
class Launching:
    """Where runs go: a local process group per run, or one worker per torchrun rank."""

    launch: Launch
    dp: int
    rank: int
    joined: bool

    @property
    def leader(self) -> bool:
        """The rank that prints and writes the run folder."""
        return self.rank == 0


def torchrun_leader() -> bool:
    """Whether this process prints: rank 0 under torchrun, always otherwise."""
    return int(os.environ.get("RANK", "0")) == 0


def torchrun_world() -> int:
    """Ranks launched by torchrun (``WORLD_SIZE``), 1 when not launched by it."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_dp(requested: int | None) -> int:
    world = torchrun_world()
    if world > 1 and requested is not None and requested != world:
        raise PlanError(
            f"--dp {requested} but torchrun launched {world} ranks; under torchrun every rank is a "
            f"data-parallel replica, so --dp must be {world} (or left out)"
        )
    dp = requested if requested is not None else world
    if dp < 1:
        raise PlanError(f"--dp must be a positive integer, got {dp}")
    return dp


def make_launching(dp: int, timeout_s: float) -> Launching:
    """Runs in fresh local worker processes, or under torchrun one worker per launched rank."""
    # a worker forms its own process group: it must not inherit a launcher's rendezvous settings
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    if torchrun_world() <= 1:
        return Launching(lambda spec, r: run_isolated(spec, r, timeout_s=timeout_s, env=env), dp, 0, False)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")  # for coordination only
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def launch(spec: MeasureSpec, r: int) -> RunRecord:
        return run_joined(spec, r, master_addr=master, local_rank=local_rank, timeout_s=timeout_s, env=env)

    return Launching(launch, dp, dist.get_rank(), True)


def finish_launching(launching: Launching) -> None:
    """Tear down the coordination group that :func:`make_launching` set up under torchrun."""
    if launching.joined:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[ProgressEvent], None] | None]:
    """A rich progress bar on stderr (stdout stays clean for --json); ``None`` when disabled."""
    if not enabled:
        yield None
        return
    err = Console(stderr=True, emoji=False, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("runs", total=None)

        def on_progress(event: ProgressEvent) -> None:
            label = f"{event.spec.label} run {event.run_index + 1}"
            if event.record is None:
                bar.update(task, total=event.total, completed=event.done, description=f"measuring {label}")
                return
            bar.update(task, completed=event.done)
            if not event.record.ok:
                first = (event.record.error or "").strip().splitlines()
                # a worker's error text is not markup: "[...]" or ":b:" in it are printed as they are
                detail = escape(first[0] if first else "")
                bar.console.print(f"[yellow]{escape(label)}: {event.record.status}[/yellow] {detail}")

        yield on_progress


def rich_table(title: str, table: tuple[list[str], list[list[str]]]) -> Table:
    headers, rows = table
    out = Table(title=title)
    for i, h in enumerate(headers):
        out.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure every micro-batch x accumulation factorization of a global batch",
        description="At a fixed global batch, measure each (micro-batch, accumulation) configuration "
        "R times, interleaved, each run in a fresh process: throughput, phase times, peak memory, "
        "all-reduces. Fits the memory model and prints the communication model beside the measurements.",
    )
    p.add_argument("--global-batch", type=int, default=16, help="examples per optimizer update (default 16)")
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated MICROxACCUM list (default: every factorization of the global batch)",
    )
    p.add_argument(
        "--memory-budget", default=None, help="e.g. 2GiB: report the largest micro-batch that fits"
    )
    p.add_argument("--json", action="store_true", help="also print results.json to stdout")
    add_measure_options(p, steps=20)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradaccum.bench.runfolder import new_run_folder, write_sweep_folder

    dp = resolve_dp(args.dp)
    device = resolve_device(args.device, dp)
    plans = None
    if args.configs:
        plans = tuple(parse_plan(t, dp) for t in args.configs.split(",") if t.strip())
    spec = SweepSpec(
        workload=args.workload,
        global_batch=args.global_batch,
        dp=dp,
        plans=plans,
        settings=measure_settings(args, device),
        memory_budget_bytes=parse_size(args.memory_budget) if args.memory_budget else None,
    )
    # workers import the workload themselves; loading it here first turns a workload that cannot load
    # into exit 2 naming the problem, before any worker is spawned or the run folder is made
    load_workload(spec.workload)
    launching = make_launching(dp, args.timeout)
    try:
        with progress_bar(args.progress and launching.leader) as on_progress:
            result = run_sweep(spec, launching.launch, on_progress=on_progress)
    finally:
        finish_launching(launching)
    code = EXIT_OK if any(c.ok for c in result.configs) else EXIT_FAILED
    if not launching.leader:
        return code
    folder = new_run_folder(args.out_dir, "bench")
    write_sweep_folder(result, folder)
    if args.json:
        print((folder / "results.json").read_text(encoding="utf-8"), end="")
        return code
    mm = result.memory_model
    predictions = [None if mm is None else mm.predict(c.spec.micro_batch) for c in result.configs]
    console.print(
        f"global batch {spec.global_batch} = micro-batch x dp {dp} x accumulation; runs per configuration: "
        f"{spec.settings.runs}, interleaved, a fresh process each; precision {spec.settings.precision}; "
        f"device {device}; torch threads per worker: {spec.settings.threads or 'default'}"
    )
    console.print(rich_table("throughput and phase times (medians of runs)", time_rows(result.configs)))
    console.print(
        rich_table("peak memory and gradient all-reduces", memory_rows(result.configs, predictions))
    )
    if mm is None:
        console.print(f"memory model: none ({result.memory_model_note})")
    else:
        console.print(
            f"memory model ({mm.kind}): peak = {fmt_bytes(mm.persistent_bytes)} + "
            f"{fmt_bytes(mm.per_example_bytes)} x micro_batch (rms residual {fmt_bytes(mm.residual_bytes)})"
        )
        if spec.memory_budget_bytes is not None:
            largest = result.largest_fitting_micro_batch
            plan = result.largest_fitting_plan
            console.print(
                f"budget {fmt_bytes(spec.memory_budget_bytes)}: "
                + (
                    "the model sets no limit"
                    if largest is None
                    else f"largest micro-batch that fits: {largest}"
                )
                + f"; largest factorization that fits: {plan.label() if plan else 'none'}"
            )
    console.print(
        rich_table(
            "communication per update: naive k x G, deferred 1 x G", comm_rows(result.configs, result.comm)
        )
    )
    console.print(f"run folder: {escape(str(folder))}")
    return code
