"""One finding of a scan: what in a model or its loss changes under accumulation, and the fix.
The scanner (:mod:`gradaccum.hazards.scanner`) and the reader of compiled regions
(:mod:`gradaccum.hazards.compiled`) both build it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from gradaccum.fielddocs import document_fields

__all__ = ["Finding", "Severity"]

Severity = Literal["error", "warning", "info"]


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    """One thing in a model or its loss that changes under accumulation, and what to do about it."""

    code: str
    """Stable rule name: ``batch-norm``, ``running-stats``, ``random-layer``, ``moe-router``,
    ``declared-hazard``, ``compiled-python-denominator``, ``low-precision-accumulation``, ``note``
    or ``verify``."""
    severity: Severity
    """``error``: the accumulated gradient differs from the full batch's, so verify fails;
    ``warning``: gradients match, but something else changes with k (running estimates, random
    draws); ``info``: a note."""
    path: str
    """The module's path in the model (``layer1.0.bn1``); ``""`` for the loss or the whole model."""
    kind: str
    """The module's class name (``BatchNorm2d``), or ``loss``/``scan`` for findings without a module."""
    summary: str
    """A clause completing "<kind> at `path` ...", e.g. "normalizes each micro-batch separately"."""
    explanation: str
    """Why, with the figures (micro-batch sizes, momentum per step)."""
    fix: str
    """What to do about it."""
    figures: dict[str, float] = field(default_factory=dict)
    """The numbers in the explanation, by name (``effective_momentum``, ``accum_steps``, ...)."""
    handled_by: str = ""
    """What in the run at hand removes the finding's effect (the gradient cache, the window's load
    balance), said in the summary too; ``""`` when nothing does. A handled finding is a note."""

    @property
    def breaks_equivalence(self) -> bool:
        """True when the accumulated gradient cannot match the full-batch gradient."""
        return self.severity == "error"

    @property
    def headline(self) -> str:
        """One line naming the module: "BatchNorm2d at `layer1.0.bn1` normalizes each micro-batch ..."."""
        where = f"{self.kind} at `{self.path}`" if self.path else f"the {self.kind}"
        return f"{where} {self.summary}"

    def handled(self, by: str, *, explanation: str, fix: str, clause: str | None = None) -> Finding:
        """This finding as a note: ``by`` (what gradaccum's own path runs here) removes its effect,
        and the summary says so ("uses in-batch negatives, handled here by the gradient cache
        (CachedAccumulator)"); ``clause`` shortens the scan's summary before it (default: all of it)."""
        return dataclasses.replace(
            self,
            severity="info",
            handled_by=by,
            summary=f"{self.summary if clause is None else clause}, handled here by {by}",
            explanation=explanation,
            fix=fix,
        )

    def measured(self, severity: Severity, *, summary: str, explanation: str) -> Finding:
        """This finding with the severity a measurement gives it: ``summary`` is added to the
        clause and ``explanation`` put before the scan's own (which the measurement qualifies)."""
        return dataclasses.replace(
            self,
            severity=severity,
            summary=f"{self.summary}; {summary}",
            explanation=f"{explanation} {self.explanation}",
        )

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code}: {self.headline}. {self.explanation} Fix: {self.fix}"
