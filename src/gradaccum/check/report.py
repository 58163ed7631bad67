"""The reports of the equivalence check: the float64 diagnostic's and the production traces'."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from gradaccum.check.audit import CountAudit, audit_failure, summarize_audits
from gradaccum.check.tolerances import Tolerance
from gradaccum.errors import EquivalenceError
from gradaccum.fielddocs import document_fields
from gradaccum.hazards.scanner import Finding

__all__ = ["EquivalenceReport", "ParamRow", "TraceReport", "against", "describe_sizes", "exceeds"]


def exceeds(value: float, tol: float) -> bool:
    """Whether ``value`` fails its tolerance: above it, or not a finite number."""
    return not value <= tol


def against(value: float, tol: object, bound: float) -> str:
    """``(tol T)`` beside a figure within its tolerance ``bound``; ``(over tol T)`` or
    ``(non-finite, tol T)`` beside one that fails it, so that a FAIL line says which figure failed."""
    if not exceeds(value, bound):
        return f"(tol {tol})"
    return f"({'over' if math.isfinite(value) else 'non-finite,'} tol {tol})"


def describe_sizes(sizes: tuple[int, ...] | list[int]) -> str:
    """Micro-batch sizes in words: ``4 micro-batches of 8 examples``, or the list when they differ."""
    parts = list(sizes)
    if parts and len(set(parts)) == 1:
        n = len(parts)
        return f"{n} micro-batch{'es' if n != 1 else ''} of {parts[0]} example{'s' if parts[0] != 1 else ''}"
    return f"micro-batches of {parts} examples"


class ParamRow(NamedTuple):
    """One parameter's errors: ``(name, grad_rel_err, param_abs_diff)``."""

    name: str
    grad_rel_err: float
    """Relative L2 error of the accumulated gradient (floored by ``check.equivalence.FLOOR_RATIO``)."""
    param_abs_diff: float
    """Largest absolute difference after one optimizer update."""


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class EquivalenceReport:
    """The outcome of one equivalence check."""

    passed: bool
    """Gradients and parameters both within their tolerances."""
    grad_max_rel_err: float
    """Worst per-parameter relative L2 error of the gradient, before clipping."""
    param_max_abs_diff: float
    """Worst absolute parameter difference after one optimizer update."""
    grad_tol: Tolerance
    """The gradient tolerance for ``dtype``, with the arithmetic that justifies it."""
    param_tol: Tolerance
    """The parameter tolerance for ``dtype``, with its justification."""
    worst: tuple[ParamRow, ...]
    """Every parameter, worst gradient error first."""
    likely_causes: tuple[str, ...]
    """Why it failed, most specific first; empty when it passed."""
    sizes: tuple[int, ...]
    """The partition of the batch into micro-batches (examples per micro-batch)."""
    dtype: str
    """The diagnostic precision, e.g. ``float64``."""
    counts: tuple[int, ...] = ()
    """Units ``count_fn`` counts in each micro-batch; their sum is the denominator N."""
    unit: str = "units"
    """What ``count_fn`` counts ("tokens", "examples")."""
    reference_loss: float = math.nan
    """The full-batch loss (summed loss / N) at the initial weights."""
    candidate_loss: float | None = None
    """The accumulated step's loss (None for a custom ``candidate_step``)."""
    buffer_max_abs_diff: float | None = None
    """Worst difference of floating buffers (running statistics) after the step; not part of
    ``passed``, which is about the update. None when the model has none."""
    findings: tuple[Finding, ...] = ()
    """The scan of the model for this partition, the declared hazards included."""
    disabled: tuple[str, ...] = ()
    """The random sources switched off for the diagnostic (``h.0.attn.attn_dropout.p=0.1``), the
    same ones the scan reports; restored when the check returns."""
    audit: tuple[CountAudit, ...] = ()
    """The denominator audit of each micro-batch (empty when ``audit=False``)."""
    candidate: str = "Accumulator.step"
    """What produced the accumulated update."""
    name: str = ""
    """The workload's name, when there is one."""
    device: str = "cpu"
    """Where the diagnostic ran."""

    @property
    def grad_passed(self) -> bool:
        return self.grad_max_rel_err <= self.grad_tol.value

    @property
    def param_passed(self) -> bool:
        return self.param_max_abs_diff <= self.param_tol.value

    @property
    def window(self) -> str:
        """The examples the check counts and compares, in words: "the 8 examples of the checked
        batch"; the counts and the denominator audit are over these."""
        n = sum(self.sizes)
        return f"the {n} example{'s' if n != 1 else ''} of the checked batch"

    @property
    def audit_summary(self) -> str:
        """One line on the denominator: consistent, the first mismatch and its fix, or not audited."""
        if not self.audit:
            return "not audited: the audit was turned off"
        return summarize_audits(self.audit, unit=self.unit, window=self.window)

    @property
    def failures(self) -> tuple[str, ...]:
        """What failed, one clause each with its figure (the denominator, the gradients, the
        parameters); empty when the check passed."""
        causes = []
        denominator = audit_failure(self.audit, unit=self.unit)
        if denominator is not None:
            causes.append(denominator)
        for what, value, tol in (
            ("gradient max rel err", self.grad_max_rel_err, self.grad_tol),
            ("parameter max abs diff", self.param_max_abs_diff, self.param_tol),
        ):
            if exceeds(value, tol.value):
                causes.append(f"{what} {value:.2e} {against(value, tol, tol.value)}")
        if not causes and not self.passed:
            causes.append("the candidate step failed (see the likely causes)")
        return tuple(causes)

    @property
    def global_count(self) -> int:
        return sum(self.counts)

    def summary(self) -> str:
        """One line: the verdict and both errors against their tolerances. A FAIL names its cause
        on the line: a figure marked over its tolerance, or the failed denominator first."""
        verdict = "PASS" if self.passed else "FAIL"
        denominator = None if self.passed else audit_failure(self.audit, unit=self.unit)
        cause = f"{denominator}; " if denominator else ""
        grad = against(self.grad_max_rel_err, self.grad_tol, self.grad_tol.value)
        param = against(self.param_max_abs_diff, self.param_tol, self.param_tol.value)
        return (
            f"{verdict}: {cause}gradient max rel err {self.grad_max_rel_err:.2e} {grad}, "
            f"parameter max abs diff {self.param_max_abs_diff:.2e} {param}, "
            f"{self.dtype}, micro-batches {list(self.sizes)}"
        )

    def __str__(self) -> str:
        """A few lines to print: what was compared, the verdict with its errors, the denominator,
        and the likely causes of a failure (the dataclass's repr holds every parameter's row)."""
        what = f"{self.name}: " if self.name else ""
        lines = [
            f"{what}{self.candidate} over {describe_sizes(self.sizes)} against the full batch",
            f"  {self.summary()}",
            f"  denominator: {self.audit_summary}",
        ]
        lines += [f"  likely cause: {c}" for c in self.likely_causes]
        return "\n".join(lines)

    def raise_if_failed(self) -> EquivalenceReport:
        """Raise :class:`EquivalenceError` naming the likely causes unless the check passed."""
        if not self.passed:
            causes = "".join(f"\n  - {c}" for c in self.likely_causes)
            raise EquivalenceError(f"{self.name or 'the model'}: {self.summary()}; likely causes:{causes}")
        return self


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class TraceReport:
    """Stage 2: loss and gradient-norm traces of two partitionings over the same optimizer steps."""

    passed: bool
    """Both traces within ``tol`` on every step, and the same steps skipped (if any) in both."""
    steps: int
    """Optimizer steps run on each side (the predeclared window)."""
    dtype: str
    """The production precision the model and inputs were cast to."""
    baseline_sizes: tuple[int, ...]
    """Micro-batch sizes of the baseline, usually the whole batch in one (``(8,)``)."""
    candidate_sizes: tuple[int, ...]
    """Micro-batch sizes of the candidate partitioning."""
    baseline_loss: tuple[float, ...]
    """Mean loss per step (NaN where the step was skipped)."""
    candidate_loss: tuple[float, ...]
    """The candidate's mean loss per step, the same way."""
    baseline_grad_norm: tuple[float, ...]
    """Gradient norm before clipping per step (NaN where skipped)."""
    candidate_grad_norm: tuple[float, ...]
    """The candidate's gradient norm per step, the same way."""
    loss_max_rel_diff: float
    """Largest ``|candidate - baseline| / |baseline|`` over the loss trace."""
    grad_norm_max_rel_diff: float
    """Largest relative difference over the gradient-norm trace."""
    tol: Tolerance
    """The relative tolerance both traces must keep, with its justification."""
    skipped: tuple[str, ...] = ()
    """Steps skipped by either side, with the reason."""
    seed: int = 0
    """Seed of the initialization; step ``s`` draws its batch with seed ``seed + s``."""
    name: str = ""
    """The workload's name, when there is one."""
    device: str = "cpu"
    """Where the traces ran."""

    def __str__(self) -> str:
        return f"{self.name}: {self.summary()}" if self.name else self.summary()

    @property
    def same_skips(self) -> bool:
        """Both sides skipped the same steps (NaN loss at the same places)."""
        return [math.isnan(x) for x in self.baseline_loss] == [math.isnan(x) for x in self.candidate_loss]

    @property
    def failures(self) -> tuple[str, ...]:
        """What failed, one clause each with its figure; empty when the traces agree."""
        causes = []
        if not self.same_skips:
            causes.append(
                f"the sides skipped different steps (baseline {_skipped(self.baseline_loss)}, candidate "
                f"{_skipped(self.candidate_loss)})"
            )
        for what, value in (("loss", self.loss_max_rel_diff), ("gradient-norm", self.grad_norm_max_rel_diff)):
            if exceeds(value, self.tol.value):
                causes.append(f"{what} max rel diff {value:.2e} {against(value, self.tol, self.tol.value)}")
        if not causes and not self.passed:
            causes.append("the traces were marked failed")
        return tuple(causes)

    def summary(self) -> str:
        """One line: the verdict and both traces' differences; a FAIL marks each figure against the
        tolerance and names skipped steps that differ first."""
        base, cand = describe_sizes(self.baseline_sizes), describe_sizes(self.candidate_sizes)
        sides = f"baseline {base} vs candidate {cand}"
        head = f"over {self.steps} steps in {self.dtype}"
        loss, norm = self.loss_max_rel_diff, self.grad_norm_max_rel_diff
        if self.passed:
            return (
                f"PASS: {head}, loss max rel diff {loss:.2e}, gradient-norm max rel diff {norm:.2e} "
                f"(tol {self.tol}), {sides}"
            )
        skips = "" if self.same_skips else f"{self.failures[0]}; "
        return (
            f"FAIL: {skips}{head}, loss max rel diff {loss:.2e} {against(loss, self.tol, self.tol.value)}, "
            f"gradient-norm max rel diff {norm:.2e} {against(norm, self.tol, self.tol.value)}, {sides}"
        )


def _skipped(loss: tuple[float, ...]) -> str:
    steps = [i for i, x in enumerate(loss) if math.isnan(x)]
    return f"step{'s' if len(steps) != 1 else ''} {', '.join(map(str, steps))}" if steps else "none"
