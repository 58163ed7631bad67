"""The console and what prints on it: coloured marks, tables, the progress bar of measurements and
the findings of a scan. Imports nothing heavy, so ``--help`` starts without torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from gradaccum.bench.sweep import ProgressEvent
    from gradaccum.hazards.scanner import Finding

__all__ = [
    "console",
    "escape",
    "group_findings",
    "mark",
    "progress_bar",
    "render_findings",
    "rich_table",
    "yes_no",
]

_probe = Console()
# Piped output (CI logs, files) gets a wide table instead of rich's 80-column default. No emoji codes:
# user text such as a workload "a:b:c" must print as written, not with ":b:" turned into a symbol.
console = Console(highlight=False, soft_wrap=True, emoji=False, width=None if _probe.is_terminal else 140)


def mark(ok: bool | None) -> str:
    """A coloured PASS/FAIL (or n/a) for tables."""
    if ok is None:
        return "[dim]n/a[/dim]"
    return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"


def yes_no(value: bool | None) -> str:
    """A coloured yes/no (or n/a) for comparisons that are facts, not checks."""
    if value is None:
        return "[dim]n/a[/dim]"
    return "[green]yes[/green]" if value else "[yellow]no[/yellow]"


def rich_table(title: str, table: tuple[list[str], list[list[str]]]) -> Table:
    headers, rows = table
    out = Table(title=title)
    for i, h in enumerate(headers):
        out.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        out.add_row(*row)
    return out


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[ProgressEvent], None] | None]:
    """A rich progress bar on stderr (stdout stays clean for --json); ``None`` when disabled."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True, emoji=False, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("runs", total=None)

        def on_progress(event: ProgressEvent) -> None:
            label = f"{event.spec.label} run {event.run_index + 1}"
            if event.record is None:
                bar.update(task, total=event.total, completed=event.done, description=f"measuring {label}")
                return
            bar.update(task, completed=event.done)
            if not event.record.ok:
                first = (event.record.error or "").strip().splitlines()
                # a worker's error text is not markup: "[...]" or ":b:" in it are printed as they are
                detail = escape(first[0] if first else "")
                bar.console.print(f"[yellow]{escape(label)}: {event.record.status}[/yellow] {detail}")

        yield on_progress


# -- findings ------------------------------------------------------------------------------------

_STYLE = {"error": "red", "warning": "yellow", "info": "dim"}


def _join(paths: Sequence[str]) -> str:
    quoted = [f"`{p}`" for p in paths]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def group_findings(findings: Sequence[Finding]) -> list[tuple[Finding, list[str]]]:
    """Findings that differ only in the module path, merged (a ResNet has dozens of BatchNorms)."""
    groups: dict[tuple[str, ...], tuple[Finding, list[str]]] = {}
    for f in findings:
        key = (f.code, f.severity, f.kind, f.summary, f.explanation, f.fix)
        groups.setdefault(key, (f, []))[1].append(f.path)
    return list(groups.values())


def render_findings(findings: Sequence[Finding], *, details: bool = True) -> None:
    """Print findings, one block per group; ``details=False`` prints the headlines only."""
    for finding, paths in group_findings(findings):
        style = _STYLE[finding.severity]
        many = len(paths) > 1
        head = f"{finding.kind} at {_join(paths)}: {finding.summary}" if many else finding.headline
        console.print(f"[{style}]\\[{finding.severity}][/{style}] {finding.code}: {escape(head)}")
        if details:
            console.print(f"    {escape(finding.explanation)}")
            console.print(f"    fix: {escape(finding.fix)}")
