"""Argument types and the options the subcommands share: sizes, plans, meshes, output folders, the
workload and its data, and how to measure. Nothing imported at the top loads torch (the choices and
defaults come from :mod:`gradaccum.names`), so ``gradaccum CMD --help`` starts fast."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradaccum.errors import BenchError, ConfigError, PlanError, WorkloadError
from gradaccum.names import (
    DEFAULT_SEQ_LEN,
    DEFAULT_TEXT_FIELD,
    DEFAULT_WORKLOAD,
    HF_PREFIX,
    NORMALIZATIONS,
    PRECISIONS,
)
from gradaccum.plan import BatchPlan

if TYPE_CHECKING:
    from gradaccum.bench.spec import MeasureSettings

__all__ = [
    "Flag",
    "add_command",
    "add_data_options",
    "add_flags",
    "add_measure_options",
    "add_run_settings",
    "add_threads_option",
    "add_workload_option",
    "check_output_folder",
    "default_threads",
    "int_at_least",
    "measure_settings",
    "mesh_under_torchrun",
    "number_above",
    "output_folder",
    "parse_plan",
    "parse_size",
    "workload_spec",
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


def number_above(low: float, *, inclusive: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for finite numbers ``> low`` (``>= low`` with ``inclusive``): refused at
    parse time, naming the value."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above = value >= low if inclusive else value > low
        if not (above and value < float("inf")):
            sign = ">=" if inclusive else ">"
            raise argparse.ArgumentTypeError(f"expected a finite number {sign} {low:g}, got {text}")
        return value

    return parse


def output_folder(text: str) -> Path:
    """An argparse ``type`` for a folder to write into: refused at parse time when it is a file."""
    path = Path(text)
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{folder} is a file, not a folder; give a folder path")
        if folder.exists():
            break
    return path


def check_output_folder(path: Path, flag: str) -> None:
    """Refuse an output location that is a file (or under one) before any work starts."""
    for folder in (path, *path.parents):
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{flag} {path}: {folder} is a file, not a folder; give a folder path")
        if folder.exists():
            return


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
    names = ("MICRO", "ACCUM") if c is None else ("MICRO", "DP", "ACCUM")
    for name, value in zip(names, (a, b) if c is None else (a, b, c), strict=True):
        if int(value) < 1:
            raise PlanError(f"plan {text}: {name} must be at least 1, got {int(value)}")
    if c is None:
        return BatchPlan(micro_batch=int(a), accum_steps=int(b), dp=1 if dp is None else dp)
    if dp is not None and int(b) != dp:
        raise PlanError(f"configuration {text} names dp={b} but the run has dp={dp}; pass --dp {b}")
    return BatchPlan(micro_batch=int(a), dp=int(b), accum_steps=int(c))


def mesh_under_torchrun(command: str, mesh: str) -> dict[str, int]:
    """``--mesh NAME=SIZE,...`` for a command that runs on every rank of the mesh: its shape,
    checked against torchrun's world before any rank meets another (every rank exits, none waits)."""
    from gradaccum.mesh.layout import parse_mesh

    shape = parse_mesh(mesh)
    ranks = math.prod(shape.values())
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise PlanError(
            "--mesh runs on every rank of the mesh: launch it with torchrun, e.g. torchrun "
            f"--nproc-per-node {ranks} -m gradaccum {command} --mesh {mesh}"
        )
    if int(world) != ranks:
        raise PlanError(
            f"--mesh {mesh} has {ranks} ranks but torchrun started {world}; make --nproc-per-node x "
            "nodes equal the product of the mesh's sizes"
        )
    return shape


