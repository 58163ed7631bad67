"""``gradaccum accept``: the main job. Verify, measure, decide, and write the run folder.

Exit codes: 0 when a verdict was reached on correct arithmetic (ADOPT or KEEP BASELINE alike: an
honest "not faster" is a result, not a failure); 1 when an equivalence check failed (the accumulated
update does not match the full batch) or, with ``--require-adopt``, when the verdict is not ADOPT;
2 for bad input, e.g. baseline and candidate at different global batches; 3 when the verdict is
INCONCLUSIVE (the measurement's noise is larger than it could decide; the report says how many runs
would resolve it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from rich.table import Table

from gradaccum.cli.common import (
    EXIT_FAILED,
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    Flag,
    add_command,
    add_flags,
    add_measure_options,
    console,
    escape,
    int_at_least,
    make_launching,
    mark,
    measure_settings,
    measuring,
    number_above,
    parse_plan,
    parse_size,
    refuse_what_cannot_fit,
    resolve_device,
    resolve_dp,
    rich_table,
    torchrun_leader,
    workload_spec,
)
from gradaccum.cli.heartbeat import Heartbeat
from gradaccum.errors import BenchError, PlanError
from gradaccum.plan import BatchPlan
from gradaccum.step.config import SCALINGS

if TYPE_CHECKING:  # --help imports no torch
    from pathlib import Path

    from gradaccum.bench.accept import AcceptResult, AcceptSpec

DEFAULT_BASELINE, DEFAULT_CANDIDATE = "8x4", "4x8"


def _norm(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number (0 turns clipping off), got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"expected a finite number >= 0 (0 turns clipping off), got {text!r}"
        )
    return None if value == 0 else value


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "accept",
        "decide whether to adopt an accumulation change (the main job)",
        "Accept or refuse a change of (micro-batch x accumulation) at a fixed global batch: "
        "float64 equivalence of both partitionings (with a denominator audit), production-precision "
        "traces, memory from the tensors, paired throughput runs (>= 3, both configurations in one "
        "process, alternating in blocks), a verdict with every criterion and a confidence interval "
        "(ADOPT, KEEP BASELINE or INCONCLUSIVE), and a run folder with the run card of the "
        "configuration to use. With no arguments: the bundled tiny GPT, 8x4 vs 4x8. Exit codes: 0 a "
        "verdict, 1 an equivalence check failed, 2 bad input, 3 inconclusive. Each arm may also set "
        "its gradient scaling (--baseline-scaling, --candidate-scaling: pre or post), so that "
        "pre- and post-scaling are compared as two candidates.",
        _add_options,
        run,
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    add_flags(
        p,
        Flag("--baseline", None, None, f"MICROxACCUM in use (default {DEFAULT_BASELINE})", DEFAULT_BASELINE),
        Flag(
            "--candidate",
            None,
            None,
            f"MICROxACCUM proposed (default {DEFAULT_CANDIDATE}); the same plan and scaling as the baseline "
            "checks the noise",
        ),
        Flag(
            "--candidate-max-tokens",
            "N",
            int_at_least(1),
            "instead of --candidate: micro-batches by a token budget of N (gradaccum.split_by_tokens: "
            "sorted by length, at most N tokens each, balanced across ranks) at the baseline's global batch; "
            "N = the baseline's micro-batch x the longest row bounds the same activations (default: none)",
        ),
    )
    scaling = (
        "gradient scaling: pre (count the window before its first backward) or post (stream it, scale "
        "the gradients once after it); default pre"
    )
    p.add_argument("--baseline-scaling", choices=SCALINGS, default="pre", help=f"the baseline's {scaling}")
    p.add_argument(
        "--candidate-scaling",
        choices=SCALINGS,
        default="pre",
        help=f"the candidate's {scaling}. post with --candidate equal to --baseline compares the two "
        "modes at one plan",
    )
    add_flags(
        p,
        Flag(
            "--margin",
            None,
            number_above(0.0, inclusive=True),
            "required median throughput gain (default 0.03 = 3%%)",
            0.03,
        ),
        Flag(
            "--trace-steps",
            None,
            int_at_least(1),
            "updates in the production-precision trace comparison (default 8)",
            8,
        ),
        Flag(
            "--block-updates",
            None,
            int_at_least(1),
            "updates per block of a paired run; --steps / this many blocks alternate (default 5)",
            5,
        ),
        Flag(
            "--max-grad-norm",
            None,
            _norm,
            "clip each update's gradient as training will (default 1.0, as gradaccum train; 0: off)",
            1.0,
        ),
        Flag(
            "--max-consecutive-skips",
            None,
            int_at_least(1),
            "the skip limit training will use, recorded in the run card (default 10)",
            10,
        ),
        Flag(
            "--memory-budget",
            None,
            None,
            "e.g. 2GiB: name the largest micro-batch that fits, or why none can (default: none)",
        ),
    )
    q = p.add_argument_group(
        "quality run",
        "train baseline and candidate from several seeds and compare their final evaluation loss "
        "(the representative quality run; needed when scan finds BatchNorm, random layers or MoE)",
    )
    add_flags(
        q,
        Flag(
            "--quality-steps",
            "N",
            int_at_least(1),
            "train each configuration N updates per seed with production settings (default: no quality run)",
        ),
        Flag(
            "--seeds",
            "S",
            int_at_least(2),
            "seeds per configuration of the quality run, from --seed on (default 3; an interval needs 2)",
            3,
        ),
        Flag(
            "--quality-eval-examples",
            "N",
            int_at_least(1),
            "held-out examples of each quality run's final evaluation (default 64)",
            64,
        ),
    )
    p.add_argument("--require-adopt", action="store_true", help="exit 1 unless the verdict is ADOPT")
    add_measure_options(p, steps=50, min_runs=3)


def run(args: argparse.Namespace) -> int:
    # plain, flushed progress lines when stdout is a log or a pipe (the spinner draws nothing there)
    with Heartbeat("accept", enabled=not console.is_terminal and torchrun_leader()) as beat:
        return _run(args, beat)


def _run(args: argparse.Namespace, beat: Heartbeat) -> int:
    """Flags -> :class:`AcceptSpec` -> checks here, measurements in fresh processes -> the quality
    run -> the run folder -> the tables and the verdict."""
    from gradaccum.bench.accept import check_equivalence, run_accept
    from gradaccum.bench.runfolder import new_run_folder, write_accept_folder
    from gradaccum.check.workload import load_workload
    from gradaccum.runcard import environment

    dp = resolve_dp(args.dp)
    device = resolve_device(args.device, dp)
    spec = _accept_spec(args, dp, device)
    settings = spec.settings
    beat.stage("loading the workload and estimating its memory")
    workload = load_workload(spec.workload)
    # a token-budget candidate's plan is the whole window: the budget, not it, bounds the activations
    fixed = [spec.baseline] + ([spec.candidate] if spec.candidate_max_tokens is None else [])
    refuse_what_cannot_fit(workload, fixed, settings.precision, device, check=True)
    # the checks run in this process before any process group exists (under torchrun too)
    status = "float64 equivalence of both partitionings, then production-precision traces"
    beat.stage(status)
    with console.status(status) if torchrun_leader() else contextlib.nullcontext():
        equivalence = check_equivalence(spec, workload)
    beat.stage(f"measuring: 2 memory probes and {settings.runs} paired runs, each a fresh process")
    env = environment(device)
    launching = make_launching(dp, args.timeout)
    with measuring(launching, progress=args.progress, beat=beat) as on_progress:
        result = run_accept(
            spec,
            launching.launch,
            workload=workload,
            environment=env,
            equivalence=equivalence,
            on_progress=on_progress,
        )
    verdict = result.verdict
    code = EXIT_OK
    if not result.equivalence_passed or (args.require_adopt and not verdict.adopt):
        code = EXIT_FAILED
    elif verdict.inconclusive:
        code = EXIT_INCONCLUSIVE
    if not launching.leader:
        return code
    folder = new_run_folder(args.out_dir, "accept")
    result = _with_quality_run(result, workload, folder, beat)
    beat.stage("writing the run folder (report, plots)")
    write_accept_folder(result, folder)
    beat.stage("done")
    _render(result, device, folder)
    return code


def _candidate(args: argparse.Namespace, dp: int) -> BatchPlan:
    """The candidate's plan: --candidate, or with --candidate-max-tokens one window of the
    baseline's global batch as rows per rank."""
    if args.candidate_max_tokens is None:
        return parse_plan(args.candidate or DEFAULT_CANDIDATE, dp)
    if args.candidate is not None:
        raise PlanError(
            f"--candidate {args.candidate} and --candidate-max-tokens {args.candidate_max_tokens} each name "
            "the candidate: give one of them"
        )
    baseline = parse_plan(args.baseline, dp)
    return BatchPlan(micro_batch=baseline.global_batch // dp, accum_steps=1, dp=dp)


def _accept_spec(args: argparse.Namespace, dp: int, device: str) -> AcceptSpec:
    """The protocol the flags describe; refuses mismatched global batches and too-short runs
    before anything runs."""
    from gradaccum.bench.accept import AcceptSpec

    settings = dataclasses.replace(measure_settings(args, device), max_grad_norm=args.max_grad_norm)
    spec = AcceptSpec(
        workload=workload_spec(args),
        baseline=parse_plan(args.baseline, dp),
        candidate=_candidate(args, dp),
        margin=args.margin,
        trace_steps=args.trace_steps,
        settings=settings,
        block_updates=args.block_updates,
        max_consecutive_skips=args.max_consecutive_skips,
        memory_budget_bytes=parse_size(args.memory_budget) if args.memory_budget else None,
        quality_steps=args.quality_steps,
        quality_seeds=args.seeds,
        quality_eval_examples=args.quality_eval_examples,
        baseline_scaling=args.baseline_scaling,
        candidate_scaling=args.candidate_scaling,
        candidate_max_tokens=args.candidate_max_tokens,
    )
    if spec.settings.runs < 3:
        raise BenchError(f"--runs must be at least 3 (the protocol's minimum), got {spec.settings.runs}")
    return spec


def _with_quality_run(result: AcceptResult, workload: Any, folder: Path, beat: Heartbeat) -> AcceptResult:
    """With ``--quality-steps``: both arms trained from several seeds, after the measurements and
    on this process alone (train needs no process group here)."""
    from gradaccum.bench.accept import with_quality
    from gradaccum.bench.quality import run_quality

    quality_spec = result.spec.quality_spec()
    if quality_spec is None:
        return result
    with console.status("quality run") as spinner:

        def on_run(arm: str, seed: int, done: int, total: int) -> None:
            spinner.update(f"quality run {done + 1}/{total}: {arm} seed {seed}")
            beat.stage(f"quality run {done + 1}/{total}: {arm} seed {seed}")

        quality = run_quality(
            quality_spec, folder / "quality", workload=workload, reasons=result.quality_reasons, on_run=on_run
        )
    return with_quality(result, quality)


def _candidate_equation(spec: AcceptSpec) -> str:
    c, budget = spec.candidate, spec.candidate_max_tokens
    if budget is None:
        return c.equation()
    return f"{c.global_batch} rows over dp {c.dp} in micro-batches of at most {budget} tokens"


def _render(result: AcceptResult, device: str, folder: Path) -> None:
    """The measurements, the criteria and the verdict, on the console."""
    from gradaccum.bench.report import (
        comm_rows,
        memory_lines,
        memory_rows,
        phase_lines,
        quality_table,
        time_rows,
        verdict_lines,
    )

    spec, settings, verdict = result.spec, result.spec.settings, result.verdict
    b = spec.baseline
    clip = "off" if settings.max_grad_norm is None else f"{settings.max_grad_norm:g}"
    console.print(
        f"baseline {spec.label_of('baseline')} vs candidate {spec.label_of('candidate')} on "
        f"{escape(spec.workload)}: global batch "
        f"{b.global_batch} ({b.equation()}; {_candidate_equation(spec)}); precision {settings.precision}; "
        "clipping at "
        f"{clip}; device {device}; torch threads per worker: {settings.threads or 'default'}"
    )
    console.print(
        f"throughput: {settings.runs} paired runs, each alternating the two in blocks of "
        f"{spec.block_updates} updates ({spec.blocks} blocks each, after {settings.warmup} warm-up updates)"
    )
    arms = [result.baseline, result.candidate]
    console.print(rich_table("throughput and phase times (medians of runs)", time_rows(arms)))
    for line in phase_lines(arms):
        console.print(escape(line))
    console.print(
        rich_table("memory (from the tensors; CUDA peaks where present) and all-reduces", memory_rows(arms))
    )
    for line in memory_lines(result.memory_model, "no memory figures", result.budget_advice):
        console.print(escape(line))
    console.print(rich_table("communication per update", comm_rows(arms, result.comm)))
    table = Table(title="criteria")
    for col in ("criterion", "figure", "result"):
        table.add_column(col)
    for crit in verdict.criteria:
        table.add_row(crit.name, escape(crit.figure), mark(crit.passed))
    console.print(table)
    colour = {"ADOPT": "green", "INCONCLUSIVE": "yellow"}.get(verdict.decision, "yellow")
    first, *rest = verdict_lines(result)
    console.print(f"[bold {colour}]{escape(first)}[/bold {colour}]")
    for line in rest:
        console.print(escape(line))
    if not result.equivalence_passed:
        console.print("[red]the equivalence checks failed: the accumulated update is wrong, not slow[/red]")
    for reason in result.quality_reasons:
        console.print(f"[yellow]quality:[/yellow] {escape(reason)}")
    if result.quality is not None:
        console.print(
            rich_table("quality run: final evaluation loss over seeds", quality_table(result.quality))
        )
        console.print(escape(result.quality.describe()))
    elif result.quality_reasons:
        console.print(
            "[yellow]a representative quality run is needed[/yellow]: add --quality-steps N --seeds 3"
        )
    console.print(f"run folder: {escape(str(folder))}")
