"""What ``gradaccum audit`` returns: one row per accumulation recipe of the installed frameworks,
each the relative L2 error of the gradient its optimizer receives against the full batch's, in
float64. Frozen values; ``as_dict`` gives a JSON-ready mapping, ``markdown`` a table."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["RecipeRow", "StackAudit"]

Status = Literal["measured", "not installed", "not run"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeRow:
    """One recipe on the window."""

    recipe: str
    """The accumulation, e.g. ``Accelerator.accumulate()``."""
    framework: str
    """The package that provides it (``torch`` for the hand-written loop)."""
    status: Status
    error: float | None
    """Relative L2 error of the accumulated gradient against the full batch's (``None`` unless measured)."""
    cause: str
    """Why the error is what it is, or why the recipe was not run, in a sentence with its figures."""
    version: str = ""
    name: str = ""
    """The row's name (``gradaccum audit --only``/``--skip``; :data:`gradaccum.audit.rows.ROWS`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StackAudit:
    """Every recipe's update error on one window of a workload's model and data."""

    workload: str
    objective: str
    """The full batch's objective every row is compared with."""
    window: str
    """Micro-batches, examples and counted units of the window."""
    counts: tuple[int, ...]
    """Units counted per micro-batch (``count_fn``)."""
    model: str
    """How the audited copy was made (precision, randomness)."""
    rows: tuple[RecipeRow, ...]
    reference: str = ""
    """How the full batch's gradient every row is compared with was computed (independently of
    every row's micro-batch loop)."""
    skipped: tuple[str, ...] = ()
    """The names of the rows not asked for."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def markdown(self) -> str:
        lines = [
            f"# gradaccum audit: {self.workload}",
            "",
            f"- objective: {self.objective}",
            f"- window: {self.window}",
            f"- model: {self.model}",
            *([f"- reference: {self.reference}"] if self.reference else []),
            *([f"- rows not run (not asked for): {', '.join(self.skipped)}"] if self.skipped else []),
            "",
            "| row | recipe | framework | update error | cause |",
            "|---|---|---|---:|---|",
        ]
        for row in self.rows:
            error = f"{row.error:.2e}" if row.error is not None else row.status
            framework = f"{row.framework} {row.version}".strip()
            cause = row.cause.replace("|", "/")
            lines.append(f"| {row.name} | {row.recipe} | {framework} | {error} | {cause} |")
        return "\n".join(lines) + "\n"
