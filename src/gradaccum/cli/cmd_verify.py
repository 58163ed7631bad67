"""``gradaccum verify``: the equivalence acceptance check on any importable workload.

Stage 1 compares one accumulated update with the full-batch update in full precision; when it
passes, stage 2 compares loss and gradient-norm traces of both partitionings in production
precision. Exit 0 when every stage that ran passed, 1 when one failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.table import Table

from gradaccum.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Flag,
    add_command,
    add_flags,
    add_run_settings,
    add_workload_option,
    console,
    escape,
    int_at_least,
    mark,
    mesh_under_torchrun,
    render_findings,
    workload_spec,
)
from gradaccum.errors import ConfigError, PlanError
from gradaccum.names import HF_PREFIX, MAX_TRACE_STEPS, TRACE_DTYPES, VERIFY_DTYPES

if TYPE_CHECKING:
    import torch

    from gradaccum.check.balance import BalanceReport
    from gradaccum.check.mesh import MeshReport
    from gradaccum.check.packed import PackedReport
    from gradaccum.check.report import EquivalenceReport, TraceReport
    from gradaccum.check.workload import Workload
    from gradaccum.hazards.scanner import Finding
    from gradaccum.workloads.balance import BalanceChoice

WORST_SHOWN = 5


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sizes takes comma-separated positive integers such as 1,3,4; got {text!r}"
        ) from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes must all be positive integers, got {text!r}")
    return sizes


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "verify",
        "check that the accumulated update equals the full-batch update",
        "Run the same examples as one full batch and as micro-batches through "
        "Accumulator.step; compare gradients before clipping and parameters after one update "
        "(full precision), then loss and gradient-norm traces over a few steps (production "
        "precision). Exit 0 pass, 1 fail, 2 bad input.",
        _add_options,
        run,
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    add_workload_option(p)
    cut = p.add_mutually_exclusive_group()
    add_flags(
        cut,
        Flag(
            "--micro-batch",
            "N",
            int_at_least(1),
            "examples per micro-batch; must divide the batch (default: the workload's)",
        ),
        Flag(
            "--sizes",
            "A,B,...",
            _sizes,
            "an explicit partition, e.g. 1,3,4 (default: none, equal micro-batches of --micro-batch)",
        ),
    )
    _add_renamed_precision(
        p, "--check-precision", "--dtype", VERIFY_DTYPES, "float64", "precision of the stage-1 diagnostic"
    )
    add_flags(
        p,
        Flag(
            "--trace-steps",
            "N",
            int_at_least(0),
            f"optimizer steps in the stage-2 trace comparison, at most {MAX_TRACE_STEPS}; 0 skips it "
            "(default 5)",
            5,
        ),
    )
    _add_renamed_precision(
        p,
        "--precision",
        "--trace-dtype",
        TRACE_DTYPES,
        "float32",
        "production precision of stage 2, as --precision of train, bench and accept",
    )
    p.add_argument(
        "--cached",
        action="store_true",
        help="run the accumulated side through CachedAccumulator (gradient caching), using the "
        "workload's extras encode_fn and rep_loss_fn; for in-batch-negative losses",
    )
    p.add_argument(
        "--packed",
        action="store_true",
        help="the packed check instead: the workload's documents packed and padded must give the same "
        "update under token and document normalization (hf: workloads, or extras['documents'])",
    )
    add_flags(
        p,
        Flag(
            "--mesh",
            "NAME=SIZE,...",
            None,
            "under torchrun: check on a device mesh, e.g. dp_shard=2,tp=2 (data and tensor parallel "
            "dimensions; the workload declares parallelize(model, mesh)) against one micro-batch per rank "
            "and one process's full batch (default: no mesh)",
        ),
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the candidate's model (in place, torch's default backend) in stage 1 and "
        "check it against the eager full-batch update; stage 2 runs eager",
    )
    p.add_argument("--device", default="cpu", help="where to run, e.g. cuda:0 (default cpu)")
    add_flags(p, Flag("--seed", None, int_at_least(0), "initialization/data seed", 0))
    add_run_settings(p, "verify")


def _add_renamed_precision(
    p: argparse.ArgumentParser, name: str, earlier: str, choices: Sequence[str], default: str, help: str
) -> None:
    """A precision option ``name`` that still answers to its ``earlier`` name, which also stays the
    attribute's name (``--dtype``: ``args.dtype``), so that commands written with it keep working."""
    dest = earlier.removeprefix("--").replace("-", "_")
    help = f"{help} (default {default}; {earlier} is the same flag)"
    p.add_argument(name, earlier, dest=dest, choices=choices, default=default, help=help)


