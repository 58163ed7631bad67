"""``gradaccum scan``: what in a workload's model and loss changes under accumulation, statically."""

from __future__ import annotations

import argparse

from gradaccum.cli.common import (
    Flag,
    add_command,
    add_flags,
    add_workload_option,
    console,
    escape,
    int_at_least,
    render_findings,
    workload_spec,
)
from gradaccum.errors import PlanError


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "scan",
        "list the layers and losses that break exact accumulation",
        "Scan a workload's model for what changes under accumulation (BatchNorm, random "
        "layers, MoE routers, declared batch-coupled losses), with figures and fixes. Static: "
        "`gradaccum verify` is the empirical check.",
        _add_options,
        run,
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    add_workload_option(p)
    add_flags(
        p,
        Flag(
            "--accum-steps",
            "K",
            int_at_least(1),
            "micro-batches per optimizer step (default: the workload's batch / micro-batch)",
        ),
        Flag("--micro-batch", "N", int_at_least(1), "examples per forward (default: the workload's)"),
    )
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when a finding breaks equivalence (default: exit 0)"
    )


def run(args: argparse.Namespace) -> int:
    from gradaccum.check.workload import load_workload
    from gradaccum.hazards.scanner import scan

    workload = load_workload(workload_spec(args))
    micro = args.micro_batch if args.micro_batch is not None else workload.micro_batch
    if args.accum_steps is not None:
        k = args.accum_steps
    elif workload.batch_size % micro == 0:
        k = workload.batch_size // micro
    else:
        raise PlanError(
            f"--micro-batch {micro} does not divide the batch of {workload.batch_size} examples of "
            f"workload {workload.name!r}, so the accumulation steps are not implied; give --accum-steps"
        )
    model = workload.build_model()
    findings = scan(
        model, k, micro_batch=micro, declared_hazards=workload.declared_hazards, loss_fn=workload.loss_fn
    )
    params = sum(p.numel() for p in model.parameters())
    console.print(
        f"scan of {escape(workload.name)} ({type(model).__name__}, {params:,} parameters): "
        f"accum_steps {k} x micro_batch {micro} = {k * micro} examples per step per replica"
    )
    render_findings(findings)
    breaking = [f for f in findings if f.breaks_equivalence]
    if breaking:
        count = f"{len(breaking)} finding breaks" if len(breaking) == 1 else f"{len(breaking)} findings break"
        console.print(
            f"{count} equivalence: the accumulated update will not be the full-batch one. Measure it: "
            f"gradaccum verify --workload {escape(args.workload)}"
        )
        if "in-batch-negatives" in workload.declared_hazards:
            console.print(
                "for the in-batch negatives: step with gradaccum.CachedAccumulator, and check that it "
                f"is exact with gradaccum verify --workload {escape(args.workload)} --cached"
            )
    else:
        console.print("nothing found that breaks equivalence; verify is still the check that proves it")
    return 1 if (args.strict and breaking) else 0
