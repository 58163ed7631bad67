"""``gradaccum bench --mesh``: the HSDP sync policies on a device mesh, under torchrun.

Every rank builds the mesh and runs :func:`gradaccum.bench.mesh.bench_mesh`; rank 0 prints a
table per policy (calls and bytes per update per mesh dimension, measured beside the model, and the
gradient memory held) and the advisor's choice. Exit 0 when measured, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from gradaccum.cli.common import (
    EXIT_OK,
    console,
    escape,
    mesh_under_torchrun,
    parse_size,
    workload_spec,
)
from gradaccum.errors import BenchError, ConfigError

if TYPE_CHECKING:
    from gradaccum.bench.mesh import MeshBench, PolicyBench

# options of the sweep that mean nothing on a mesh, with their defaults: given, they are refused
_SWEEP_ONLY = {"configs": None, "checkpointing": "none", "sharding": "ddp", "compile": False, "dp": None}


def _refuse_sweep_options(args: argparse.Namespace) -> None:
    given = [f"--{k}" for k, default in _SWEEP_ONLY.items() if getattr(args, k, default) != default]
    if given:
        raise BenchError(
            f"bench --mesh measures the sync policies on the mesh's own ranks and layout; "
            f"{', '.join(given)} belong(s) to the sweep without --mesh: leave it out"
        )
    if args.device not in ("auto", "cpu"):
        raise BenchError(
            f"bench --mesh counts collectives and gradient bytes on CPU processes (gloo), which do not "
            f"depend on the device; leave out --device {args.device}"
        )


def run_mesh(args: argparse.Namespace) -> int:
    """The ``--mesh`` branch of ``bench`` (see the module doc)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gradaccum.bench.mesh import bench_mesh
    from gradaccum.check.workload import load_workload
    from gradaccum.mesh.layout import parse_mesh, role_sizes

    _refuse_sweep_options(args)
    shape = parse_mesh(args.mesh)
    sizes = role_sizes(shape)
    if sizes["cp"] > 1 or sizes["pp"] > 1:
        raise ConfigError(
            f"--mesh {args.mesh}: bench measures FSDP2's sync policies over data and tensor parallel "
            "dimensions (dp_replicate, dp_shard, tp); leave out cp and pp"
        )
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    mesh_under_torchrun("bench", args.mesh)
    workload = load_workload(workload_spec(args))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
        result = bench_mesh(
            workload, mesh, accum_steps=args.accum_steps, memory_budget_bytes=budget, seed=args.seed
        )
        leader = dist.get_rank() == 0
    finally:
        dist.destroy_process_group()
    if leader:
        if args.json:
            print(json.dumps(to_json(result), indent=2))
        else:
            render(result, workload.name)
    return EXIT_OK


def _policy_json(p: PolicyBench) -> dict[str, Any]:
    out = asdict(p)
    out.update(comm_bytes=p.comm_bytes, comm_calls=p.comm_calls, model_disagreements=p.disagreements())
    return out


def to_json(result: MeshBench) -> dict[str, Any]:
    """The JSON ``bench --mesh --json`` prints (fields documented in docs/distributed.md)."""
    out = asdict(result)
    out["policies"] = [_policy_json(p) for p in result.policies]
    return out


def _num(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def render(result: MeshBench, workload: str) -> None:
    from rich.table import Table

    from gradaccum.bench.report import fmt_bytes

    console.print(
        f"[bold]bench --mesh {escape(result.mesh)}[/bold] on {escape(workload)}: {result.world} ranks, "
        f"k = {result.accum_steps} micro-batches of {result.micro_batch} per data rank per update; "
        f"U = {result.fsdp_units} FSDP2 units, G = {fmt_bytes(result.grad_bytes)} of gradients per rank "
        "per micro-batch before sharding"
    )
    for p in result.policies:
        modelled = {(t.collective, t.dimension): t for t in p.modelled}
        table = Table(title=f"sync_policy={p.policy}: per optimizer update, rank 0")
        for column in ("collective", "mesh dimension", "calls", "model", "bytes", "model"):
            table.add_column(
                column, justify="left" if column in ("collective", "mesh dimension") else "right"
            )
        for t in p.measured:
            want = modelled.get((t.collective, t.dimension))
            table.add_row(
                t.collective,
                t.dimension,
                _num(t.calls),
                _num(want.calls) if want else "-",
                _num(t.bytes),
                _num(want.bytes) if want else "-",
            )
        table.add_row(
            "gradients held",
            "after k-1 backwards",
            "",
            "",
            _num(p.grad_bytes_held),
            _num(p.grad_bytes_held_model),
        )
        console.print(table)
        for line in p.disagreements():
            console.print(f"  [yellow]differs from the model[/yellow]: {escape(line)}")
    console.print(
        "  bytes: each call's payload on this rank (reduce-scatter: input; all-gather: output); "
        "all_gather: FSDP2's parameter gathers, the same under every policy (not modelled); world: the "
        "step's own count and end-of-window all-reduces"
    )
    advice = result.advice
    if advice.budget_bytes is None:
        console.print(f"[bold]trade-off[/bold]: {escape(advice.sentence)}")
    else:
        colour = "green" if advice.chosen is not None else "yellow"
        console.print(
            f"[bold {colour}]advice for {fmt_bytes(advice.budget_bytes)} of gradients per rank:"
            f"[/bold {colour}] {escape(advice.sentence)}"
        )
