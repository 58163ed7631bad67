"""Command-line options more than one subcommand takes, and the parsers of their values.

Argument types here raise :class:`argparse.ArgumentTypeError` (argparse reports it and exits 2);
parsers of whole values (a plan, a memory size) raise the library's errors, which ``main`` turns
into exit 2 naming the problem.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from gradaccum.bench.accept import DEFAULT_WORKLOAD
from gradaccum.bench.spec import MeasureSettings
from gradaccum.errors import BenchError, PlanError
from gradaccum.plan import BatchPlan
from gradaccum.precision import PRECISIONS

__all__ = [
    "DEFAULT_WORKLOAD",
    "add_measure_options",
    "add_workload_option",
    "default_threads",
    "int_at_least",
    "measure_settings",
    "parse_plan",
    "parse_size",
]

_PLAN = re.compile(r"\s*(\d+)\s*x\s*(\d+)\s*(?:x\s*(\d+))?\s*")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for integers ``>= low``: refused at parse time, naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def parse_plan(text: str, dp: int | None = None) -> BatchPlan:
    """``MICROxACCUM`` or ``MICROxDPxACCUM`` into a plan.

    With ``dp`` given (a run's data-parallel size), ``MICROxACCUM`` runs on ``dp`` replicas and a
    ``MICROxDPxACCUM`` must name that same ``dp``; without it, ``MICROxACCUM`` means one replica.
    """
    match = _PLAN.fullmatch(text)
    if not match:
        raise PlanError(
            f"a plan is written MICROxACCUM (e.g. 4x8) or MICROxDPxACCUM (e.g. 4x8x8), got {text!r}"
        )
    a, b, c = match.groups()
    if c is None:
        return BatchPlan(micro_batch=int(a), accum_steps=int(b), dp=1 if dp is None else dp)
    if dp is not None and int(b) != dp:
        raise PlanError(f"configuration {text} names dp={b} but the run has dp={dp}; pass --dp {b}")
    return BatchPlan(micro_batch=int(a), dp=int(b), accum_steps=int(c))


def parse_size(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5GB`` or plain bytes, into bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise BenchError(
            f"a memory size is a number with an optional unit (B, KiB, MiB, GiB, KB, MB, GB), got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def add_workload_option(p: argparse.ArgumentParser) -> None:
    """``--workload MODULE:FUNCTION``, defaulting to the bundled tiny GPT."""
    p.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        metavar="MODULE:FUNCTION",
        help=f"function returning a gradaccum.Workload (default {DEFAULT_WORKLOAD})",
    )


def add_measure_options(p: argparse.ArgumentParser, *, steps: int) -> None:
    """The options of ``bench`` and ``accept``: the workload, dp, how to measure, where to write."""
    add_workload_option(p)
    p.add_argument(
        "--dp", type=int, default=None, help="data-parallel replicas (default: torchrun's world, else 1)"
    )
    p.add_argument("--runs", type=int, default=3, help="runs per configuration, interleaved (default 3)")
    p.add_argument("--steps", type=int, default=steps, help=f"measured updates per run (default {steps})")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured updates per run (default 3)")
    p.add_argument("--precision", choices=PRECISIONS, default="float32", help="production precision")
    p.add_argument("--no-defer-sync", dest="defer_sync", action="store_false", help="sync every micro-batch")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (default auto)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per worker (default 1 on CPU, torch's on CUDA)",
    )
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size in MiB (default DDP's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    p.add_argument("--out-dir", type=Path, default=Path("runs"), help="where run folders go (default runs/)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def default_threads(requested: int | None, device: str) -> int | None:
    """One torch thread per CPU worker unless asked otherwise.

    Intra-op threads that wait on each other stall whenever another process holds a core: on a
    shared 2-core machine a 2-thread run of the tiny GPT spread over 10x between runs, a 1-thread
    run over 6-28%. A verdict with a 3% margin needs the second. ``--threads N`` measures more.
    """
    if requested is not None or device != "cpu":
        return requested
    return 1


def measure_settings(args: argparse.Namespace, device: str) -> MeasureSettings:
    """The settings :func:`add_measure_options` parsed; ``device`` already resolved from ``auto``."""
    return MeasureSettings(
        runs=args.runs,
        steps=args.steps,
        warmup=args.warmup,
        precision=args.precision,
        defer_sync=args.defer_sync,
        device=device,
        threads=default_threads(args.threads, device),
        bucket_cap_mb=args.bucket_cap_mb,
        seed=args.seed,
    )
