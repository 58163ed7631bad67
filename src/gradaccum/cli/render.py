"""Shared rendering for the subcommands: one rich console, tables, pass/fail marks."""

from __future__ import annotations

from rich.console import Console

__all__ = ["console", "mark", "yes_no"]

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
