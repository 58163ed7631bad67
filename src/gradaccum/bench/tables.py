"""The table builders and figures both reports share: bytes in binary units, throughput and phase
times, memory and communication per configuration, and a table in Markdown. A builder returns plain
headers and rows of strings; the CLI renders them with rich and the reports as Markdown, so both say
the same thing."""

from __future__ import annotations

from collections.abc import Sequence

from gradaccum.bench.models import CommModel, MemoryModel
from gradaccum.bench.stats import ConfigSummary

__all__ = [
    "Table",
    "comm_rows",
    "fmt_bytes",
    "markdown_table",
    "memory_lines",
    "memory_rows",
    "phase_lines",
    "straggler_lines",
    "time_rows",
]

Table = tuple[list[str], list[list[str]]]
"""Headers and rows of strings."""


def fmt_bytes(value: float | None) -> str:
    """Bytes in binary units, e.g. ``312.4 MiB``; ``-`` for None."""
    if value is None:
        return "-"
    sign = "-" if value < 0 else ""
    size = abs(float(value))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{sign}{size:.0f} {unit}" if unit == "B" else f"{sign}{size:.1f} {unit}"
        size /= 1024
    return f"{sign}{size:.1f} TiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _status(c: ConfigSummary) -> str:
    return c.status if c.runs_ok == c.runs else f"{c.status} ({c.runs_ok}/{c.runs} ok)"


def time_rows(configs: Sequence[ConfigSummary]) -> Table:
    """Throughput (median, min..max of runs) and phase times, one row per configuration."""
    unit = configs[0].unit if configs else "tokens"
    headers = [
        "config",
        "status",
        f"{unit}/s",
        "min..max (spread)",
        "step ms",
        "count ms",
        "micro ms",
        "sync ms",
        "optim ms",
        "other ms",
        "skipped",
    ]
    rows = []
    for c in configs:
        u = c.units_per_s
        rows.append(
            [
                c.spec.row_label,
                _status(c),
                "-" if u is None else f"{u.median:,.0f}",
                "-" if u is None else f"{u.low:,.0f}..{u.high:,.0f} ({u.relative:.0%})",
                "-" if c.step_ms is None else f"{c.step_ms.median:.2f}",
                _ms(c.count_ms),
                _ms(c.micro_ms),
                _ms(c.sync_ms),
                _ms(c.optimizer_ms),
                _ms(c.other_ms),
                f"{c.skipped_updates}/{c.updates}",
            ]
        )
    return headers, rows


def phase_lines(configs: Sequence[ConfigSummary]) -> list[str]:
    """Where a step's time goes, as means per update that add up, with what is not broken down."""
    lines = [
        "Where a step goes, mean ms per update over every run (means add up; the table's medians need "
        "not): count: counting the window's units (and agreeing on them across ranks); micro-batches: "
        "their forwards and backwards (the synchronizing one included); optimizer: the agreement, host "
        "reads, clipping and the step; other: the rest, not broken down (the window's checks before the "
        "count, moving each micro-batch to the device, the result after the step)."
    ]
    for c in configs:
        means = c.phase_means_ms
        if means is None:
            continue
        count_ms, micro, optim, other, step = means
        k = c.spec.accum_steps
        each = f" ({k} x {micro / k:.2f})" if c.spec.max_tokens is None else ""  # a budget varies k
        lines.append(
            f"- {c.spec.row_label}: count {count_ms:.2f} + micro-batches {micro:.2f}{each} "
            f"+ optimizer {optim:.2f} + other {other:.2f} = step {step:.2f} ms"
        )
    return lines


def straggler_lines(configs: Sequence[ConfigSummary]) -> list[str]:
    """Under DDP: how long the slowest rank's window took against the ranks' mean, measured."""
    timed = [c for c in configs if c.straggler is not None]
    if not timed:
        return []
    lines = [
        "Stragglers (DDP): the slowest rank's window time over the ranks' mean, each rank timed from "
        "the update's start to its last gradient bucket handed to the all-reduce (its own work, "
        "before it waits for the others); median of each run's windows, min..max of runs."
    ]
    for c in timed:
        s = c.straggler
        assert s is not None
        lines.append(f"- {c.spec.row_label}: {s.median:.3f}x ({s.low:.3f}..{s.high:.3f})")
    return lines


def memory_rows(configs: Sequence[ConfigSummary], predictions: Sequence[float | None] | None = None) -> Table:
    """Memory from the tensors (persistent, activation, gradients held), CUDA's peaks, peak RSS and
    all-reduces."""
    headers = [
        "config",
        "persistent",
        "activations / micro-batch",
        "of which recomputed",
        "gradients held (window)",
        "CUDA max allocated",
        "CUDA max reserved",
        "peak RSS (process)",
        "all-reduces/upd",
        "all-reduced/upd",
    ]
    if predictions is not None:
        headers.insert(5, "model predicts")
    rows = []
    for i, c in enumerate(configs):
        m = c.memory
        row = [
            c.spec.row_label,
            fmt_bytes(None if m is None else m.persistent_bytes),
            fmt_bytes(None if m is None else m.activation_bytes),
            "-" if m is None or c.spec.checkpointing == "none" else fmt_bytes(m.recompute_bytes),
            fmt_bytes(None if m is None else m.held_gradient_bytes),
            fmt_bytes(c.peak_allocated_bytes),
            fmt_bytes(c.peak_reserved_bytes),
            fmt_bytes(c.peak_rss_bytes),
            "-" if c.allreduce_calls_per_update is None else str(c.allreduce_calls_per_update),
            fmt_bytes(c.allreduce_bytes_per_update),
        ]
        if predictions is not None:
            row.insert(5, fmt_bytes(predictions[i]))
        rows.append(row)
    return headers, rows


def comm_rows(configs: Sequence[ConfigSummary], models: Sequence[CommModel | None]) -> Table:
    """The communication model beside the measured bytes, per configuration."""
    headers = [
        "config",
        "k",
        "gradient G",
        "naive k x G",
        "deferred 1 x G",
        "mode",
        "measured/upd",
        "matches",
    ]
    rows = []
    for c, m in zip(configs, models, strict=True):
        if m is None:
            k = "-" if c.spec.max_tokens is not None else str(c.spec.accum_steps)
            rows.append([c.spec.row_label, k, "-", "-", "-", "-", "-", "-"])
            continue
        matches = m.matches
        rows.append(
            [
                c.spec.row_label,
                str(m.accum_steps),
                fmt_bytes(m.gradient_bytes),
                fmt_bytes(m.naive_bytes),
                fmt_bytes(m.deferred_bytes),
                "deferred" if m.defer_sync else "naive",
                "- (no DP)" if m.measured_bytes is None else fmt_bytes(m.measured_bytes),
                "-" if matches is None else ("yes" if matches else "NO"),
            ]
        )
    return headers, rows


def markdown_table(table: Table) -> str:
    """A table as Markdown; a ``|`` inside a cell becomes ``/``."""
    headers, rows = table
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def memory_lines(model: MemoryModel | None, note: str | None, advice: str | None) -> list[str]:
    """The memory model in words, and the budget's advice."""
    if model is None:
        return [f"No memory model: {note}."]
    lines = [
        f"peak ~ {fmt_bytes(model.persistent_bytes)} persistent + {fmt_bytes(model.fixed_bytes)} + "
        f"{fmt_bytes(model.per_example_bytes)} x micro_batch of activations ({model.fit_words}). "
        "Accumulation shrinks only the activation term; the persistent term is the same for every "
        "factorization.",
    ]
    if advice is not None:
        lines.append(f"Budget: {advice}.")
    return lines