def _check_partition(workload: Workload, micro: int | None, sizes: list[int] | None) -> None:
    """Refuse a partition that does not cover the workload's batch, naming the CLI's options."""
    n = workload.batch_size
    if sizes is not None and sum(sizes) != n:
        raise PlanError(
            f"--sizes {','.join(map(str, sizes))} sums to {sum(sizes)}, but workload {workload.name!r} "
            f"verifies on a batch of {n} examples; give sizes summing to {n}"
        )
    if sizes is None and micro is not None and n % micro:
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        example = ",".join(str(min(micro, n - i)) for i in range(0, n, micro))
        raise PlanError(
            f"--micro-batch {micro} does not divide the batch of {n} examples of workload "
            f"{workload.name!r} and no partition was given; use a divisor of {n} ({divisors}) or an "
            f"explicit partition such as --sizes {example}"
        )


def _render_report(report: EquivalenceReport, workload: Workload, seed: int) -> None:
    counts = ", ".join(str(c) for c in report.counts)
    console.print(
        f"[bold]stage 1[/bold]: one update in {report.dtype} on {report.device}: {sum(report.sizes)} "
        f"examples as micro-batches {list(report.sizes)} through {escape(report.candidate)}, against "
        f"the whole batch in one forward/backward"
    )
    unit = escape(workload.unit)
    console.print(
        f"  {unit} counted per micro-batch of the verification batch ({sum(report.sizes)} examples, seed "
        f"{seed}): {counts} (N = {report.global_count} {unit})"
    )
    table = Table(show_edge=False)
    for column in ("check", "error", "tolerance", "result"):
        table.add_column(column, justify="left" if column == "check" else "right")
    table.add_row(
        "gradients before clipping (max relative L2 per parameter)",
        f"{report.grad_max_rel_err:.2e}",
        str(report.grad_tol),
        mark(report.grad_passed),
    )
    table.add_row(
        "parameters after one optimizer update (max absolute)",
        f"{report.param_max_abs_diff:.2e}",
        str(report.param_tol),
        mark(report.param_passed),
    )
    audit = report.audit_summary
    audited = [a for a in report.audit if a.status != "not audited"]
    figure = ""
    if audited and len(audited) == len(report.audit):
        expected = sum(a.expected or 0 for a in audited)
        figure = f"{expected} counted, {sum(a.used or 0 for a in audited)} used"
    verdict = (
        "[red]FAIL[/red]"
        if any(a.status == "mismatch" for a in report.audit)
        else ("[green]PASS[/green]" if audit.startswith("consistent") else "[dim]n/a[/dim]")
    )
    table.add_row(
        "denominator audit (count_fn against the output positions the loss uses)",
        figure,
        "equal" if figure else "",
        verdict,
    )
    console.print(table)
    console.print(f"  denominator: {escape(audit)}")
    worst = Table(title="worst parameters", show_edge=False)
    for column in ("parameter", "gradient rel err", "parameter abs diff"):
        worst.add_column(column, justify="left" if column == "parameter" else "right")
    for row in report.worst[:WORST_SHOWN]:
        worst.add_row(escape(row.name), f"{row.grad_rel_err:.2e}", f"{row.param_abs_diff:.2e}")
    console.print(worst)
    console.print(f"  gradient tolerance: {escape(report.grad_tol.reason)}")
    console.print(f"  parameter tolerance: {escape(report.param_tol.reason)}")
    if report.disabled:
        console.print(
            "  randomness switched off for the check (probabilities set to 0, restored afterwards): "
            + escape(", ".join(report.disabled))
        )
    if report.buffer_max_abs_diff:
        console.print(
            f"  running statistics differ by up to {report.buffer_max_abs_diff:.2e} after the step "
            "(buffers are not part of the check, which is about the update)"
        )
    # the scan's closing note points at verify, which is what is running: leave it out here
    findings = [f for f in report.findings if f.code != "verify"]
    heading = f"  scan for accum_steps={len(report.sizes)}"
    if findings:
        console.print(f"{heading}:")
        render_findings(findings, details=False)
    else:
        compiled = report.candidate.endswith("(compiled model)")
        read = " (the compiled forwards' source read too)" if compiled else ""
        console.print(f"{heading}: no layer or loss that couples examples found{read}")


