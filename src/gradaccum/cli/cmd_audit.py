"""``gradaccum audit``: the accumulation recipes of the installed frameworks on a workload's model and
data, each against the float64 full batch, beside gradaccum's exact ``Accumulator``.

One window (the workload's batch in micro-batches of ``--micro-batch``) runs through a hand-written
``loss / k`` loop, Accelerate's ``Accelerator.accumulate()``, Lightning's
``Trainer(accumulate_grad_batches=k)``, DeepSpeed's engine, the transformers ``Trainer`` (``hf:``
workloads) and ``Accumulator.step``, each on a float64 copy of the model
(:mod:`gradaccum.audit.recipes`), against the whole window in one forward and backward.
``--only``/``--skip`` choose rows by name (:mod:`gradaccum.audit.rows`). The table is printed and
written to ``--out`` as ``audit.json`` and ``audit.md``. Exit 0 when it measured, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from gradaccum.audit.rows import GROUPS, ROWS, known_names, select_rows
from gradaccum.cli.common import (
    EXIT_OK,
    Flag,
    add_command,
    add_flags,
    add_workload_option,
    check_output_folder,
    console,
    escape,
    int_at_least,
    output_folder,
    workload_spec,
)
from gradaccum.errors import PlanError
from gradaccum.names import HF_PREFIX

_ROW_LIST = ", ".join(row.name for row in ROWS)
_GROUP_LIST = "; ".join(f"{name}: {' and '.join(rows)}" for name, rows in GROUPS.items())


def register(subparsers: argparse._SubParsersAction) -> None:
    add_command(
        subparsers,
        "audit",
        "measure how far each installed framework's accumulation is from the full batch",
        "Run one window of the workload's data through a hand-written loss / k loop, Accelerate's "
        "Accelerator.accumulate(), Lightning's Trainer(accumulate_grad_batches=k), DeepSpeed's "
        "engine, the transformers Trainer(gradient_accumulation_steps=k) (hf: workloads) and "
        "gradaccum's Accumulator, each on a float64 copy of the model (dropout off), and compare the "
        "gradient each optimizer receives with the full batch's: the whole window in one forward and "
        f"backward, as verify computes it. Rows: {_ROW_LIST} ({_GROUP_LIST}); --skip deepspeed leaves "
        "out the slow ones. Frameworks not installed are listed as such. Writes audit.json and "
        "audit.md to --out. Exit 0 when it measured, 2 on bad input.",
        _add_options,
        run,
    )


def _add_options(p: argparse.ArgumentParser) -> None:
    add_workload_option(p)
    add_flags(
        p,
        Flag(
            "--micro-batch",
            "N",
            int_at_least(1),
            "examples per micro-batch; must divide the workload's batch (default: the workload's)",
        ),
        Flag("--seed", None, int_at_least(0), "initialization/data seed", 0),
        Flag("--out", "DIR", output_folder, "where audit.json and audit.md go", Path("runs/audit")),
        Flag(
            "--only",
            "ROW[,ROW]",
            _row_names,
            f"run only these rows ({', '.join(known_names())}); not with --skip (default: every row)",
        ),
        Flag(
            "--skip",
            "ROW[,ROW]",
            _row_names,
            "leave out these rows, e.g. --skip deepspeed (both DeepSpeed rows, the slow ones); not with "
            "--only (default: none left out)",
        ),
    )


def _row_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def run(args: argparse.Namespace) -> int:
    import torch

    from gradaccum.audit.recipes import audit_stack
    from gradaccum.check.runs import fresh
    from gradaccum.check.workload import load_workload

    rows = select_rows(args.only, args.skip, settings=("--only", "--skip"))  # before any model is built
    check_output_folder(args.out, "--out")
    workload = load_workload(workload_spec(args))
    if args.workload.startswith(HF_PREFIX):
        from gradaccum.workloads.experts import eager_experts

        workload, note = eager_experts(  # the fused expert kernels take no float64
            workload,
            what="the audit's float64 copies",
            fix="save the folder with experts_implementation='eager' in its config (the audit runs in "
            "float64 only)",
        )
        if note is not None:
            console.print(escape(note))
    micro = args.micro_batch or workload.micro_batch
    n = workload.batch_size
    if n % micro:
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise PlanError(
            f"--micro-batch {micro} does not divide the batch of {n} examples of workload "
            f"{workload.name!r}; use a divisor of {n} ({divisors})"
        )
    console.print(f"[bold]audit {escape(workload.name)}[/bold]: {escape(workload.description)}")
    result = audit_stack(
        fresh(workload.build_model, torch.float64, torch.device("cpu"), args.seed),
        workload.batch(args.seed),
        workload.loss_fn,
        workload.count_fn,
        micro_batch=micro,
        workload=workload.name,
        unit=workload.unit,
        progress=lambda line: console.print(escape(line)),
        rows=rows,
        causal_lm=workload.extras.get("loss") if args.workload.startswith(HF_PREFIX) else None,
    )
    console.print(f"  objective: {escape(result.objective)}")
    console.print(f"  window: {escape(result.window)}")
    console.print(f"  model: {escape(result.model)}")
    console.print(f"  reference: {escape(result.reference)}")
    if result.skipped:
        flag = f"--only {','.join(args.only)}" if args.only is not None else f"--skip {','.join(args.skip)}"
        console.print(f"  rows not run ({escape(flag)}): {escape(', '.join(result.skipped))}")
    table = Table(show_edge=False)
    for column in ("row", "recipe", "framework", "update error", "cause"):
        table.add_column(column, justify="right" if column == "update error" else "left")
    for row in result.rows:
        error = f"{row.error:.2e}" if row.error is not None else row.status
        table.add_row(
            escape(row.name),
            escape(row.recipe),
            escape(f"{row.framework} {row.version}".strip()),
            error,
            escape(row.cause),
        )
    console.print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "audit.json").write_text(json.dumps(result.as_dict(), indent=2) + "\n", encoding="utf-8")
    (args.out / "audit.md").write_text(result.markdown(), encoding="utf-8")
    console.print(f"written: {escape(str(args.out / 'audit.json'))}, {escape(str(args.out / 'audit.md'))}")
    return EXIT_OK
