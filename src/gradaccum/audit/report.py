"""What an audit returns: each cause of an accumulated update's error and one recipe's figures.
Frozen values; ``str`` gives a few plain lines, ``as_dict`` a JSON-ready mapping."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["AuditReport", "Cause"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cause:
    """One reason the accumulated update differs from the full batch's."""

    sentence: str
    """Which denominator or statistic, and by what factor, in one sentence with its figures."""
    share: float | None = None
    """Fraction of the error this cause removes when it alone is fixed, the causes before it in the
    report already fixed (measured by recomputing the update; ``None`` where it cannot be separated)."""

    def __str__(self) -> str:
        share = "" if self.share is None else f" [{self.share:.0%} of the error]"
        return f"{self.sentence}{share}"


@dataclass(frozen=True, kw_only=True, slots=True)
class AuditReport:
    """One recipe's accumulated update against the full batch's, on one window of the user's data."""

    recipe: str
    """The accumulation audited, e.g. ``Trainer`` or ``Accelerator.accumulate()``."""
    error: float | None
    """Relative L2 error of the accumulated gradient (what the optimizer receives) against the
    full batch's, float64; ``None`` when it could not be measured (``unaudited`` says why)."""
    exact_error: float | None
    """The same figure for gradaccum's exact path on the same window and model."""
    causes: tuple[Cause, ...] = ()
    """Why ``error`` is not zero, largest first where measured."""
    objective: str = ""
    """The full batch's objective the update is compared with."""
    window: str = ""
    """The window audited: micro-batches, examples and counted units."""
    unaudited: str = ""
    """What could not be audited, and why (empty when everything was)."""
    residual: float | None = None
    """Error left after every cause above was fixed (``None`` when no fix was recomputed)."""
    reference: str = ""
    """How the float64 full batch was computed: on which copy of the model (dropout off, a MoE's
    experts kernel) and in which order."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        def fig(value: float | None) -> str:
            return "not measured" if value is None else f"{value:.2e}"

        lines = [
            f"{self.recipe}: update error {fig(self.error)} against the full batch "
            f"({self.objective}); gradaccum's exact path {fig(self.exact_error)}",
        ]
        if self.window:
            lines.append(f"  window: {self.window}")
        if self.reference:
            lines.append(f"  reference: {self.reference}")
        lines += [f"  cause: {cause}" for cause in self.causes]
        if self.residual is not None and self.causes:
            lines.append(f"  left after those fixes: {self.residual:.2e}")
        if self.unaudited:
            lines.append(f"  not audited: {self.unaudited}")
        return "\n".join(lines)