def weak_reasons(report: EquivalenceReport, workload: Workload) -> list[str]:
    """Why a passing check proves less than it seems: what it could not have seen, and why."""
    reasons = []
    counts = report.counts
    if len(counts) > 1 and len(set(counts)) == 1:
        reasons.append(
            f"every micro-batch counts the same number of {workload.unit} ({counts[0]:,}): a mean of means "
            "weighs them equally too, so this check cannot see a weighting error; give it micro-batches "
            "of uneven counts (--sizes, or data whose rows differ in length)"
        )
    rows = workload.extras.get("train_rows")
    spec = workload.extras.get("spec")
    if isinstance(rows, int) and spec is not None and getattr(spec, "data", None):
        from gradaccum.workloads.hf import repeats

        repeated = repeats(rows, sum(report.sizes), spec.data)
        if repeated is not None:
            reasons.append(
                f"the verification {repeated}: copies of one row in different micro-batches count the "
                "same, so uneven weighting cannot show; use a file with more rows (documents)"
            )
    return reasons


def _verdict(passed: bool, causes: Sequence[str]) -> str:
    """PASS, or FAIL with its causes on the same line (each names the check and its figure)."""
    if passed:
        return mark(True)
    return mark(False) + (f" ({escape('; '.join(causes))})" if causes else "")


def _settled(
    report: EquivalenceReport, cached: bool, choice: BalanceChoice | None, balance: BalanceReport | None
) -> tuple[Finding, ...]:
    """The scan's findings settled by what this command ran and measured (:mod:`gradaccum.check.findings`):
    no error line beside a PASS, and what gradaccum's own path handles said so."""
    from gradaccum.check.findings import settle_findings

    passed = report.passed and (balance is None or balance.passed)
    figure = f"gradient max rel err {report.grad_max_rel_err:.2e}, tol {report.grad_tol}"
    return settle_findings(
        report.findings,
        passed=passed,
        figure=figure,
        cached=cached,
        balance_mode=None if choice is None else choice.mode,
        balance=balance,
    )


def _fmt(x: float) -> str:
    return "skipped" if math.isnan(x) else f"{x:.6g}"


def _render_trace(trace: TraceReport) -> None:
    base, cand = list(trace.baseline_sizes), list(trace.candidate_sizes)
    console.print(
        f"[bold]stage 2[/bold]: {trace.steps} optimizer steps in {trace.dtype} on {trace.device}, "
        f"same weights and batches (seeds {trace.seed}..{trace.seed + trace.steps - 1}): "
        f"{base} against {cand}"
    )
    table = Table(show_edge=False)
    for column in ("step", f"loss {base}", f"loss {cand}", f"grad norm {base}", f"grad norm {cand}"):
        table.add_column(escape(column), justify="right")
    for step in range(trace.steps):
        table.add_row(
            str(step),
            _fmt(trace.baseline_loss[step]),
            _fmt(trace.candidate_loss[step]),
            _fmt(trace.baseline_grad_norm[step]),
            _fmt(trace.candidate_grad_norm[step]),
        )
    console.print(table)
    console.print(
        f"  loss max rel diff {trace.loss_max_rel_diff:.2e}, gradient-norm max rel diff "
        f"{trace.grad_norm_max_rel_diff:.2e}, tolerance {trace.tol}: {_verdict(trace.passed, trace.failures)}"
    )
    console.print(f"  trace tolerance: {escape(trace.tol.reason)}")
    for line in trace.skipped:
        console.print(f"  [yellow]skipped[/yellow] {escape(line)}")


