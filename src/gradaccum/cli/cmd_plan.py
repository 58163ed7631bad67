"""``gradaccum plan``: the batch equation and whether plans hold the optimization fixed."""

from __future__ import annotations

import argparse

from rich.table import Table

from gradaccum.cli.common import Flag, add_command, add_flags, console, int_at_least, parse_plan, yes_no
from gradaccum.errors import PlanError
from gradaccum.plan import BatchPlan, compare_plans

# The worked example shown with no arguments: an epoch of 25,600 sequences of 2,048 tokens on 8
# data-parallel replicas, a plan A, a plan B that moves a factor of 2 from the micro-batch into the
# accumulation (same optimization), and one that also changes the global batch (a different one).
EXAMPLE_PLANS = {"A": "8x8x4", "B": "4x8x8", "changed-batch": "4x8x1"}


def _named_plan(text: str) -> tuple[str, BatchPlan]:
    name, sep, spec = text.partition("=")
    return (name, parse_plan(spec)) if sep else (text, parse_plan(text))


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "plan",
        "print the batch equation and compare plans",
        "Print the batch equation of each plan and whether it holds global batch, "
        "tokens per step and update count fixed against the first. With no plans: a worked example of "
        "25,600 sequences on 8 replicas (A = 8x8x4, B = 4x8x8, changed-batch = 4x8x1).",
        _add_options,
        run,
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "plans",
        nargs="*",
        metavar="[NAME=]MICROxDPxACCUM",
        help="plans to compare, the first is the baseline; MICRO examples per forward, DP replicas, "
        "ACCUM micro-batches per optimizer step (default: A=8x8x4 B=4x8x8 changed-batch=4x8x1)",
    )
    add_flags(
        p,
        Flag("--seq-len", "N", int_at_least(1), "tokens per sequence (default 2048)", 2048),
        Flag("--dataset-size", "N", int_at_least(0), "sequences in one epoch (default 25600)", 25_600),
        Flag(
            "--mesh",
            "NAME=SIZE,...",
            None,
            "the device mesh, e.g. dp_replicate=2,dp_shard=4,cp=2,tp=2,pp=2: the batch equation "
            "with its dimensions (dp = dp_replicate x dp_shard; cp, tp and pp ranks share samples); "
            "each plan's DP must equal the mesh's (default: no mesh)",
        ),
    )
    p.add_argument(
        "--final-window",
        choices=("keep", "drop"),
        default="keep",
        help="count a final partial window as an update (keep) or discard it (drop) (default keep)",
    )


def run(args: argparse.Namespace) -> int:
    named = (
        [_named_plan(t) for t in args.plans]
        if args.plans
        else [(name, parse_plan(spec)) for name, spec in EXAMPLE_PLANS.items()]
    )
    plans = dict(named)
    if len(plans) != len(named):
        names = [name for name, _ in named]
        repeated = sorted({name for name in names if names.count(name) > 1})
        raise PlanError(f"plan names must be unique; {', '.join(repeated)} is given more than once")
    if args.mesh is not None:
        _print_mesh(args.mesh, plans)
    comparison = compare_plans(
        plans, seq_len=args.seq_len, dataset_size=args.dataset_size, final_window=args.final_window
    )
    table = Table(title="global batch = micro-batch x dp replicas x accumulation steps")
    for col in (
        "plan",
        "micro",
        "dp",
        "accum",
        "global batch",
        "tokens/step",
        "updates/epoch",
        "same batch",
        "same tokens",
        "same updates",
    ):
        table.add_column(col, justify="right" if col not in ("plan",) else "left")
    for row in comparison.rows:
        p = row.plan
        table.add_row(
            row.name,
            str(p.micro_batch),
            str(p.dp),
            str(p.accum_steps),
            f"{p.global_batch:,}",
            f"{row.tokens_per_step:,}",
            f"{row.optimizer_updates:,}",
            yes_no(row.same_global_batch),
            yes_no(row.same_tokens),
            yes_no(row.same_updates),
        )
    for name, plan in plans.items():
        console.print(f"{name}: {plan.equation()}")
    console.print(table)
    console.print(
        f"(seq_len {args.seq_len}, dataset {args.dataset_size:,} sequences, final partial "
        f"window: {args.final_window}; TP/PP/CP ranks do not multiply the batch)"
    )
    for line in comparison.verdicts():
        console.print(line)
    return 0


def _print_mesh(text: str, plans: dict[str, BatchPlan]) -> None:
    """The mesh's part of the batch equation; a plan whose DP the mesh does not give is refused."""
    from gradaccum.mesh.layout import ROLES, parse_mesh, role_sizes

    shape = parse_mesh(text)
    sizes = role_sizes(shape)
    dp = sizes["dp_replicate"] * sizes["dp_shard"]
    world = 1
    for size in sizes.values():
        world *= size
    for name, plan in plans.items():
        if plan.dp != dp:
            raise PlanError(
                f"plan {name} has dp={plan.dp} but the mesh {text} gives dp = dp_replicate x dp_shard "
                f"= {sizes['dp_replicate']} x {sizes['dp_shard']} = {dp}; write the plan as MICROx{dp}xACCUM"
            )
    shown = " x ".join(f"{role}={sizes[role]}" for role in ROLES)
    console.print(f"mesh {shown} = {world} ranks")
    console.print(
        f"  dp = dp_replicate x dp_shard = {dp}: they hold different samples and multiply the batch; "
        f"cp={sizes['cp']} ranks split each sequence (the count N sums over them), tp={sizes['tp']} and "
        f"pp={sizes['pp']} ranks split the model (they hold the same tokens): neither multiplies it"
    )
