"""One finding of a scan: what in a model or its loss changes under accumulation, and the fix.
The scanner (:mod:`gradaccum.hazards.scanner`) and the reader of compiled regions
(:mod:`gradaccum.hazards.compiled`) both build it."""

from __future__ import annotations

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

    @property
    def breaks_equivalence(self) -> bool:
        """True when the accumulated gradient cannot match the full-batch gradient."""
        return self.severity == "error"

    @property
    def headline(self) -> str:
        """One line naming the module: "BatchNorm2d at `layer1.0.bn1` normalizes each micro-batch ..."."""
        where = f"{self.kind} at `{self.path}`" if self.path else f"the {self.kind}"
        return f"{where} {self.summary}"

    def __str__(self) -> str:
        return f"[{self.severity}] {self.code}: {self.headline}. {self.explanation} Fix: {self.fix}"