def run(args: argparse.Namespace) -> int:
    import torch

    from gradaccum.check.equivalence import compare_traces, verify_workload
    from gradaccum.check.workload import load_workload
    from gradaccum.precision import dtype_of

    if args.trace_steps > MAX_TRACE_STEPS:
        raise PlanError(
            f"--trace-steps {args.trace_steps} is longer than the {MAX_TRACE_STEPS}-step window the "
            f"trace tolerances are declared for; use at most {MAX_TRACE_STEPS}"
        )
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or (device.type == "cuda" and not torch.cuda.is_available()):
        why = "is not a device (cpu, cuda, cuda:0)" if device is None else "names CUDA, but none is available"
        raise ConfigError(f"--device {args.device!r} {why}")
    workload = load_workload(workload_spec(args))
    if args.workload.startswith(HF_PREFIX) and "float64" in (args.dtype, args.trace_dtype):
        from gradaccum.workloads.experts import eager_experts

        workload, note = eager_experts(workload)  # the fused expert kernels take no float64
        if note is not None:
            console.print(escape(note))
    if args.mesh is not None:
        return _run_mesh(args, workload, device)
    if args.packed:
        return _run_packed(args, workload, device)
    _check_partition(workload, args.micro_batch, args.sizes)
    candidate = None
    if args.cached:
        from gradaccum.cache.candidate import cached_candidate_for

        candidate = cached_candidate_for(workload)
    console.print(f"[bold]verify {escape(workload.name)}[/bold]: {escape(workload.description)}")
    report = verify_workload(
        workload,
        micro_batch=args.micro_batch,
        sizes=args.sizes,
        dtype=dtype_of(args.dtype),
        device=device,
        seed=args.seed,
        candidate_step=candidate,
        compile=args.compile,
    )
    balance = None
    choice = None
    if not args.cached:  # an MoE model: the balance train would run, and how far the modes are
        from gradaccum.check.balance import verify_balance
        from gradaccum.workloads.balance import choose_balance

        _, choice = choose_balance(workload.build_model(), args.balance)
        if choice is not None and not (choice.mode == "off" and choice.given):
            # the exact term against the full batch's objective (what --balance exact trains; under
            # the default's "off" it is what --balance exact would add), and the others from it
            balance = verify_balance(
                workload, micro_batch=args.micro_batch, sizes=args.sizes, dtype=dtype_of(args.dtype),
                device=device, seed=args.seed,
            )  # fmt: skip
    report = dataclasses.replace(report, findings=_settled(report, args.cached, choice, balance))
    _render_report(report, workload, args.seed)
    if choice is not None:
        console.print(escape(choice.describe()))
    if balance is not None:
        console.print(escape(balance.summary()))
    trace = None
    if args.cached and args.trace_steps:
        console.print("[bold]stage 2[/bold]: not run with --cached (the trace comparison drives Accumulator)")
    elif args.trace_steps and report.passed:
        trace = compare_traces(
            workload,
            baseline_sizes=[sum(report.sizes)],
            candidate_sizes=report.sizes,
            steps=args.trace_steps,
            dtype=dtype_of(args.trace_dtype),
            seed=args.seed,
            device=device,
        )
        _render_trace(trace)
    elif args.trace_steps:
        console.print("[bold]stage 2[/bold]: not run, because stage 1 failed")
    if args.trace_dtype in ("bfloat16", "float16"):
        _render_precision(workload, report.sizes, args.trace_dtype, args.seed)
    passed = report.passed and (trace is None or trace.passed) and (balance is None or balance.passed)
    weak = weak_reasons(report, workload) if passed else []
    for reason in weak:
        console.print(f"[yellow]weak check[/yellow]: {escape(reason)}")
    causes = [f"stage 1: {c}" for c in report.failures]
    causes += list(balance.failures if balance is not None else ())
    causes += [f"stage 2: {c}" for c in (trace.failures if trace is not None else ())]
    console.print(
        f"[bold]verdict[/bold]: {_verdict(passed, causes)}" + (" (a weak check: see above)" if weak else "")
    )
    console.print(f"  stage 1: {escape(report.summary())}")
    if trace is not None:
        console.print(f"  stage 2: {escape(trace.summary())}")
    if report.likely_causes:
        console.print("[bold]likely causes[/bold]:")
        for cause in report.likely_causes:
            console.print(f"  - {escape(cause)}")
        breaking = [f for f in report.findings if f.breaks_equivalence]
        if breaking:
            console.print(f"  details and fixes: gradaccum scan --workload {escape(args.workload)}")
    elif trace is not None and not trace.passed:
        console.print(
            "  stage 1 passed but the traces diverged beyond the tolerance: look for rounding that "
            "compounds (a large learning rate, loss spikes) or for state that differs between the runs"
        )
    return EXIT_OK if passed else EXIT_FAILED


def _render_precision(
    workload: Workload, sizes: tuple[int, ...] | list[int], precision: str, seed: int
) -> None:
    """The accumulation error at the user's k beside k = 1, with the parameters themselves in the
    low precision (pure bf16/fp16 models; autocast keeps float32 gradients): informational."""
    from gradaccum.check.accumulation import precision_report
    from gradaccum.precision import dtype_of

    k = len(sizes)
    if len(set(sizes)) != 1:
        console.print("[bold]accumulation precision[/bold]: not measured (unequal micro-batches)")
        return
    found = precision_report(
        workload.build_model(),
        workload.batch(seed),
        workload.loss_fn,
        workload.count_fn,
        accum_steps=k,
        dtype=dtype_of(precision),
    )
    console.print(
        "[bold]accumulation precision[/bold] (parameters cast to the precision; not part of the verdict)"
    )
    for line in found.lines():
        console.print(f"  {escape(line)}")


