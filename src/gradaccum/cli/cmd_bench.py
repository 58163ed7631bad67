"""``gradaccum bench``: measure every factorization of a fixed global batch, with activation
checkpointing and FSDP2 sharding as further dimensions, and advise for a memory budget."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from gradaccum.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    Flag,
    add_command,
    add_flags,
    add_measure_options,
    add_run_settings,
    check_output_folder,
    console,
    escape,
    int_at_least,
    make_launching,
    measure_settings,
    measuring,
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
from gradaccum.errors import PlanError

if TYPE_CHECKING:  # --help imports no torch
    from pathlib import Path

    from gradaccum.bench.sweep import SweepResult, SweepSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "bench",
        "measure every micro-batch x accumulation factorization of a global batch",
        "At a fixed global batch, measure each (micro-batch, accumulation) configuration "
        "R times, interleaved, each run in a fresh process: throughput, phase times, peak memory, "
        "all-reduces. Fits the memory model and prints the communication model beside the measurements.",
        _add_options,
        run,
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    add_flags(
        p,
        Flag("--global-batch", "G", int_at_least(1), "examples per optimizer update (default 16)", 16),
        Flag(
            "--configs",
            "MICROxACCUM,...",
            None,
            "comma-separated configurations to measure (default: every factorization of the global batch)",
        ),
        Flag(
            "--max-tokens",
            "N,...",
            None,
            "comma-separated token budgets: measure each as one more row at the same global batch, "
            "its micro-batches cut by gradaccum.split_by_tokens (sorted by length, at most N tokens each, "
            "balanced across ranks) beside the fixed ones; a budget of micro-batch x the longest row bounds "
            "activations as that micro-batch does (default: none)",
        ),
        Flag(
            "--memory-budget",
            "SIZE",
            None,
            "e.g. 6GiB per rank: advise the fastest measured row that fits it, say why in one sentence, "
            "and write its run card; with --mesh, the sync policy with the least communication whose "
            "gradients held fit it (default: no budget)",
        ),
        Flag(
            "--checkpointing",
            "MODES",
            None,
            "comma-separated activation checkpointing modes to measure each configuration with: none, "
            "full (every repeated block: nn.ModuleList members, or the workload's "
            "extras['checkpoint_blocks']); default none",
            "none",
        ),
        Flag(
            "--sharding",
            "KINDS",
            None,
            "comma-separated: ddp (replicas), fsdp2 (fully_shard; needs --dp 2+, measured with sync "
            "deferred and on every micro-batch); default ddp",
            "ddp",
        ),
        Flag(
            "--mesh",
            "NAME=SIZE,...",
            None,
            "under torchrun: measure the HSDP sync policies (defer, defer_replicate, every) on a device "
            "mesh, e.g. dp_replicate=2,dp_shard=2 or dp_shard=2,tp=2 (the workload declares "
            "parallelize(model, mesh)): calls and bytes per update per mesh dimension beside the model, "
            "gradient memory held, and with --memory-budget the policy to use (default: no mesh, the sweep)",
        ),
        Flag(
            "--accum-steps",
            "K",
            int_at_least(2),
            "with --mesh: micro-batches per update on every data rank (default 4)",
            4,
        ),
    )
    p.add_argument("--json", action="store_true", help="also print results.json to stdout (default: tables)")
    add_measure_options(p, steps=20)
    add_run_settings(p, "bench")


def _modes(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def run(args: argparse.Namespace) -> int:
    if args.mesh is not None:
        from gradaccum.cli.bench_mesh import run_mesh

        return run_mesh(args)
    # plain, flushed progress lines when stdout is a log or a pipe (never into --json's output)
    enabled = not console.is_terminal and not args.json and torchrun_leader()
    with Heartbeat("bench", enabled=enabled) as beat:
        return _run(args, beat)


def _run(args: argparse.Namespace, beat: Heartbeat) -> int:
    """Flags -> :class:`SweepSpec` -> the sweep (worker processes) -> the run folder -> the tables."""
    from gradaccum.bench.checkpointing import check_checkpointing, checkpoint_blocks
    from gradaccum.bench.runfolder import new_run_folder, write_sweep_folder
    from gradaccum.bench.sweep import run_sweep
    from gradaccum.check.workload import load_workload
    from gradaccum.runcard import environment
    from gradaccum.workloads.balance import choose_balance

    check_output_folder(args.out_dir, "--out-dir")
    dp = resolve_dp(args.dp)
    device = resolve_device(args.device, dp)
    spec = _sweep_spec(args, dp, device)
    # workers import the workload themselves; loading it here first turns a workload that cannot load
    # (or a plan that cannot fit) into exit 2 naming the problem, before any worker is spawned
    beat.stage("loading the workload and estimating its memory")
    workload = load_workload(spec.workload)
    fixed = [s.plan for s in spec.measure_specs() if s.max_tokens is None]
    refuse_what_cannot_fit(workload, fixed, spec.settings.precision, device, check=False)
    _, balance = choose_balance(workload.build_model(), spec.settings.balance)  # as each worker will
    if balance is not None:  # the mode decided once, measured by every worker and recorded
        spec = dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, balance=balance.mode))
        if torchrun_leader() and not args.json:
            console.print(escape(balance.describe()))
    check = None
    if "full" in spec.checkpointing:
        checkpoint_blocks(workload, workload.build_model())  # no blocks to checkpoint: exit 2 now
        check = check_checkpointing(workload, seed=spec.settings.seed, device=device)
    launching = make_launching(dp, args.timeout)
    with measuring(launching, progress=args.progress, beat=beat) as on_progress:
        result = run_sweep(
            spec,
            launching.launch,
            on_progress=on_progress,
            environment=environment(device),
            checkpointing_check=check,
        )
    code = EXIT_OK if any(c.ok for c in result.configs) else EXIT_FAILED
    if check is not None and not check.passed:
        code = EXIT_FAILED
    if not launching.leader:
        return code
    folder = new_run_folder(args.out_dir, "bench")
    beat.stage("writing the run folder (report, plots)")
    write_sweep_folder(result, folder)
    beat.stage("done")
    if args.json:
        print((folder / "results.json").read_text(encoding="utf-8"), end="")
    else:
        _render(result, device, folder)
    return code


def _sweep_spec(args: argparse.Namespace, dp: int, device: str) -> SweepSpec:
    """The sweep the flags describe."""
    from gradaccum.bench.sweep import SweepSpec

    plans = None
    if args.configs:
        plans = tuple(parse_plan(t, dp) for t in args.configs.split(",") if t.strip())
        if not plans:
            raise PlanError(f"--configs {args.configs!r} names no configuration; give e.g. --configs 8x1,4x2")
    return SweepSpec(
        workload=workload_spec(args),
        global_batch=args.global_batch,
        dp=dp,
        plans=plans,
        settings=measure_settings(args, device),
        memory_budget_bytes=parse_size(args.memory_budget) if args.memory_budget else None,
        checkpointing=_modes(args.checkpointing),
        sharding=_modes(args.sharding),
        compile=(False, True) if args.compile else (False,),
        max_tokens=_budgets(args.max_tokens),
    )


def _budgets(text: str | None) -> tuple[int, ...]:
    """``--max-tokens 256,512`` as budgets; a word that is not a positive whole number exits 2."""
    if text is None:
        return ()
    words = [t.strip() for t in text.split(",") if t.strip()]
    if not words or not all(w.isdigit() and int(w) > 0 for w in words):
        raise PlanError(f"--max-tokens {text!r}: give positive token budgets, e.g. --max-tokens 256,512")
    return tuple(int(w) for w in words)


def _render(result: SweepResult, device: str, folder: Path) -> None:
    """The sweep's tables and the advice, on the console."""
    from gradaccum.bench.report import (
        checkpointing_lines,
        comm_rows,
        compile_lines,
        fmt_bytes,
        fsdp2_rows,
        memory_predictions,
        memory_rows,
        phase_lines,
        straggler_lines,
        time_rows,
    )

    spec = result.spec
    mm = result.memory_model
    predictions = memory_predictions(result)
    console.print(
        f"global batch {spec.global_batch} = micro-batch x dp {spec.dp} x accumulation; runs per "
        f"configuration: {spec.settings.runs}, interleaved, a fresh process each; precision "
        f"{spec.settings.precision}; "
        f"device {device}; torch threads per worker: {spec.settings.threads or 'default'}"
    )
    console.print(rich_table("throughput and phase times (medians of runs)", time_rows(result.configs)))
    for line in [*phase_lines(result.configs), *straggler_lines(result.configs)]:
        console.print(escape(line))
    console.print(
        rich_table("peak memory and gradient all-reduces", memory_rows(result.configs, predictions))
    )
    if mm is None:
        console.print(f"memory model: none ({result.memory_model_note})")
    else:
        console.print(
            f"memory model: peak = {fmt_bytes(mm.persistent_bytes)} persistent + {fmt_bytes(mm.fixed_bytes)} "
            f"+ {fmt_bytes(mm.per_example_bytes)} x micro_batch ({mm.fit_words})"
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
    if any(c.spec.fsdp for c in result.configs):
        console.print(
            rich_table(
                "FSDP2 per rank: sync deferred trades gradient memory for communication",
                fsdp2_rows(result.configs),
            )
        )
    console.print(
        rich_table(
            "communication per update: naive k x G, deferred 1 x G", comm_rows(result.configs, result.comm)
        )
    )
    if "full" in spec.checkpointing:
        for line in checkpointing_lines(result):
            console.print(escape(line))
    if True in spec.compile:
        for line in compile_lines(result.configs):
            console.print(escape(line))
    if result.advice is not None:
        colour = "green" if result.advice.chosen is not None else "yellow"
        console.print(
            f"[bold {colour}]advice for {fmt_bytes(result.advice.budget_bytes)} per rank:[/bold {colour}] "
            f"{escape(result.advice.sentence)}"
            + (" (runcard.json records it)" if result.card is not None else "")
        )
    console.print(f"run folder: {escape(str(folder))}")
