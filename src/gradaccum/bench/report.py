"""Tables and Markdown reports of a sweep or an acceptance run, in one place to import from: the
shared table builders (:mod:`~gradaccum.bench.tables`), the sweep's report
(:mod:`~gradaccum.bench.sweep_report`) and the acceptance run's (:mod:`~gradaccum.bench.accept_report`).
"""

from __future__ import annotations

from gradaccum.bench.accept_report import (
    accept_markdown,
    quality_lines,
    quality_table,
    verdict_lines,
    verdict_rows,
)
from gradaccum.bench.sweep_report import (
    checkpointing_lines,
    compile_lines,
    fsdp2_rows,
    memory_predictions,
    sweep_markdown,
)
from gradaccum.bench.tables import (
    Table,
    comm_rows,
    fmt_bytes,
    memory_lines,
    memory_rows,
    phase_lines,
    straggler_lines,
    time_rows,
)

__all__ = [
    "Table",
    "accept_markdown",
    "checkpointing_lines",
    "comm_rows",
    "compile_lines",
    "fmt_bytes",
    "fsdp2_rows",
    "memory_lines",
    "memory_predictions",
    "memory_rows",
    "phase_lines",
    "quality_lines",
    "quality_table",
    "straggler_lines",
    "sweep_markdown",
    "time_rows",
    "verdict_lines",
    "verdict_rows",
]