def parse_size(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5GB`` or plain bytes, into bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise BenchError(
            f"a memory size is a number with an optional unit (B, KiB, MiB, GiB, KB, MB, GB), got {text!r}"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class Flag:
    """An option that takes a value, as one row of a command's table of options (:func:`add_flags`):
    ``Flag("--steps", "N", int_at_least(1), "measured updates per run", 20)``. A ``None`` leaves
    argparse's own choice: the value kept as text (``type``), ``--steps STEPS`` in the usage
    (``metavar``), an unset option (``default``). Switches and choices stay ``add_argument`` calls."""

    name: str
    metavar: str | None
    type: Callable[[str], Any] | None
    help: str
    default: Any = None


def add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, *flags: Flag) -> None:
    """Declare ``flags`` on ``p`` in their order (the order ``--help`` lists them in)."""
    for flag in flags:
        parse: dict[str, Any] = {} if flag.type is None else {"type": flag.type}
        p.add_argument(flag.name, default=flag.default, metavar=flag.metavar, help=flag.help, **parse)


def add_run_settings(p: argparse.ArgumentParser | argparse._ArgumentGroup, command: str) -> None:
    """The flags of :data:`gradaccum.train.settings.RUN_SETTINGS` that ``command`` takes, one per
    row, ``dest`` the setting's name, unset ``None`` (the help says the default)."""
    from gradaccum.train.settings import RUN_SETTINGS  # torch-free

    for setting in RUN_SETTINGS:
        if command in setting.commands:
            p.add_argument(setting.flag, dest=setting.name, choices=setting.choices, help=setting.help)


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    help: str,
    description: str,
    add_options: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    """The subcommand ``name``: ``help`` is its line in ``gradaccum --help`` and ``description``
    heads its own; ``add_options`` declares its options and ``run(args)`` (the exit code) runs it."""
    p = subparsers.add_parser(name, help=help, description=description)
    add_options(p)
    p.set_defaults(func=run)


def add_workload_option(p: argparse.ArgumentParser) -> None:
    """``--workload MODULE:FUNCTION`` (or ``hf:MODEL_DIR``), defaulting to the bundled tiny GPT, and
    the data options of ``hf:`` workloads (:func:`add_data_options`)."""
    p.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        metavar="MODULE:FUNCTION",
        help=f"the function that returns a gradaccum.Workload (MODULE is imported from the current "
        f"directory or the import path), or hf:MODEL_DIR, a local transformers model folder, with "
        f"--data FILE (default {DEFAULT_WORKLOAD})",
    )
    add_data_options(p)


def add_threads_option(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, per: str) -> None:
    """``--threads N``: torch threads per ``per`` (worker, process); the same default everywhere."""
    help = f"torch intra-op threads per {per} (default 1 on CPU, torch's own on CUDA)"
    add_flags(p, Flag("--threads", "N", int_at_least(1), help))


def add_data_options(p: argparse.ArgumentParser) -> None:
    """``--data``, ``--text-field``, ``--seq-len``, ``--pack``, ``--normalization``: what an
    ``hf:MODEL_DIR`` workload trains or verifies on. :func:`workload_spec` folds them into the spec."""
    g = p.add_argument_group(
        "hf: workloads", "--workload hf:MODEL_DIR --data FILE: a local model folder and data file"
    )
    add_flags(
        g,
        Flag(
            "--data",
            "FILE",
            Path,
            ".txt (one document per line) or .jsonl (one JSON object per line) to read documents "
            "from (default: none; an hf: workload needs it)",
        ),
        Flag(
            "--text-field", "NAME", None, f"the .jsonl field holding the text (default {DEFAULT_TEXT_FIELD})"
        ),
        Flag(
            "--seq-len",
            "N",
            int_at_least(2),
            "tokens per row; longer documents are cut into documents of their own "
            f"(default {DEFAULT_SEQ_LEN}, or the model's max_position_embeddings if shorter)",
        ),
    )
    g.add_argument(
        "--pack",
        action="store_true",
        default=None,
        help="pack documents into rows, position_ids restarting per document (default: one padded "
        "document per row)",
    )
    g.add_argument(
        "--normalization",
        choices=NORMALIZATIONS,
        help="the loss's denominator: the window's tokens, the mean over rows of their token mean, or "
        "over documents of theirs (default token)",
    )


_DATA_FLAGS = {
    "data": "--data",
    "text_field": "--text-field",
    "seq_len": "--seq-len",
    "pack": "--pack",
    "normalization": "--normalization",
}