def _run_mesh(args: argparse.Namespace, workload: Workload, device: torch.device) -> int:
    """verify --mesh under torchrun: every rank checks, rank 0 prints (see gradaccum.check.mesh)."""

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gradaccum.check.mesh import verify_on_mesh

    shape = mesh_under_torchrun("verify", args.mesh)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
        report = verify_on_mesh(workload, mesh, micro_batch=args.micro_batch)
        if dist.get_rank() == 0:
            console.print(f"[bold]verify --mesh {escape(report.mesh)}[/bold] on {escape(workload.name)}")
            console.print(
                f"  {report.micro_batches} micro-batches per data rank, N = {report.global_count}\n"
                f"  accumulated vs one micro-batch per rank: {report.accumulated_vs_one_pass:.1e}\n"
                f"  accumulated vs one process, full batch:  {report.accumulated_vs_single_process:.1e}\n"
                f"  tolerance {report.tolerance:.0e}: {_mesh_verdict(report)}"
            )
            if report.weakness is not None:
                console.print(f"  [yellow]weak check:[/yellow] {escape(report.weakness)}")
    finally:
        dist.destroy_process_group()
    return EXIT_OK if report.passed else EXIT_FAILED


def _run_packed(args: argparse.Namespace, workload: Workload, device: torch.device) -> int:
    from gradaccum.check.packed import verify_packed_workload
    from gradaccum.precision import dtype_of

    given = [flag for flag, value in (("--sizes", args.sizes), ("--micro-batch", args.micro_batch)) if value]
    if args.cached:
        given.append("--cached")
    if given:
        raise PlanError(
            f"--packed cuts the packed and the padded rows into uneven micro-batches of its own (their "
            f"row counts differ); leave out {', '.join(given)}"
        )
    console.print(f"[bold]verify --packed {escape(workload.name)}[/bold]: {escape(workload.description)}")
    report = verify_packed_workload(workload, dtype=dtype_of(args.dtype), device=device, seed=args.seed)
    _render_packed(report)
    return EXIT_OK if report.passed else EXIT_FAILED


def _render_packed(report: PackedReport) -> None:
    console.print(f"  packed: {escape(report.packing)}")
    console.print(f"  padded: {escape(report.padding)}")
    table = Table(show_edge=False)
    for column in ("check", "error", "tolerance", "result"):
        table.add_column(column, justify="left" if column == "check" else "right")
    for label, sub in (("packed rows", report.packed), ("padded rows", report.padded)):
        counts = ", ".join(str(c) for c in sub.counts)
        table.add_row(
            f"{label}: micro-batches {list(sub.sizes)} ({sub.unit} {counts}) vs the full batch",
            f"{sub.grad_max_rel_err:.2e}",
            str(sub.grad_tol),
            mark(sub.passed) if sub.passed else _short_cause(sub),
        )
    expected = "same update expected" if report.expect_same else "a different update expected"
    table.add_row(
        f"packed vs padded, full batch ({report.normalization} normalization: {expected})",
        f"{report.layout_grad_max_rel_err:.2e}",
        str(report.layout_tol),
        mark(report.layouts_agree)
        if report.expect_same
        else "differ"
        if not report.layouts_agree
        else "agree",
    )
    console.print(table)
    console.print(
        f"  mean loss at the initial weights: packed {report.packed_loss:.6g}, "
        f"padded {report.padded_loss:.6g}"
    )
    console.print(f"  layout tolerance: {escape(report.layout_tol.reason)}")
    console.print(f"[bold]verdict[/bold]: {_verdict(report.passed, report.failures)}")
    console.print(f"  {escape(report.summary())}")
    if report.likely_causes:
        console.print("[bold]likely causes[/bold]:")
        for cause in report.likely_causes:
            console.print(f"  - {escape(cause)}")


def _short_cause(sub: EquivalenceReport) -> str:
    """A table cell for a failed layout: FAIL and the checks that failed, short enough for one line
    (the verdict's line gives their figures)."""
    names = {"the denominator": "denominator", "gradient": "gradients", "parameter": "parameters"}
    parts = [next((n for k, n in names.items() if c.startswith(k)), c) for c in sub.failures]
    return mark(False) + f" ({escape(', '.join(parts))})"


def _mesh_verdict(report: MeshReport) -> str:
    """PASS, or FAIL naming the error over the tolerance (or not finite)."""
    if report.passed:
        return "PASS"
    errors = (report.accumulated_vs_one_pass, report.accumulated_vs_single_process)
    worst = next(e for e in errors if not e <= report.tolerance)
    how = "over the tolerance" if math.isfinite(worst) else "a non-finite update"
    return f"FAIL ({how}: {worst:.1e})"
