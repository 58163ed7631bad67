"""``gradaccum accept``: the main job. Verify, measure, decide, and write the run folder.

Exit codes: 0 when a verdict was reached on correct arithmetic (ADOPT or KEEP BASELINE alike: an
honest "not faster" is a result, not a failure); 1 when an equivalence check failed (the accumulated
update does not match the full batch) or, with ``--require-adopt``, when the verdict is not ADOPT;
2 for bad input, e.g. baseline and candidate at different global batches.
"""

from __future__ import annotations

import argparse
import contextlib

from rich.table import Table

from gradaccum.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    add_measure_options,
    console,
    escape,
    finish_launching,
    make_launching,
    mark,
    measure_settings,
    parse_plan,
    progress_bar,
    resolve_device,
    resolve_dp,
    rich_table,
    torchrun_leader,
    workload_spec,
)

DEFAULT_BASELINE, DEFAULT_CANDIDATE = "8x4", "4x8"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "accept",
        help="decide whether to adopt an accumulation change (the main job)",
        description="Accept or refuse a change of (micro-batch x accumulation) at a fixed global batch: "
        "float64 equivalence of both partitionings, production-precision traces, interleaved "
        "measurement (>= 3 runs each), a verdict with every criterion, and a run folder with the run "
        "card of the configuration to use. With no arguments: the bundled tiny GPT, 8x4 vs 4x8.",
    )
    p.add_argument(
        "--baseline", default=DEFAULT_BASELINE, help=f"MICROxACCUM in use (default {DEFAULT_BASELINE})"
    )
    p.add_argument(
        "--candidate", default=DEFAULT_CANDIDATE, help=f"MICROxACCUM proposed (default {DEFAULT_CANDIDATE})"
    )
    p.add_argument(
        "--margin", type=float, default=0.03, help="required median throughput gain (default 0.03)"
    )
    p.add_argument("--trace-steps", type=int, default=8, help="updates in the trace comparison (default 8)")
    p.add_argument("--require-adopt", action="store_true", help="exit 1 unless the verdict is ADOPT")
    add_measure_options(p, steps=50)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradaccum.bench.accept import AcceptSpec, check_equivalence, run_accept
    from gradaccum.bench.report import comm_rows, memory_rows, time_rows
    from gradaccum.bench.runfolder import new_run_folder, write_accept_folder
    from gradaccum.check.workload import load_workload
    from gradaccum.runcard import environment

    dp = resolve_dp(args.dp)
    device = resolve_device(args.device, dp)
    spec = AcceptSpec(  # refuses mismatched global batches before anything runs
        workload=workload_spec(args),
        baseline=parse_plan(args.baseline, dp),
        candidate=parse_plan(args.candidate, dp),
        margin=args.margin,
        trace_steps=args.trace_steps,
        settings=measure_settings(args, device),
    )
    workload = load_workload(spec.workload)
    # the checks run in this process before any process group exists (under torchrun too)
    status = "float64 equivalence of both partitionings, then production-precision traces"
    with console.status(status) if torchrun_leader() else contextlib.nullcontext():
        equivalence = check_equivalence(spec, workload)
    env = environment(device)
    launching = make_launching(dp, args.timeout)
    try:
        with progress_bar(args.progress and launching.leader) as on_progress:
            result = run_accept(
                spec,
                launching.launch,
                workload=workload,
                environment=env,
                equivalence=equivalence,
                on_progress=on_progress,
            )
    finally:
        finish_launching(launching)
    code = EXIT_OK
    if not result.equivalence_passed or (args.require_adopt and not result.verdict.adopt):
        code = EXIT_FAILED
    if not launching.leader:
        return code
    folder = new_run_folder(args.out_dir, "accept")
    write_accept_folder(result, folder)

    b, c = spec.baseline, spec.candidate
    console.print(
        f"baseline {b.label()} vs candidate {c.label()} on {escape(spec.workload)}: global batch "
        f"{b.global_batch} ({b.equation()}; {c.equation()}); precision {spec.settings.precision}; "
        f"device {device}; torch threads per worker: {spec.settings.threads or 'default'}"
    )
    arms = [result.baseline, result.candidate]
    console.print(rich_table("throughput and phase times (medians of runs)", time_rows(arms)))
    console.print(rich_table("peak memory and gradient all-reduces", memory_rows(arms)))
    console.print(
        rich_table("communication per update", comm_rows([result.baseline, result.candidate], result.comm))
    )
    verdict = Table(title="criteria")
    for col in ("criterion", "figure", "result"):
        verdict.add_column(col)
    for crit in result.verdict.criteria:
        verdict.add_row(crit.name, crit.figure, mark(crit.passed))
    console.print(verdict)
    colour = "green" if result.verdict.adopt else "yellow"
    chosen = result.card.plan
    console.print(
        f"[bold {colour}]{result.verdict.decision}[/bold {colour}]: run card records {chosen.label()} "
        f"({chosen.equation()})"
    )
    if not result.equivalence_passed:
        console.print("[red]the equivalence checks failed: the accumulated update is wrong, not slow[/red]")
    console.print(f"run folder: {escape(str(folder))}")
    return code