def workload_spec(args: argparse.Namespace) -> str:
    """``args.workload`` with the data options folded in, and written back into ``args``.

    ``--workload hf:MODEL_DIR --data FILE ...`` becomes one ``hf:`` spec with absolute paths, which
    worker processes, run cards and resumed runs carry as it is; a MODULE:FUNCTION workload is
    returned unchanged and refuses data options, which it would ignore. An unset ``--workload``
    (``train``'s ``None``) stays unset in ``args``; the default is returned.
    """
    from gradaccum.workloads.spec import HFSpec  # the workloads package loads torch

    spec: str | None = args.workload
    given = [flag for key, flag in _DATA_FLAGS.items() if getattr(args, key, None) is not None]
    if spec is None or not spec.startswith(HF_PREFIX):
        if given:
            raise WorkloadError(
                f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} the data of an hf: "
                "workload, but the workload is "
                f"{spec or DEFAULT_WORKLOAD}: use --workload hf:MODEL_DIR (a local transformers model "
                "folder), or leave them out (a MODULE:FUNCTION workload makes its own batches)"
            )
        return spec or DEFAULT_WORKLOAD
    if "?" in spec:  # already a whole spec (e.g. copied from a run card)
        if given:
            raise WorkloadError(
                f"workload {spec!r} already holds its data settings; give them either there or as "
                f"{', '.join(given)}, not both"
            )
        args.workload = HFSpec.parse(spec).with_absolute_paths().to_spec()
        return str(args.workload)
    if args.data is None:
        raise WorkloadError(
            f"workload {spec} needs a data file: add --data FILE (a local .txt, one document per line, "
            "or .jsonl, one JSON object per line)"
        )
    hf = HFSpec(
        model_dir=spec[len(HF_PREFIX) :],
        data=str(args.data),
        text_field=args.text_field if args.text_field is not None else DEFAULT_TEXT_FIELD,
        seq_len=args.seq_len,
        pack=bool(args.pack),
        normalization=args.normalization if args.normalization is not None else "token",
    )
    args.workload = hf.with_absolute_paths().to_spec()
    return str(args.workload)


def add_measure_options(p: argparse.ArgumentParser, *, steps: int, min_runs: int = 1) -> None:
    """The options of ``bench`` and ``accept``: the workload, dp, how to measure, where to write.
    ``min_runs``: the fewest runs the command can summarize (accept's interval needs 3)."""
    add_workload_option(p)
    add_flags(
        p,
        Flag("--dp", "N", int_at_least(1), "data-parallel replicas (default: torchrun's world size, else 1)"),
        Flag("--runs", "R", int_at_least(min_runs), "runs per configuration, interleaved", max(3, min_runs)),
        Flag("--steps", "N", int_at_least(1), "measured updates per run", steps),
        Flag("--warmup", "N", int_at_least(0), "unmeasured updates per run", 3),
    )
    p.add_argument("--precision", choices=PRECISIONS, default="float32", help="production precision")
    p.add_argument(
        "--no-defer-sync",
        dest="defer_sync",
        action="store_false",
        help="all-reduce gradients at every micro-batch instead of once per window (default: defer)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N; auto is cuda when present")
    add_threads_option(p, per="worker process")
    add_flags(
        p,
        Flag("--seed", None, int_at_least(0), "model and data seed", 0),
        Flag("--bucket-cap-mb", "MIB", number_above(0.0), "DDP bucket size in MiB (default DDP's, 25)"),
        Flag("--timeout", "S", number_above(0.0), "seconds one run may take", 600.0),
        Flag("--out-dir", None, output_folder, "where run folders go", Path("runs")),
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar (default: shown)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model (in place, before DDP; torch's default backend): bench measures "
        "every configuration eager and compiled, accept compiles both and its run card records it; "
        "compile time is reported apart from throughput",
    )


def default_threads(requested: int | None, device: str) -> int | None:
    """One torch thread per CPU worker unless asked otherwise.

    Intra-op threads that wait on each other stall whenever another process holds a core: on a
    shared 2-core machine a 2-thread run of the tiny GPT spread over 10x between runs, a 1-thread
    run over 6-28%. A verdict with a 3% margin needs the second. ``--threads N`` measures more.
    """
    if requested is not None or device != "cpu":
        return requested
    return 1


_MEASURE_FLAGS = ("runs", "steps", "warmup", "precision", "defer_sync", "bucket_cap_mb", "seed", "compile")
"""The flags of :func:`add_measure_options` that are :class:`MeasureSettings` fields of the same name."""


def measure_settings(args: argparse.Namespace, device: str) -> MeasureSettings:
    """The settings :func:`add_measure_options` parsed; ``device`` already resolved from ``auto``."""
    from gradaccum.bench.spec import MeasureSettings

    same = {name: getattr(args, name) for name in _MEASURE_FLAGS}
    balance = getattr(args, "balance", None)  # bench's --balance (gradaccum.train.settings.BALANCE)
    return MeasureSettings(
        **same, device=device, threads=default_threads(args.threads, device), balance=balance
    )
